"""``ddiloco train-local``: M real learners in this process on a virtual clock, one or several systems."""

from __future__ import annotations

import argparse
import json
import sys
import time

from node.cli.config import add_config_args
from node.common.progress import Bar


def add_parser(sub) -> None:
    tl = sub.add_parser(
        "train-local",
        help="train M learners in one process on a virtual clock, and compare systems",
        description="Train M real learners in this process through the Decoupled DiLoCo core, on a virtual "
        "clock (step times, links and failures are simulated; the training is real). Runs on the embedded "
        "default (a small byte-level transformer on generated text) unless --preset, --model, --tokenizer, --data "
        "or --task say otherwise (docs/custom-task.md).",
    )
    tl.add_argument("--config", help="TOML file with [run] [protocol] [task] [model] [inner] [net] tables")
    tl.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    tl.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_args(tl)


def _tokens_progress(bar: Bar):
    """The runner's ``progress(done_tokens, total_tokens, eval_loss)`` callback, drawn on ``bar``."""

    def report(done: int, total: int, loss: float) -> None:
        bar(done / total, f"tokens {done / 1e6:.2f}M/{total / 1e6:.2f}M  eval loss {loss:.3f}")

    return report


def _table(rows: list[dict]) -> str:
    cols = [
        ("system", "system", "{}"),
        ("eval loss", "final_loss", "{:.4f}"),
        ("goodput", "goodput", "{:.1%}"),
        ("tokens", "tokens", "{:,}"),
        ("merges", "merges", "{}"),
        ("MB sent", "mb_sent", "{:.1f}"),
        ("virtual s", "virtual_s", "{:.1f}"),
        ("tok/virt s", "tokens_per_virtual_s", "{:,.0f}"),
        ("wall s", "wall_s", "{:.1f}"),
        ("model hash", "hash12", "{}"),
    ]
    cells = [[h for h, _, _ in cols]] + [[fmt.format(r[k]) for _, k, fmt in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _per_system(path: str | None, system: str, several: bool) -> str | None:
    """With several systems in one run, each writes its own file: runs/ev.jsonl -> runs/ev.dp.jsonl."""
    if path is None or not several:
        return path
    from pathlib import Path

    p = Path(path)
    return str(p.with_name(f"{p.stem}.{system}{p.suffix}"))


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from node.cli.config import build_config, describe
    from node.common.events import EventLog
    from node.learner.task import load_task
    from node.local.run_config import LearnerPlan, RunConfig
    from node.local.runner import run_system

    cfg = build_config(args, args.config)
    r = cfg.run
    task = load_task(r.task, cfg.task_config())
    cfg.protocol.check_swarm(r.learners, len(list(task.new_model().parameters())))
    if not args.json:
        print("resolved configuration:\n" + describe(cfg), file=sys.stderr)
    downs = r.down_intervals()
    plans = tuple(
        LearnerPlan(
            speed=1.0 / r.slow_factor if m >= r.learners - r.slow_learners else 1.0,
            jitter=r.jitter,
            down=tuple(downs.get(m, ())),
        )
        for m in range(r.learners)
    )
    rows = []
    for system in r.system.split(","):
        run = RunConfig(
            system=system,
            learners=r.learners,
            token_budget=r.tokens,
            eval_points=r.eval_points,
            seed=r.seed,
            net=cfg.net,
            plans=plans,
        )
        path = _per_system(r.events, system, "," in r.system)
        events = EventLog(path)
        bar = Bar(system, enabled=not (args.quiet or args.json))
        t0 = time.monotonic()
        try:
            res = run_system(task, run, replace(cfg.protocol), cfg.inner, events, _tokens_progress(bar))
        finally:
            events.close()
            bar.close()
        if r.export:
            from node.swarm.checkpoint import export_model, export_pretrained

            out = _per_system(r.export, system, "," in r.system)
            export_model(out, res.final_params, {"system": system, "model_hash": res.model_hash})
            export_pretrained(task, out, res.final_params)
        row = res.summary()
        row.update(
            wall_s=time.monotonic() - t0,
            mb_sent=res.bytes_sent / 1e6,
            hash12=res.model_hash[:12],
            initial_loss=res.evals[0][2],
            events=path,
        )
        rows.append(row)
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else {"runs": rows}, indent=2))
    else:
        print(_table(rows))
    return 0
