"""The event record stream (docs/design.md, section 7): JSON lines of quorum, merge, adoption, failover,
join, ...

Records are plain dicts with a ``kind`` and a time ``t`` (virtual seconds in the in-process runner, wall
seconds in a node). ``protocol.goodput`` computes goodput from them; nothing else is needed to replay a run.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)


class EventLog:
    """Keeps records in memory and, when given a path, appends each as a JSON line.

    ``keep``: hold only the newest ``keep`` records in memory (a node runs for days; its file keeps them
    all). ``trimmed`` then counts the records let go.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        flush: bool = False,
        append: bool = False,
        keep: int | None = None,
    ) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep={keep} is invalid: hold at least one record, or None for all")
        self._flush = flush  # a live node flushes every line, so a kill -9 loses nothing already emitted
        self.records: list[dict] | deque[dict] = [] if keep is None else deque(maxlen=keep)
        self.emitted = 0
        self._fh: IO[str] | None = None
        self._lock = threading.Lock()  # a node emits from its learner thread, event loop and workers
        self._listeners: list[Callable[[dict], None]] = []
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, kind: str, **fields) -> None:
        rec = {"kind": kind, **fields}
        with self._lock:
            self.records.append(rec)
            self.emitted += 1
            if self._fh is not None:
                self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
                if self._flush:
                    self._fh.flush()
        for fn in self._listeners:
            try:
                fn(rec)
            except Exception:  # a metrics bug must not stop the learner that emitted the record
                logger.exception("event listener %r failed on a %s record", fn, kind)

    def subscribe(self, fn: Callable[[dict], None]) -> None:
        """Call ``fn(record)`` after each record is emitted, on the emitting thread (the node's metrics and
        dashboard history are fed this way). ``fn`` must be quick and thread-safe; its errors are logged."""
        self._listeners.append(fn)

    def close(self) -> None:
        with self._lock:  # a worker thread (the agent's evaluation) may still be emitting
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    @property
    def trimmed(self) -> int:
        return self.emitted - len(self.records)

    def snapshot(self) -> list[dict]:
        """The records held now, as a list (safe while other threads emit)."""
        with self._lock:
            return list(self.records)

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.snapshot() if r["kind"] == kind]


def record_time(rec: dict) -> float:
    """When a record happened: its ``t``, or the start ``t0`` of a span (a step, a run, a block)."""
    return float(rec["t"] if "t" in rec else rec["t0"])


def read_events(path: str | Path) -> list[dict]:
    """Every record of an events file, in order; [] when there is no file. A line that does not parse is
    skipped: a kill -9 can cut the line being written, and a restarted node appends after it."""
    out = []
    try:
        fh = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by the with below
    except FileNotFoundError:
        return out
    with fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
