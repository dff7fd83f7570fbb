"""Parity benchmark: Decoupled DiLoCo against its baselines on real node processes and in the in-process
runner, same configuration, equal tokens.

For each scenario and seed, every system runs as a swarm of real ``ddiloco node`` processes on loopback
(``node.chaos.harness`` with no failures: the launcher, the status endpoint, the event records), then the runner
(``node.local.runner``, virtual time) runs the same system to the same token count with the same learning-rate
schedule, data seeds and speeds. Systems:

  decoupled K=1+grace   the default node
  decoupled K=M         --quorum M --no-grace
  decoupled-carry       --carry (a learner keeps the steps it trained since sending; not the paper's rule)
  streaming             --system streaming (fp32, plain mean, every learner, blocks at tau)
  sync-diloco           --system sync-diloco (fp32, plain mean, one fragment, blocks at each sync)

Scenarios: ``homogeneous``; ``heterogeneous``: the last two nodes 20% slower with +-10% jitter
(``--slowdown 1.2 --jitter 0.1``). The runner's learners step at each node's measured pace: its mean
step-to-step time and their spread as uniform jitter (``--runner-pace nominal``: the knobs alone, speed
1/1.2 and jitter 0.1 on the slowed nodes, none elsewhere). Either way each runner learner starts when its
node took its first step and replays, as measured, the steps its node made before the last node's first:
the nodes start one after another on this host, and the first one's learner is starved meanwhile.

Equal tokens: the swarms run for the same wall time, so blocking systems train fewer tokens. Each system's
eval loss is read at T, the fewest tokens any system of that scenario and seed trained: from node 0's eval
records (the global model every ``--eval-every-s``, and the model it ended on after the quiet period), with
the swarm's token count at each record's time from every node's step records, interpolated linearly. The
runner trains as many tokens as that system's nodes did, evaluates its global model at the token counts
of node 0's records, and its last evaluation is of its drained model (every merge in flight done, as the
quiet period does), so its eval at T is read off the same points in the same way. Both final losses (the
model each driver ended on, at the same token count) are printed too. A second table reads
every curve at equal tokens *merged* (``merged_curve``: the tokens whose work the evaluated model holds),
which takes out where a sync round's step function falls against the evals.

Per system it prints mean +- std over seeds of the eval loss at T, its ratio to sync-diloco's, learners per
merge, goodput (``protocol.goodput``: the tau overlap steps count, as the paper counts them) and strict
goodput (every overwritten step lost), the final eval loss (the model the swarm ended on, after its quiet
period) and tokens/s, for real nodes and the runner side by side.

    python bench/parity.py                                   # 2 scenarios x 4 systems x 3 seeds, ~80 min
    python bench/parity.py --scenarios homogeneous --systems decoupled,sync-diloco --seeds 2 --duration 90
    python bench/parity.py --json > parity.json
    python bench/parity.py --runner-from parity.json         # the runner side again, same real runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.parity_curves import at_equal_merged, eval_at, real_merged_curve  # noqa: E402
from bench.parity_runner import (  # noqa: E402
    JITTER,
    SLOW,
    first_steps,
    learners_per_merge,
    pace,
    runner_run,
    slow,
    task_config,
)
from node.chaos.config import ChaosConfig  # noqa: E402
from node.chaos.harness import run_chaos  # noqa: E402
from node.chaos.plan import FailureModel  # noqa: E402
from node.common.events import read_events  # noqa: E402
from node.learner.model import ModelConfig  # noqa: E402
from node.learner.task import TaskConfig, load_task  # noqa: E402

SYSTEMS = ("decoupled", "decoupled-km", "decoupled-carry", "streaming", "sync-diloco")
SCENARIOS = ("homogeneous", "heterogeneous")


def node_flags(system: str, nodes: int) -> list[str]:
    if system == "decoupled-km":
        return ["--quorum", str(nodes), "--no-grace"]
    if system == "decoupled-carry":
        return ["--carry"]
    if system in ("streaming", "sync-diloco"):
        return ["--system", system]
    return []


def protocol_flags(system: str, args) -> list[str]:
    """``--codec`` and ``--sync-every`` of the decoupled systems: given to the nodes and the runner alike."""
    if not system.startswith("decoupled"):
        return []
    return ["--codec", args.codec] + (["--sync-every", str(args.sync_every)] if args.sync_every else [])


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def task_flags(args) -> list[str]:
    t = task_config(args)
    return [
        "--dim", str(t.model.dim), "--layers", str(t.model.layers), "--heads", str(t.model.heads),
        "--seq-len", str(t.model.seq_len), "--batch-size", str(t.batch_size),
    ]  # fmt: skip


def real_run(system: str, scenario: str, seed: int, args, run_dir: Path) -> dict:
    extra = {
        i: ["--data-seed", str(seed * 1000 + i + 1)]
        + (["--slowdown", str(SLOW), "--jitter", str(JITTER)] if slow(scenario, i, args.nodes) else [])
        for i in range(args.nodes)
    }
    cfg = ChaosConfig(
        run_dir=run_dir,
        nodes=args.nodes,
        duration_s=args.duration,
        seed=seed,
        model=FailureModel(mtbf_s=0.0),
        node_flags=node_flags(system, args.nodes)
        + protocol_flags(system, args)
        + task_flags(args)
        + ["--eval-every-s", str(args.eval_every_s)]
        + args.node_flags.split(),
        node_extra=extra,
        quiet=True,
    )
    rep, _ = run_chaos(cfg)
    ev = {i: read_events(run_dir / f"node-{i}" / "events.jsonl") for i in range(args.nodes)}
    per_step = load_task(None, task_config(args)).tokens_per_batch
    ends = sorted(r["t1"] for recs in ev.values() for r in recs if r.get("kind") == "step")
    curve = []
    for r in ev[0]:
        if r.get("kind") == "eval":
            n = sum(1 for t in ends if t <= r["t"])
            curve.append((n * per_step, r["loss"]))
    all_records = [r for recs in ev.values() for r in recs]
    window = rep.get("window_s") or args.duration
    return {
        "curve": curve,
        "curve_m": real_merged_curve(run_dir, args.nodes),
        "tokens": len(ends) * per_step,
        "goodput": rep.get("goodput", {}).get("goodput"),
        "goodput_strict": rep.get("goodput", {}).get("strict"),
        "final_loss": curve[-1][1] if curve else None,  # the model the swarm ended on, after its quiet period
        "learners_per_merge": learners_per_merge(all_records),
        "tokens_per_s": rep.get("tokens_trained", 0) / window if window else 0.0,
        "step_s": _step_s(ev),
        "join_s": _join_s(ev, args.nodes),
        "pace": pace(ev, args.nodes),
        "first_steps": first_steps(ev, args.nodes),
        "refused": sum(1 for r in all_records if r.get("kind") == "reject"),
        "one_hash": rep.get("equal_hashes"),
    }


def _join_s(ev: dict[int, list[dict]], nodes: int) -> list[float]:
    """When each node's learner took its first step, in seconds after the first node's: the runner starts
    its learners as late (``LearnerPlan.start_s``), as the launcher starts the nodes one after another."""
    first = [
        min((r["t0"] for r in ev.get(i, []) if r.get("kind") == "step"), default=None) for i in range(nodes)
    ]
    t0 = min((t for t in first if t is not None), default=0.0)
    return [0.0 if t is None else t - t0 for t in first]


def _step_s(ev: dict[int, list[dict]]) -> float:
    """The median node's mean seconds per step (wall clock, start to start)."""
    per = []
    for recs in ev.values():
        t = sorted(r["t0"] for r in recs if r.get("kind") == "step")
        if len(t) > 10:
            per.append((t[-1] - t[0]) / (len(t) - 1))
    return statistics.median(per) if per else 0.3


