"""The event record stream (DESIGN §7): JSON lines of quorum, merge, adoption, failover, join, ...

Records are plain dicts with a ``kind`` and a time ``t`` (virtual seconds in the in-process runner, wall
seconds in a node). ``protocol.goodput`` computes goodput from them; nothing else is needed to replay a run.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import IO


class EventLog:
    """Keeps records in memory and, when given a path, appends each as a JSON line."""

    def __init__(self, path: str | Path | None = None, flush: bool = False, append: bool = False) -> None:
        self._flush = flush  # a live node flushes every line, so a kill -9 loses nothing already emitted
        self.records: list[dict] = []
        self._fh: IO[str] | None = None
        self._lock = threading.Lock()  # a node emits from its learner thread, event loop and workers
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, kind: str, **fields) -> None:
        rec = {"kind": kind, **fields}
        with self._lock:
            self.records.append(rec)
            if self._fh is not None:
                self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
                if self._flush:
                    self._fh.flush()

    def close(self) -> None:
        with self._lock:  # a worker thread (the agent's evaluation) may still be emitting
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]


def read_events(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
