"""The worker side of the token cache (``node.learner.token_cache``): what a cache is built from, how one unit
of the sources becomes one shard, and the worker processes that do it side by side.

A worker is ``python -m node.learner.token_workers INIT``: it reads ``[i, path, start, end, last]`` lines on
its input, writes shard ``i`` itself and answers one JSON line per unit. This module imports neither torch nor
the node, so a worker starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from node.learner.sources import Unit, unit_documents
from node.learner.tokenize import Tokenizer, load_tokenizer
from protocol.errors import ConfigError

STALL_S = 600.0  # a build (ours or another process's) that shows no progress this long is an error


@dataclass(frozen=True)
class CacheSpec:
    """What a cache is built from: the ``--data`` spec, the tokenizer file (None: bytes) and the fields."""

    data: str
    tokenizer: str | None = None
    text_field: str = "text"
    text_column: str = "text"


def shard_names(i: int) -> tuple[str, str]:
    return f"shard-{i:06d}.tok", f"shard-{i:06d}.idx"


def encode_unit(unit: Unit, tok: Tokenizer, spec: CacheSpec, dtype: str, folder: Path, i: int) -> dict:
    """Tokenises ``unit`` into shard ``i`` of ``folder`` (written whole, then renamed into place)."""
    pieces: list[np.ndarray] = []
    ends: list[int] = []
    n = 0
    texts = [t for t in unit_documents(unit, spec.text_field, spec.text_column) if t]
    eos = np.array([tok.eos_id], dtype=np.int64) if tok.eos_id is not None else None
    for k, ids in enumerate(tok.encode_texts(texts)):
        pieces.append(ids)
        n += len(ids)
        closes = unit.kind != "text" or (unit.last and k == len(texts) - 1)
        if closes:
            if eos is not None:
                pieces.append(eos)
                n += 1
            ends.append(n)
    if unit.kind == "text" and unit.last and not texts and unit.start > 0:
        ends.append(0)  # a text file whose last piece is empty (never cut so, but counted right if it were)
    tokens = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype=dtype)
    for name, arr in zip(shard_names(i), (tokens, np.asarray(ends, dtype=np.uint64)), strict=True):
        tmp = folder / f"{name}.{os.getpid()}.tmp"
        arr.tofile(tmp)
        os.replace(tmp, folder / name)
    return {"tokens": int(len(tokens)), "docs": len(ends)}


def run_workers(
    folder: Path,
    spec: CacheSpec,
    dtype: str,
    units: list[Unit],
    todo: list[int],
    n: int,
    record: Callable[[int, dict], None],
) -> None:
    """Units ``todo`` tokenised by ``n`` worker processes, one unit in flight each; ``record`` on each done."""
    jobs: queue.Queue[int] = queue.Queue()
    for i in todo:
        jobs.put(i)
    results: queue.Queue[tuple[int, dict]] = queue.Queue()
    init = json.dumps({"spec": asdict(spec), "dtype": dtype, "folder": str(folder)})
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "node.learner.token_workers", init],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(n)
    ]

    def drive(proc: subprocess.Popen) -> None:
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                proc.stdin.write(json.dumps([i, *asdict(units[i]).values()]) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except (OSError, ValueError):
                line = ""
            results.put(
                (i, json.loads(line) if line else {"error": f"a worker stopped (exit code {proc.poll()})"})
            )
            if not line:
                return

    threads = [threading.Thread(target=drive, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    try:
        for _ in todo:
            try:
                i, r = results.get(timeout=STALL_S)
            except queue.Empty:
                raise ConfigError(f"token cache {folder}: no unit was tokenised in {STALL_S:.0f} s") from None
            if "error" in r:
                raise ConfigError(r["error"])
            record(i, r)
    finally:
        while not jobs.empty():
            with contextlib.suppress(queue.Empty):
                jobs.get_nowait()
        for p in procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in threads:
            t.join(timeout=10)


def _worker(init: str) -> int:
    """A tokenising worker: reads ``[i, path, start, end, last]`` lines, writes shard ``i``, answers a JSON
    line (``{"tokens", "docs"}`` or ``{"error"}``); ends at the end of its input."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's to handle: it closes our input
    cfg = json.loads(init)
    spec, folder = CacheSpec(**cfg["spec"]), Path(cfg["folder"])
    tok = load_tokenizer(spec.tokenizer)
    for line in sys.stdin:
        i, *fields = json.loads(line)
        try:
            out = encode_unit(Unit(*fields), tok, spec, cfg["dtype"], folder, i)
        except ConfigError as e:
            out = {"error": str(e)}
        except OSError as e:
            out = {"error": f"token cache {folder}: shard {i} cannot be written ({e.strerror or e})"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
