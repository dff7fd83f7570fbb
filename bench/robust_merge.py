"""The robust merge against hostile learners, in the in-process runner.

Each run trains the same model from the same weights on the same data to the same token budget, with
``--honest`` honest learners and ``--hostile`` hostile ones, each hostile learner playing one attack that
stays inside the bounds a node enforces (``clip_factor``, ``max_rms``, ``work_factor``):

  none        no hostile learner: the unattacked run of the same length (the same number of learners, all honest)
  absent      the honest learners alone, for their own share of the tokens: what a defence that threw away
              exactly the hostile learners' work would reach
  flip        the negated outer gradient, at honest size
  flip-x2.5   the negated outer gradient, 2.5x honest size (under clip_factor 3, so never clipped)
  inflate     the negated outer gradient, claiming 4x the tokens a step (the work_factor bound): 16x the weight
  alie        "a little is enough" (Baruch et al. 2019): knows every honest learner's outer gradient and sends
              their coordinate-wise mean minus z of their standard deviations, z the paper's for the run's
              counts (0.25 for 1 of 5, 0.43 for 2 of 6), every hostile learner the same
  alie-z1     the same at z = 1

Each is run with the plain merge (``--robust off``, the default) and the robust one (``centered-clip``), over
``--seeds`` seeds. It prints each cell's final eval loss (mean over seeds) and its ratio to the unattacked run
with the same merge, and the robust merge's failure-free cost against the plain one's.

    python bench/robust_merge.py                 # 4 honest + 1 hostile, 3 seeds (about 15 min on 2 cores)
    python bench/robust_merge.py --hostile 2     # 4 honest + 2 hostile
    python bench/robust_merge.py --seeds 1 --steps 40 --attacks none,flip   # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from node.common.events import EventLog
from node.learner.learner import InnerConfig
from node.learner.model import ModelConfig
from node.learner.task import TaskConfig, load_task
from node.local.hostile import alie_z
from node.local.run_config import LearnerPlan, RunConfig
from node.local.runner import run_system
from protocol.config import ProtocolConfig
from protocol.robust import ROBUST_RULES

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
ATTACKS = {
    "none": None,
    "absent": None,
    "flip": LearnerPlan(scale=-1.0),
    "flip-x2.5": LearnerPlan(scale=-2.5),
    "inflate": LearnerPlan(scale=-1.0, inflate=4),
    "alie": LearnerPlan(alie=-1.0),  # z filled in per run (alie_z)
    "alie-z1": LearnerPlan(alie=1.0),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/robust_merge.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--honest", type=int, default=4)
    p.add_argument("--hostile", type=int, default=1)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=120, help="inner steps per learner (the token budget)")
    p.add_argument(
        "--attacks", default=",".join(ATTACKS), help="comma-separated subset of " + ", ".join(ATTACKS)
    )
    p.add_argument("--rules", default="off,centered-clip", help="merge rules to compare (--robust)")
    p.add_argument("--data", help=f"text file (default: {DEFAULT_DATA} if present, else generated)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    return p


def _run(task, args, rule: str, attack: str, seed: int) -> float:
    m = args.honest + (0 if attack == "absent" else args.hostile)
    hostile = ATTACKS[attack]
    if hostile is not None and hostile.alie < 0:
        hostile = replace(hostile, alie=alie_z(m, args.hostile))
    plans = tuple(LearnerPlan() if i < args.honest or hostile is None else hostile for i in range(m))
    pcfg = ProtocolConfig(fragments=4, sync_every=8, overlap=2, robust=rule)
    run = RunConfig(
        learners=m, token_budget=m * args.steps * task.tokens_per_batch, eval_points=2, seed=seed, plans=plans
    )
    return run_system(task, run, pcfg, InnerConfig(), EventLog()).evals[-1][2]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    data = args.data or (str(DEFAULT_DATA) if DEFAULT_DATA.exists() else None)
    model = ModelConfig(dim=args.dim, layers=2, heads=4, seq_len=args.seq_len)

    def task_for(seed: int):  # the seed picks the initial weights and the data order
        return load_task(
            None, TaskConfig(data=data, batch_size=args.batch_size, eval_batches=8, seed=seed, model=model)
        )

    attacks = args.attacks.split(",")
    rules = args.rules.split(",")
    unknown = [a for a in attacks if a not in ATTACKS] + [r for r in rules if r not in ROBUST_RULES]
    if unknown:  # before any run, not after the first ones
        known = f"attacks {', '.join(ATTACKS)}; rules {', '.join(ROBUST_RULES)}"
        _parser().error(f"unknown attack or rule {', '.join(unknown)}: {known}")
    if "none" not in attacks:
        attacks.insert(0, "none")
    losses: dict[tuple[str, str], list[float]] = {}
    t0 = time.monotonic()
    for seed in range(args.seeds):
        task = task_for(seed)
        for rule in rules:
            for attack in attacks:
                loss = _run(task, args, rule, attack, seed)
                losses.setdefault((rule, attack), []).append(loss)
                print(
                    f"[{time.monotonic() - t0:6.0f}s] seed {seed} {rule:14s} {attack:10s} eval {loss:.4f}",
                    file=sys.stderr,
                    flush=True,
                )
    print(
        f"\n{args.honest} honest + {args.hostile} hostile learners, {args.steps} steps each, "
        f"{args.seeds} seeds; data: {data or 'generated'}"
    )
    print(f"{'attack':12s}" + "".join(f"{r:>28s}" for r in rules))
    for attack in attacks:
        cells = []
        for rule in rules:
            xs, base = losses[(rule, attack)], statistics.mean(losses[(rule, "none")])
            cells.append(f"{statistics.mean(xs):9.4f} ({statistics.mean(xs) / base:6.3f}x none)")
        print(f"{attack:12s}" + "".join(f"{c:>28s}" for c in cells))
    if "off" in rules:
        off = statistics.mean(losses[("off", "none")])
        for rule in rules:
            if rule != "off":
                print(f"failure-free: {rule} / off = {statistics.mean(losses[(rule, 'none')]) / off:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
