"""Goodput benchmark: the paper's goodput table from the simulator (``sim/``), beside the paper's numbers.

Three parts, every number from ``sim.simulate`` (virtual time, no training; the Decoupled rows drive the real
``protocol.synchroniser``; goodput is ``protocol.goodput``'s definition counted in chip-seconds):

  table          150k, 300k, 600k, 1.2M, 2.4M chips, one failure per chip-year; rows non-elastic DP, elastic
                 DP, Decoupled DiLoCo with M = 2, 4, 8, 16 (K = 1 with the grace window). Each cell beside
                 the paper's (M = 8: 98/96/94/88/80%; non-elastic DP 72/57/38/27/18%; elastic DP
                 88/80/69/58/40%) with the difference; cells within +-5 points are marked ok.
  heterogeneity  M = 8, half the learners 18% slower, 10% step-time jitter, no failures: K = M (no grace),
                 K = 1 (no grace), K = 1 + grace (paper: 84%, 100%, 100%), plus DP on the same chips.
  timing         1.2M chips for one simulated week, each system alone: wall time (target < 60 s).

One set of recovery times serves every system and size (``sim.model.SimConfig`` defaults; docs/chaos.md
says why): step 5 s, hosts of 8 chips, spare host 25 s + restart 40 s for a restarting job, resize 15 s for
an elastic group, host repair 48 h.

    python bench/goodput.py                 # the full benchmark (about 2-3 minutes on two cores)
    python bench/goodput.py --quick         # shorter simulated durations, no timing week (~30 s)
    python bench/goodput.py --json          # results as one JSON object on stdout
    python bench/goodput.py --replot R.json # reprint and redraw from a saved --json output

Progress goes to stderr. Missed targets are reported, not turned into a failing exit status. The plot needs
matplotlib (the ``bench`` extra); without it the plot is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import sim  # noqa: F401
except ModuleNotFoundError:  # run as a script from an install that predates sim/
    sys.path.insert(0, str(ROOT))

from sim import DAY_S, SimConfig, simulate  # noqa: E402

DEFAULT_PLOT = ROOT / "docs" / "img" / "goodput.png"
SIZES = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
SIZE_LABELS = ("150k", "300k", "600k", "1.2M", "2.4M")
ROWS = (
    ("dp", "non-elastic DP", "dp", 8),
    ("elastic-dp", "elastic DP", "elastic-dp", 8),
    ("dec-M2", "Decoupled M=2", "decoupled", 2),
    ("dec-M4", "Decoupled M=4", "decoupled", 4),
    ("dec-M8", "Decoupled M=8", "decoupled", 8),
    ("dec-M16", "Decoupled M=16", "decoupled", 16),
)
PAPER = {  # percent, per size in SIZES
    "dp": (72, 57, 38, 27, 18),
    "elastic-dp": (88, 80, 69, 58, 40),
    "dec-M8": (98, 96, 94, 88, 80),
}
TOLERANCE = 5.0  # points
HETERO = (  # key, label, quorum ("M" = learners), grace, paper %
    ("K=M", "K=M", "M", False, 84),
    ("K=1", "K=1", 1, False, 100),
    ("K=1+grace", "K=1 + grace", 1, True, 100),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/goodput.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="short simulated durations and no timing week")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object on stdout")
    p.add_argument("--plot", default=str(DEFAULT_PLOT), help="PNG of goodput against chips ('' to skip)")
    p.add_argument("--replot", metavar="JSON", help="simulate nothing: reprint and redraw a saved --json")
    p.add_argument("--dp-days", type=float, default=None, help="simulated days per DP cell (default 7)")
    p.add_argument(
        "--decoupled-days", type=float, default=None, help="simulated days per Decoupled cell (default 1)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="worker processes for the table (the timing runs are always alone)",
    )
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run(cfg: SimConfig) -> dict:
    return simulate(cfg).as_dict()


def run_table(args: argparse.Namespace) -> dict[str, list[dict]]:
    base = SimConfig(seed=args.seed)
    jobs = []
    for key, _, system, m in ROWS:
        days = args.decoupled_days if system == "decoupled" else args.dp_days
        for n in SIZES:
            jobs.append((key, replace(base, system=system, chips=n, learners=m, duration_s=days * DAY_S)))
    out: dict[str, list[dict]] = {key: [] for key, *_ in ROWS}
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max(1, args.jobs)) as ex:
        for (key, cfg), res in zip(jobs, ex.map(_run, [c for _, c in jobs])):
            out[key].append(res)
            _log(
                f"  {key:<11} {cfg.chips:>9,} chips  goodput {res['goodput']:6.1%}  "
                f"({res['wall_s']:.1f}s, {time.perf_counter() - t0:.0f}s so far)"
            )
    return out


def run_heterogeneity(args: argparse.Namespace) -> dict:
    days = args.decoupled_days
    base = SimConfig(
        system="decoupled",
        chips=1_200_000,
        learners=8,
        slow_learners=4,
        slow_factor=1.18,
        jitter=0.1,
        mtbi_s=math.inf,
        duration_s=days * DAY_S,
        seed=args.seed,
    )
    rows = {}
    for key, _, k, grace, _ in HETERO:
        rows[key] = _run(replace(base, quorum=base.learners if k == "M" else k, grace=grace))
        _log(f"  heterogeneity {key:<10} goodput {rows[key]['goodput']:6.1%}")
    rows["dp"] = _run(replace(base, system="dp"))
    return {
        "settings": {"days": days, **{k: base.as_dict()[k] for k in ("learners", "slow_learners")}},
        "rows": rows,
    }


def run_timing(args: argparse.Namespace) -> dict:
    rows = {}
    for system in ("dp", "elastic-dp", "decoupled"):
        cfg = SimConfig(system=system, chips=1_200_000, learners=8, duration_s=7 * DAY_S, seed=args.seed)
        cpu0 = time.process_time()
        rows[system] = _run(cfg)
        rows[system]["cpu_s"] = time.process_time() - cpu0  # what a shared machine's load does not inflate
        _log(f"  timing {system:<11} 1.2M chips x 7 days: {rows[system]['wall_s']:.1f}s wall")
    return rows


def cell_checks(table: dict[str, list[dict]]) -> list[dict]:
    checks = []
    for key, paper in PAPER.items():
        for label, res, want in zip(SIZE_LABELS, table[key], paper):
            ours = 100 * res["goodput"]
            checks.append(
                {
                    "row": key,
                    "size": label,
                    "ours": ours,
                    "paper": want,
                    "diff": ours - want,
                    "holds": abs(ours - want) <= TOLERANCE,
                }
            )
    return checks


def format_table(table: dict[str, list[dict]]) -> str:
    w0, w = 16, 15
    lines = [f"{'':<{w0}}{'':<7}" + "".join(f"{s:>{w}}" for s in SIZE_LABELS)]
    for key, label, *_ in ROWS:
        ours = [100 * r["goodput"] for r in table[key]]
        lines.append(f"{label:<{w0}}{'ours':<7}" + "".join(f"{x:>{w - 1}.1f}%" for x in ours))
        paper = PAPER.get(key)
        if paper is None:
            lines.append(f"{'':<{w0}}{'paper':<7}" + "".join(f"{'n/a':>{w}}" for _ in SIZES))
            continue
        lines.append(f"{'':<{w0}}{'paper':<7}" + "".join(f"{p:>{w - 1}}%" for p in paper))
        diffs = [f"{x - p:+.1f} {'ok' if abs(x - p) <= TOLERANCE else 'MISS'}" for x, p in zip(ours, paper)]
        lines.append(f"{'':<{w0}}{'diff':<7}" + "".join(f"{d:>{w}}" for d in diffs))
    return "\n".join(lines)


def format_heterogeneity(het: dict) -> str:
    rows = het["rows"]
    half = het["settings"]["learners"] - het["settings"]["slow_learners"]
    lines = [
        f"{'setting':<14}{'goodput':>9}{'paper':>8}{'diff':>8}{'fast learners':>15}{'slow learners':>15}"
        f"{'merges':>10}",
    ]
    for key, label, _, _, paper in HETERO:
        r = rows[key]
        fast = sum(r["learner_goodput"][:half]) / half
        slow = sum(r["learner_goodput"][half:]) / (len(r["learner_goodput"]) - half)
        lines.append(
            f"{label:<14}{r['goodput']:>9.1%}{paper:>7}%{100 * r['goodput'] - paper:>+8.1f}{fast:>15.1%}"
            f"{slow:>15.1%}{r['merges']:>10,}"
        )
    r = rows["dp"]
    lines.append(
        f"{'DP (context)':<14}{r['goodput']:>9.1%}{'n/a':>8}{'':>8}{'':>15}{'':>15}{r['merges']:>10,}"
    )
    return "\n".join(lines)


def format_timing(timing: dict) -> str:
    lines = [
        f"{'system':<12}{'goodput':>9}{'wall s':>9}{'cpu s':>8}{'target':>9}{'failures':>10}{'merges':>10}"
    ]
    for system, r in timing.items():
        ok = "ok" if r["wall_s"] < 60 else "MISS"
        cpu = f"{r['cpu_s']:.1f}" if "cpu_s" in r else "-"
        lines.append(
            f"{system:<12}{r['goodput']:>9.1%}{r['wall_s']:>9.1f}{cpu:>8}{'<60 ' + ok:>9}{r['failures']:>10,}"
            f"{r['merges']:>10,}"
        )
    return "\n".join(lines)


def plot(table: dict[str, list[dict]], path: str) -> str:
    try:
        import matplotlib
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install -e '.[bench]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    x = [n / 1e6 for n in SIZES]
    for i, (key, label, *_) in enumerate(ROWS):
        ys = [100 * r["goodput"] for r in table[key]]
        ax.plot(x, ys, "-", marker="o", color=f"C{i}", label=f"{label} (sim)")
        if key in PAPER:
            ax.plot(x, PAPER[key], "--", marker="x", color=f"C{i}", alpha=0.7, label=f"{label} (paper)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, list(SIZE_LABELS))
    ax.set_xlabel("chips (one failure per chip-year)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    ax.set_title("Goodput against cluster size: simulator (solid) and paper (dashed)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def report(payload: dict, args: argparse.Namespace) -> None:
    note = plot(payload["table"], args.plot) if args.plot else "plot skipped (--plot '')"
    if args.json:
        _log(note)
        print(json.dumps(payload, indent=2))
        return
    st = payload["settings"]
    print(
        f"Goodput at the paper's scale: one failure per chip-year; simulated days per cell: DP {st['dp_days']:g}, "
        f"Decoupled {st['decoupled_days']:g} (K=1 + grace, P=H=24, tau=2); seed {st['seed']}"
    )
    t = st["times"]
    print(
        f"times: step {t['step_s']:g}s, hosts of {t['host_chips']} chips, spare {t['spare_s']:g}s + restart "
        f"{t['restart_s']:g}s, resize {t['resize_s']:g}s, repair {t['repair_s'] / 3600:g}h "
        f"(learner recovery: {t['learner_recovery']})"
    )
    print()
    print(format_table(payload["table"]))
    checks = payload["checks"]
    held = [c for c in checks if c["holds"]]
    print(
        f"\ntargets: {len(held)}/{len(checks)} cells within +-{TOLERANCE:g} points (M=8, non-elastic DP, elastic DP)"
    )
    for c in checks:
        if not c["holds"]:
            print(f"  MISSED {c['row']} at {c['size']}: {c['ours']:.1f}% vs {c['paper']}% ({c['diff']:+.1f})")
    worst = max(checks, key=lambda c: abs(c["diff"]))
    print(f"  largest difference: {worst['row']} at {worst['size']}, {worst['diff']:+.1f} points")
    het = payload["heterogeneity"]
    print(
        f"\nHeterogeneous learners: M={het['settings']['learners']}, {het['settings']['slow_learners']} of them "
        f"18% slower, 10% jitter, no failures; simulated days: {het['settings']['days']:g}"
    )
    print(format_heterogeneity(het))
    if payload.get("timing"):
        print("\nSimulator speed: 1.2M chips, one simulated week, M=8, each system alone")
        print(format_timing(payload["timing"]))
    print(f"\n{note}")
    print(f"wall time: {payload['wall_s']:.1f}s")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.replot:
        report(json.loads(Path(args.replot).read_text()), args)
        return 0
    if args.dp_days is None:
        args.dp_days = 2.0 if args.quick else 7.0
    if args.decoupled_days is None:
        args.decoupled_days = 0.25 if args.quick else 1.0
    t0 = time.perf_counter()
    base = SimConfig()
    _log("goodput table:")
    table = run_table(args)
    _log("heterogeneity:")
    het = run_heterogeneity(args)
    timing = None
    if not args.quick:
        _log("timing (one run at a time):")
        timing = run_timing(args)
    payload = {
        "settings": {
            "dp_days": args.dp_days,
            "decoupled_days": args.decoupled_days,
            "seed": args.seed,
            "quick": args.quick,
            "times": {
                k: getattr(base, k)
                for k in (
                    "step_s",
                    "host_chips",
                    "spare_s",
                    "restart_s",
                    "resize_s",
                    "repair_s",
                    "learner_recovery",
                )
            },
        },
        "table": table,
        "checks": cell_checks(table),
        "heterogeneity": het,
        "timing": timing,
        "wall_s": time.perf_counter() - t0,
    }
    report(payload, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
