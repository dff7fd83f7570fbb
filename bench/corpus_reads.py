"""The read side of ``bench/corpus.py``: windows read from a token cache as it is (``pread``), through a
numpy memory map and from an Arrow IPC file of the same tokens; and batches read from a cold page cache in
the block order and in one random order. Run through ``bench/corpus.py --steps formats,cold``."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def formats(folder: Path, n_reads: int = 20_000, sweep_mb: int = 512) -> list[dict]:
    """Random 129-token windows from the cache three ways, each in a fresh process (its RSS its own)."""
    import pyarrow as pa

    from node.learner.token_cache import _opened

    cache = _opened(folder)
    arrow = folder.parent / (folder.name + ".arrow")
    if not arrow.exists():  # the same tokens as one Arrow IPC file of 1M-token record batches
        schema = pa.schema([("tokens", pa.uint16())])
        with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
            for name, _count in cache.shards:
                arr = np.fromfile(folder / name, dtype=np.uint16)
                for k in range(0, len(arr), 1 << 20):
                    w.write_batch(pa.record_batch([pa.array(arr[k : k + (1 << 20)])], schema=schema))
    out = []
    for name in FORMATS:
        code = (
            f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); from bench.corpus_reads import _one_format; "
            f"print(json.dumps(_one_format({str(folder)!r}, {name!r}, {n_reads}, {sweep_mb})))"
        )
        r = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900
        )
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        out.append(json.loads(r.stdout))
    return out


FORMATS = ("flat uint16, pread (the cache)", "flat uint16, np.memmap", "Arrow IPC, memory-mapped")


def _one_format(folder: str, name: str, n_reads: int, sweep_mb: int) -> dict:
    """One format in a fresh process (so the RSS it reports is its own): random reads, then a sweep."""
    import pyarrow as pa

    from node.learner.corpus import ShardStream
    from node.learner.token_cache import _opened

    cache = _opened(Path(folder))
    span = 129
    rng = random.Random(0)
    starts = [rng.randrange(0, cache.tokens - span) for _ in range(n_reads)]
    sweep = min(cache.tokens - span, sweep_mb * 1_000_000 // 2)
    if name.startswith("flat uint16, pread"):
        s = ShardStream(cache)
        read = lambda a: s.read(a, a + span)  # noqa: E731
    elif name.startswith("flat uint16, np.memmap"):
        maps = [np.memmap(Path(folder) / n, dtype=np.uint16, mode="r") for n, _ in cache.shards]
        bounds = np.cumsum([0] + [c for _, c in cache.shards])

        def read(a):
            k = int(np.searchsorted(bounds, a, side="right")) - 1
            off = a - int(bounds[k])
            if off + span <= len(maps[k]):
                return np.asarray(maps[k][off : off + span], dtype=np.int64)
            return np.concatenate([maps[k][off:], maps[k + 1][: span - (len(maps[k]) - off)]]).astype(
                np.int64
            )
    else:
        col = pa.ipc.open_file(pa.memory_map(folder + ".arrow")).read_all().column(0)
        read = lambda a: col.slice(a, span).to_numpy().astype(np.int64)  # noqa: E731
    rss0 = _rss()
    t0 = time.perf_counter()
    for a in starts:
        read(a)
    dt = time.perf_counter() - t0
    for a in range(0, sweep, span - 1):
        read(a)
    return {
        "format": name,
        "windows_per_s": len(starts) / dt,
        "rss_growth_mb": (_rss() - rss0) / 1e6,  # after the random reads and the sweep
        "sweep_mb": sweep * 2 / 1e6,
    }


def cold_reads(folder: Path, batches: int = 300, batch: int = 16, seq_len: int = 128) -> list[dict]:
    """Batches read from a cold page cache (``/proc/sys/vm/drop_caches``, as root), as a corpus larger than
    RAM is read: in the block order learners use, and in one random order over the whole corpus."""
    import node.learner.corpus as corpus_mod
    from node.learner.corpus import Corpus, Reader, ShardStream
    from node.learner.token_cache import _opened

    out = []
    for label, block in (
        ("blocks of 16M tokens (the order)", corpus_mod.BLOCK_TOKENS),
        ("one random order", 1 << 62),
    ):
        corpus_mod.BLOCK_TOKENS = block
        reader = Reader(Corpus(ShardStream(_opened(folder)), seq_len, "bench"), batch, 0, 1, seed=1)
        reader.window_ids(0)  # the order's permutations, made before the clock starts
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        t0 = time.perf_counter()
        for _ in range(batches):
            reader.next()
        dt = time.perf_counter() - t0
        out.append({"order": label, "batches_per_s": batches / dt, "windows_per_s": batches * batch / dt})
    corpus_mod.BLOCK_TOKENS = 1 << 24
    return out
