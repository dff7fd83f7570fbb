"""Throughput of the wire codecs (protocol/codecs.py) on CPU, next to a memcpy of the same tensor.

For one fp32 tensor of ``--numel`` values (normal, with every 7th value zero) this measures, on
``--threads`` torch threads, the median over ``--repeat`` runs of:

- memcpy: ``dst.copy_(src)`` of the tensor into a preallocated fp32 tensor of the same size;
- new fp32: ``torch.empty_like(src).fill_(1.0)``, writing a freshly allocated tensor of that size, which every
  decode (and fp32 encode) does: its pages are new to the process, and the page faults can cost several
  memcpys (far fewer with transparent huge pages, e.g. torch's ``THP_MEM_ALLOC_ENABLE=1``);
- each codec's ``encode(x, block)`` and ``decode(encoded)``.

It prints each as GB/s of fp32 input (encode) or output (decode), i.e. 4 * numel bytes over the median time,
and its ratio to the memcpy's median time (2.0 = twice as slow as copying the tensor); ``--json`` also gives
each minimum. The aim: at least 1 GB/s a core, or a ratio of at most 3.

    .venv/bin/python bench/codecs.py                      # 16M values, one thread
    .venv/bin/python bench/codecs.py --numel 1000000 --threads 2 --json

``--codecs-from FILE`` measures another implementation of the module, e.g. the committed one:

    git show HEAD:protocol/codecs.py > /tmp/codecs_head.py
    .venv/bin/python bench/codecs.py --codecs-from /tmp/codecs_head.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _load(path: str | None):
    if path is None:
        import protocol.codecs as mod

        return mod
    spec = importlib.util.spec_from_file_location("codecs_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _times(fn, repeat: int) -> list[float]:
    fn()  # warm-up: allocator, lazily built tables
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _row(op: str, codec: str | None, times: list[float]) -> dict:
    return {"op": op, "codec": codec, "s": statistics.median(times), "min_s": min(times)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=16 * 2**20, help="values in the tensor (default 16M)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeat", type=int, default=9, help="timed runs per measurement; the median is kept")
    ap.add_argument("--block", type=int, default=64, help="codec block (the default codec_block is 64)")
    ap.add_argument("--codecs", nargs="+", default=["fp32", "bf16", "int8", "int4"])
    ap.add_argument("--codecs-from", default=None, help="a file to load the codecs module from instead")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    mod = _load(args.codecs_from)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=g)
    x[::7] = 0.0
    nbytes = 4 * args.numel

    dst = torch.empty_like(x)
    rows = [_row("memcpy", None, _times(lambda: dst.copy_(x), args.repeat))]
    # What any decode pays at least: writing a freshly allocated fp32 tensor, whose pages are new to the process.
    rows.append(_row("new fp32", None, _times(lambda: torch.empty_like(x).fill_(1.0), args.repeat)))
    for name in args.codecs:
        c = mod.get_codec(name)
        enc = c.encode(x, args.block)
        rows.append(_row("encode", name, _times(lambda c=c: c.encode(x, args.block), args.repeat)))
        rows.append(_row("decode", name, _times(lambda c=c, e=enc: c.decode(e), args.repeat)))
    t_copy = rows[0]["s"]
    for r in rows:
        r["gb_s"] = nbytes / r["s"] / 1e9
        r["ratio_to_memcpy"] = r["s"] / t_copy

    doc = {
        "numel": args.numel,
        "threads": args.threads,
        "block": args.block,
        "repeat": args.repeat,
        "codecs_from": args.codecs_from or "protocol/codecs.py",
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(
            f"{args.numel} fp32 values, block {args.block}, {args.threads} thread(s), "
            f"median of {args.repeat}, codecs from {doc['codecs_from']}"
        )
        print(f"{'op':<14}{'ms':>9}{'min ms':>9}{'GB/s':>9}{'x memcpy':>10}")
        for r in rows:
            label = r["op"] if r["codec"] is None else f"{r['codec']} {r['op']}"
            print(
                f"{label:<14}{r['s'] * 1e3:>9.2f}{r['min_s'] * 1e3:>9.2f}{r['gb_s']:>9.2f}"
                f"{r['ratio_to_memcpy']:>10.2f}"
            )
    return doc


if __name__ == "__main__":
    main()
