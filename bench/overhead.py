"""Learner overhead benchmark: a ddiloco Learner against a plain torch training loop of the same model.

The learner's extra work per step is its bookkeeping (counters, schedule), the fragment snapshot and outer
gradient when a fragment is due, the wire codec, and adopting merged fragments tau steps later. Both loops run
in this process, interleaved in blocks, same model, batches, optimizer and schedule; the ratio of median block
times is printed. Target: overhead <= 3%.

    python bench/overhead.py                 # default model, P = H = 24, tau = 2, int4
    python bench/overhead.py --codec fp32 --blocks 10 --steps 30 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from node.learner.learner import InnerConfig, Learner, lr_lambda
from node.learner.model import ModelConfig
from node.learner.task import TaskConfig, load_task
from protocol.config import ProtocolConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=8, help="alternating measurement blocks per loop")
    ap.add_argument("--steps", type=int, default=24, help="steps per block")
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--fragments", type=int, default=24)
    ap.add_argument("--sync-every", type=int, default=24)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    task = load_task(None, TaskConfig(model=ModelConfig(dim=a.dim, layers=a.layers)))
    inner = InnerConfig()
    pcfg = ProtocolConfig(fragments=a.fragments, sync_every=a.sync_every, overlap=2, codec=a.codec)
    total = a.blocks * a.steps * 2
    learner = Learner("bench", task, pcfg, inner, total, seed=1, device=torch.device("cpu"))

    model = task.new_model()
    opt = torch.optim.AdamW(
        model.parameters(), lr=inner.lr, betas=(0.9, 0.95), weight_decay=inner.weight_decay
    )
    sched = lr_lambda(total, inner)
    gen = torch.Generator().manual_seed(1)
    plain_step = 0

    def plain_block() -> None:
        nonlocal plain_step
        for _ in range(a.steps):
            for g in opt.param_groups:
                g["lr"] = inner.lr * sched(plain_step)
            loss = task.loss(model, task.batch(gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
            opt.step()
            loss.item()
            plain_step += 1

    inflight: list[tuple[int, int, dict]] = []  # (adopt at step, fragment, merged tensors)
    rounds = [0] * a.fragments
    contributed_bytes = 0

    def learner_block() -> None:
        nonlocal contributed_bytes
        for _ in range(a.steps):
            res = learner.train_step()
            step = learner.book.step
            while inflight and inflight[0][0] <= step:
                _, p, theta = inflight.pop(0)
                rounds[p] += 1
                learner.adopt(p, rounds[p], theta)
            for p in res.due:
                enc = learner.contribution(p)
                contributed_bytes += sum(e.nbytes for e in enc.values())
                # what a synchroniser would hand back: here, the learner's own fragment (cheap to make)
                theta = {n: t.detach().clone() for n, t in learner.params.items() if n in enc}
                inflight.append((step + pcfg.overlap, p, theta))

    for fn in (plain_block, learner_block):  # warm-up
        fn()
    plain_t, learner_t = [], []
    for b in range(a.blocks):
        for fn, sink in ((plain_block, plain_t), (learner_block, learner_t)):
            t0 = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - t0)
        print(
            f"block {b + 1}/{a.blocks}: plain {plain_t[-1]:.3f}s learner {learner_t[-1]:.3f}s",
            file=sys.stderr,
            flush=True,
        )
    plain, lrn = statistics.median(plain_t), statistics.median(learner_t)
    ratio = lrn / plain
    out = {
        "plain_step_ms": 1e3 * plain / a.steps,
        "learner_step_ms": 1e3 * lrn / a.steps,
        "ratio": ratio,
        "overhead_pct": 100 * (ratio - 1),
        "codec": a.codec,
        "fragments": a.fragments,
        "sync_every": a.sync_every,
        "target_pct": 3.0,
    }
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"plain torch loop : {out['plain_step_ms']:.2f} ms/step")
        print(
            f"ddiloco Learner  : {out['learner_step_ms']:.2f} ms/step  (P={a.fragments}, H={a.sync_every}, "
            f"codec {a.codec})"
        )
        print(f"ratio {ratio:.4f}  -> overhead {out['overhead_pct']:+.2f}% (target <= 3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