def _ms(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None and x == x]  # no runner (--no-runner): NaN, left out
    if not xs:
        return "-"
    return f"{statistics.mean(xs):.4f} +- {statistics.stdev(xs) if len(xs) > 1 else 0.0:.4f}"


def table(scenario: str, rows: dict[str, list[dict]]) -> str:
    base = statistics.mean(r["real_loss"] for r in rows["sync-diloco"]) if "sync-diloco" in rows else None
    rbase = statistics.mean(r["runner_loss"] for r in rows["sync-diloco"]) if "sync-diloco" in rows else None
    out = [
        f"{scenario}",
        f"{'system':<14} {'real eval@T':>20} {'ratio':>6} {'lrn/merge':>9} {'goodput':>7} {'strict':>6} "
        f"{'final':>6} {'tok/s':>7} {'refused':>7} | {'runner eval@T':>20} {'ratio':>6} {'lrn/merge':>9} "
        f"{'goodput':>7} {'runner/real':>11} {'final r/r':>9}",
    ]
    for sys_, rs in rows.items():
        real = statistics.mean(r["real_loss"] for r in rs)
        run = statistics.mean(r["runner_loss"] for r in rs)
        out.append(
            f"{sys_:<14} {_ms([r['real_loss'] for r in rs]):>20} "
            f"{real / base if base else float('nan'):>6.3f} "
            f"{statistics.mean(r['real']['learners_per_merge'] for r in rs):>9.2f} "
            f"{statistics.mean(r['real']['goodput'] or 0 for r in rs):>7.3f} "
            f"{statistics.mean(r['real'].get('goodput_strict') or 0 for r in rs):>6.3f} "
            f"{statistics.mean(r['real'].get('final_loss') or float('nan') for r in rs):>6.3f} "
            f"{statistics.mean(r['real']['tokens_per_s'] for r in rs):>7.0f} "
            f"{sum(r['real']['refused'] for r in rs):>7d} | "
            f"{_ms([r['runner_loss'] for r in rs]):>20} {run / rbase if rbase else float('nan'):>6.3f} "
            f"{statistics.mean(r['runner']['learners_per_merge'] for r in rs):>9.2f} "
            f"{statistics.mean(r['runner']['goodput'] for r in rs):>7.3f} {run / real:>11.3f} "
            f"{_ratio([r['runner'].get('final_loss') for r in rs], [r['real'].get('final_loss') for r in rs]):>9.3f}"
        )
    if any(r.get("real_loss_m") is not None for rs in rows.values() for r in rs):
        out += [
            "",
            f"{scenario}, at equal tokens merged (``merged_curve``; per seed the fewest any system held)",
        ]
        out.append(
            f"{'system':<14} {'real eval@M':>20} {'ratio':>6} | {'runner eval@M':>20} {'ratio':>6} {'runner/real':>11}"
        )
        mbase = _mean([r.get("real_loss_m") for r in rows.get("sync-diloco", [])])
        rmbase = _mean([r.get("runner_loss_m") for r in rows.get("sync-diloco", [])])
        for sys_, rs in rows.items():
            real, run = _mean([r.get("real_loss_m") for r in rs]), _mean([r.get("runner_loss_m") for r in rs])
            out.append(
                f"{sys_:<14} {_ms([r.get('real_loss_m') for r in rs]):>20} {real / mbase:>6.3f} | "
                f"{_ms([r.get('runner_loss_m') for r in rs]):>20} {run / rmbase:>6.3f} {run / real:>11.3f}"
            )
    return "\n".join(out)


