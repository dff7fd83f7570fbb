"""What glibc's mmap threshold (``--malloc-mmap-mib``) costs and saves a learner's step at size.

Two measurements of the plain torch loop of ``bench/scale.py`` (the size's model, AdamW as the learner builds it,
clipping), side by side in this script:

- time: one process; the threshold switched every ``--steps`` steps, in alternating order, ``--rounds`` times;
  the median seconds per step for each threshold and its ratio to the first one given;
- peak: one child process per threshold running ``--peak-steps`` steps alone; its peak resident memory
  (VmHWM) against the model's fp32 weights.

    .venv/bin/python bench/allocator.py                                    # gpt2-125m, 2 MiB against 0.25 MiB
    .venv/bin/python bench/allocator.py --size 350m --mib 0,2,0.25 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scale import PLAIN, plain_setup  # noqa: E402


def _loop(size: str, threads: int):
    """(one training step, the model's fp32 bytes) of the size's plain loop."""
    import torch

    task, model, opt, gen = plain_setup(size, threads)

    def step() -> None:
        loss = task.loss(model, task.batch(gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, 4 * sum(p.numel() for p in model.parameters())


def _set(mib: float) -> None:
    from node.common.heap import release_free_memory, tune_allocator

    tune_allocator(int(mib * (1 << 20)))
    release_free_memory()


def timed(size: str, mibs: list[float], steps: int, rounds: int, threads: int) -> dict[float, float]:
    step, _ = _loop(size, threads)
    for _ in range(2):
        step()
    # glibc's own rule (0) cannot come back once a threshold was set in a process: only the peak children run it
    times: dict[float, list[float]] = {m: [] for m in mibs if m > 0}
    for r in range(rounds):
        for m in list(times) if r % 2 == 0 else list(times)[::-1]:
            _set(m)
            step()  # the first step under a new threshold settles the heaps
            t = time.perf_counter()
            for _ in range(steps):
                step()
            times[m].append((time.perf_counter() - t) / steps)
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{m} MiB {v[-1]:.3f} s" for m, v in times.items()),
              file=sys.stderr, flush=True)  # fmt: skip
    return {m: statistics.median(times[m]) if m in times else None for m in mibs}


def _peak_child(size: str, mib: float, steps: int, threads: int) -> None:
    if mib > 0:
        _set(mib)
    step, weights = _loop(size, threads)
    for _ in range(steps):
        step()
    with open("/proc/self/status") as fh:
        hwm = int(fh.read().split("VmHWM:")[1].split()[0]) * 1024
    print(json.dumps({"peak_bytes": hwm, "weights_bytes": weights}))


def peak(size: str, mib: float, steps: int, threads: int) -> dict:
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    cmd = [sys.executable, __file__, "--child", str(mib), "--size", size, "--peak-steps", str(steps)]
    res = subprocess.run(
        cmd + ["--threads", str(threads)], capture_output=True, text=True, env=env, timeout=1800
    )
    if res.returncode:
        raise SystemExit(f"peak child for {mib} MiB failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="gpt2-125m", choices=sorted(PLAIN))
    ap.add_argument(
        "--mib", default="2,0.25", help="thresholds in MiB, comma-separated (0: glibc's own rule, peak only)"
    )
    ap.add_argument("--steps", type=int, default=4, help="timed steps per threshold per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--peak-steps", type=int, default=8, help="steps of each peak child")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        _peak_child(a.size, a.child, a.peak_steps, a.threads)
        return 0
    mibs = [float(x) for x in a.mib.split(",")]
    step_s = timed(a.size, mibs, a.steps, a.rounds, a.threads)
    peaks = {m: peak(a.size, m, a.peak_steps, a.threads) for m in mibs}
    rows = [
        {
            "mib": m,
            "step_s": None if step_s[m] is None else round(step_s[m], 4),
            "step_x_first": None
            if None in (step_s[m], step_s[mibs[0]])
            else round(step_s[m] / step_s[mibs[0]], 3),
            "peak_mib": peaks[m]["peak_bytes"] >> 20,
            "peak_x_weights": round(peaks[m]["peak_bytes"] / peaks[m]["weights_bytes"], 2),
        }
        for m in mibs
    ]
    if a.json:
        print(json.dumps({"size": a.size, "threads": a.threads, "rows": rows}))
    else:
        print(
            f"{a.size}, {a.threads} thread(s): threshold, median s/step, x the first, peak MiB, x fp32 weights"
        )
        for r in rows:
            print(f"  {r['mib']:>5} MiB  {r['step_s']} s  {r['step_x_first']}x  "
                  f"{r['peak_mib']} MiB  {r['peak_x_weights']}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