def _ratio(num: list, den: list) -> float:
    """Mean of ``num`` over mean of ``den`` (NaN where either is missing: a run without the runner)."""
    return _mean(num) / _mean(den) if den and _mean(den) else float("nan")


def _mean(xs: list) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return statistics.mean(xs) if xs else float("nan")


def rerun_runner(args) -> int:
    """The runner side again, against the real side of a saved run (``--json`` output, possibly after
    log lines): same systems, seeds, token counts, step times, and each node's start from its run dir."""
    text = Path(args.runner_from).read_text()
    saved, _ = json.JSONDecoder().raw_decode(text[text.index("{\n") :])  # log lines may follow too
    sargs = argparse.Namespace(**{**saved["args"], "runner_from": "", "runner_pace": args.runner_pace})
    root = Path(sargs.run_dir)
    for scen, rows in saved["results"].items():
        for sys_, rs in rows.items():
            for row in rs:
                real = row["real"]
                run_dir = root / f"{scen}-{row['seed']}-{sys_}"
                ev = {i: read_events(run_dir / f"node-{i}" / "events.jsonl") for i in range(sargs.nodes)}
                real["join_s"] = _join_s(ev, sargs.nodes)
                real["pace"] = pace(ev, sargs.nodes)
                real["first_steps"] = first_steps(ev, sargs.nodes)
                real["curve_m"] = real_merged_curve(run_dir, sargs.nodes)
                _log(f"{scen} seed {row['seed']}: {sys_} in the runner to {real['tokens']:,} tokens")
                row["runner"] = runner_run(sys_, scen, row["seed"], row["tokens"], real, sargs)
                row["runner_loss"] = row["runner"]["loss"]
        for seed in sorted({row["seed"] for rs in rows.values() for row in rs}):
            at_equal_merged([row for rs in rows.values() for row in rs if row["seed"] == seed])
        if not args.json:
            print(table(scen, rows), flush=True)
    if args.json:
        print(json.dumps({"args": vars(sargs), "results": saved["results"]}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from: %(default)s")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, from: %(default)s")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 1..N for each system and scenario")
    ap.add_argument("--nodes", type=int, default=4, help="node processes (and runner learners) per swarm")
    ap.add_argument("--duration", type=float, default=150.0, help="seconds each swarm trains")
    ap.add_argument(
        "--eval-every-s", type=float, default=10.0, help="node 0 evaluates the global model this often"
    )
    ap.add_argument("--no-runner", action="store_true", help="real nodes only")
    ap.add_argument("--dim", type=int, default=ModelConfig.dim, help="model width (as ddiloco node)")
    ap.add_argument(
        "--layers", type=int, default=ModelConfig.layers, help="transformer blocks (as ddiloco node)"
    )
    ap.add_argument("--heads", type=int, default=ModelConfig.heads, help="attention heads (as ddiloco node)")
    ap.add_argument(
        "--seq-len", type=int, default=ModelConfig.seq_len, help="tokens per sequence (as ddiloco node)"
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=TaskConfig.batch_size,
        help="sequences per inner step (as ddiloco node)",
    )
    ap.add_argument(
        "--codec",
        default="int4",
        help="the decoupled systems' contributions (nodes and runner): int4 | int2 | ...",
    )
    ap.add_argument("--sync-every", type=int, default=0, help="H of the decoupled systems (0: the default)")
    ap.add_argument("--node-flags", default="", help="more flags for every node (not the runner)")
    ap.add_argument("--run-dir", default="", help="where the runs' node dirs go (default: a new temp dir)")
    ap.add_argument(
        "--runner-pace",
        choices=("measured", "nominal"),
        default="measured",
        help="runner learners' step times: each node's measured mean and spread (default), or the "
        "scenario's knobs alone (every node at the median pace, jitter only on the slowed ones); "
        "either way a learner's steps from before the last node's first are replayed as measured",
    )
    ap.add_argument("--json", action="store_true", help="print every run's results as JSON, not the tables")
    ap.add_argument(
        "--runner-from",
        default="",
        metavar="JSON",
        help="run only the runner, against the real runs a previous --json run saved (its run dirs give "
        "each node's start); prints the table again",
    )
    args = ap.parse_args(argv)
    if args.runner_from:
        return rerun_runner(args)
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}: choose from {', '.join(SYSTEMS)}")
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}: choose from {', '.join(SCENARIOS)}")
    root = Path(args.run_dir or tempfile.mkdtemp(prefix="ddiloco-parity-"))
    results: dict[str, dict[str, list[dict]]] = {}
    for scen in scenarios:
        rows: dict[str, list[dict]] = {s: [] for s in systems}
        for seed in range(1, args.seeds + 1):
            reals = {}
            for s in systems:
                _log(f"{scen} seed {seed}: {s} on {args.nodes} real nodes, {args.duration:g} s")
                reals[s] = real_run(s, scen, seed, args, root / f"{scen}-{seed}-{s}")
            T = min(r["tokens"] for r in reals.values())
            for s in systems:
                real = reals[s]
                row = {"seed": seed, "tokens": T, "real": real, "real_loss": eval_at(real["curve"], T)}
                if not args.no_runner:
                    _log(f"{scen} seed {seed}: {s} in the runner to {real['tokens']:,} tokens")
                    row["runner"] = runner_run(s, scen, seed, T, real, args)
                    row["runner_loss"] = row["runner"]["loss"]
                else:
                    row["runner"] = {"learners_per_merge": 0.0, "goodput": 0.0}
                    row["runner_loss"] = float("nan")
                rows[s].append(row)
                _log(f"  {s}: real eval@{T:,} {row['real_loss']}, runner {row['runner_loss']}")
            at_equal_merged([rows[s][-1] for s in systems])
        results[scen] = rows
        if not args.json:
            print(table(scen, rows), flush=True)
    if args.json:
        print(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
