"""``ddiloco sim``: goodput at the paper's scale from the discrete-event simulator (``sim``), no training.

    ddiloco sim                                   # Decoupled DiLoCo, M = 8, 1.2M chips, one simulated week
    ddiloco sim --system dp,elastic-dp,decoupled  # the three systems side by side
    ddiloco sim --chips 150000 --learners 16 --days 1 --json

The model (chips in hosts and learners, failures, spare/restart/resize/repair times, slowdowns) is described
in ``sim/model.py`` and docs/chaos.md; ``python bench/goodput.py`` prints the paper's table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from pathlib import Path

from node.common.progress import Bar
from protocol.errors import ConfigError
from sim.model import DAY_S, HOUR_S, SYSTEMS, YEAR_S, SimConfig

# Per-chip event records grow as chips x steps; beyond this they are not worth writing.
MAX_EVENT_RECORDS = 2_000_000


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = {f.name: f.default for f in fields(SimConfig)}
    sp = sub.add_parser(
        "sim",
        help="simulate goodput at scale (no training): DP, elastic DP, Decoupled DiLoCo under failures",
        description="Discrete-event simulation in virtual time: CHIPS accelerators in M learners (blocks), "
        "each chip interrupted once per MTBI on average; non-elastic DP restarts, elastic DP resizes, "
        "Decoupled DiLoCo loses only the failed learner while the real synchroniser state machines "
        "(protocol.synchroniser) merge with quorum K. Goodput as protocol.goodput defines it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sp.add_argument("--system", default=d["system"], help=f"{' | '.join(SYSTEMS)}, a comma list, or 'all'")
    sp.add_argument("--chips", type=int, default=d["chips"], help="accelerators in the cluster")
    sp.add_argument("--learners", "-M", type=int, default=d["learners"], help="M: learners (blocks of chips)")
    sp.add_argument(
        "--mtbi-years",
        type=float,
        default=d["mtbi_s"] / YEAR_S,
        help="mean time between interruptions per chip, in years ('inf': no failures)",
    )
    sp.add_argument("--days", type=float, default=d["duration_s"] / DAY_S, help="simulated duration in days")
    sp.add_argument("--quorum", "-K", type=int, default=d["quorum"], help="K: minimum learners per merge")
    sp.add_argument(
        "--grace", action=argparse.BooleanOptionalAction, default=d["grace"], help="adaptive grace window"
    )
    sp.add_argument("--seed", type=int, default=d["seed"], help="random seed (runs are deterministic)")
    sp.add_argument("--json", action="store_true", help="print the result as one JSON object")
    sp.add_argument("--quiet", action="store_true", help="no progress line")
    sp.add_argument(
        "--events", metavar="PATH", help="also write per-chip event records (JSON lines; small runs only)"
    )
    t = sp.add_argument_group("recovery times (one set for every system)")
    t.add_argument("--step-s", type=float, default=d["step_s"], help="one inner step (DP step)")
    t.add_argument("--host-chips", type=int, default=d["host_chips"], help="chips a failure takes out")
    t.add_argument("--spare-s", type=float, default=d["spare_s"], help="a restart gets a spare host in place")
    t.add_argument("--restart-s", type=float, default=d["restart_s"], help="restart from a checkpoint")
    t.add_argument("--resize-s", type=float, default=d["resize_s"], help="an elastic group drops a host")
    t.add_argument("--repair-h", type=float, default=d["repair_s"] / HOUR_S, help="a host's repair (hours)")
    t.add_argument(
        "--learner-recovery",
        choices=("resize", "restart"),
        default=d["learner_recovery"],
        help="how a Decoupled learner recovers from a chip failure",
    )
    h = sp.add_argument_group("heterogeneity and slowdowns")
    h.add_argument("--slow-learners", type=int, default=d["slow_learners"], help="learners that are slower")
    h.add_argument("--slow-factor", type=float, default=d["slow_factor"], help="their step-time multiplier")
    h.add_argument("--jitter", type=float, default=d["jitter"], help="step time x U[1-j, 1+j]")
    h.add_argument(
        "--slowdown-mtbi-years",
        type=float,
        default=d["slowdown_mtbi_s"] / YEAR_S,
        help="mean time between transient slowdowns per chip, in years ('inf': none)",
    )
    h.add_argument("--slowdown-s", type=float, default=d["slowdown_s"], help="how long a slowdown lasts")
    h.add_argument("--slowdown-factor", type=float, default=d["slowdown_factor"], help="step x while slowed")
    p = sp.add_argument_group("protocol")
    p.add_argument("--fragments", type=int, default=d["fragments"], help="P: parameter fragments")
    p.add_argument("--sync-every", type=int, default=d["sync_every"], help="H: steps between syncs of one")
    p.add_argument("--overlap", type=int, default=d["overlap"], help="tau: steps a merge takes back")


def configs_from_args(args: argparse.Namespace) -> list[SimConfig]:
    """One validated SimConfig per requested system (raises ConfigError naming the bad value)."""
    names = (
        list(SYSTEMS) if args.system == "all" else [s.strip() for s in args.system.split(",") if s.strip()]
    )
    if not names:
        raise ConfigError(f"system={args.system!r} is invalid: choose from {', '.join(SYSTEMS)} or 'all'")
    for name, v in (("mtbi_years", args.mtbi_years), ("slowdown_mtbi_years", args.slowdown_mtbi_years)):
        if not v > 0:
            raise ConfigError(f"{name}={v!r} is invalid: must be > 0 (use inf for 'never')")
    if not (args.days > 0 and math.isfinite(args.days)):
        raise ConfigError(f"days={args.days!r} is invalid: must be a finite number of days > 0")
    common = dict(
        chips=args.chips,
        learners=args.learners,
        duration_s=args.days * DAY_S,
        mtbi_s=args.mtbi_years * YEAR_S,
        step_s=args.step_s,
        host_chips=args.host_chips,
        spare_s=args.spare_s,
        restart_s=args.restart_s,
        resize_s=args.resize_s,
        repair_s=args.repair_h * HOUR_S,
        learner_recovery=args.learner_recovery,
        slow_learners=args.slow_learners,
        slow_factor=args.slow_factor,
        jitter=args.jitter,
        slowdown_mtbi_s=args.slowdown_mtbi_years * YEAR_S,
        slowdown_s=args.slowdown_s,
        slowdown_factor=args.slowdown_factor,
        quorum=args.quorum,
        grace=args.grace,
        fragments=args.fragments,
        sync_every=args.sync_every,
        overlap=args.overlap,
        seed=args.seed,
    )
    cfgs = [SimConfig(system=name, **common) for name in names]
    if args.events:
        records = args.chips * args.days * DAY_S / args.step_s
        if records > MAX_EVENT_RECORDS:
            raise ConfigError(
                f"events={args.events!r} would need about {records:,.0f} per-chip step records "
                f"(chips x days / step); keep chips x steps under {MAX_EVENT_RECORDS:,} (fewer --chips or "
                "--days) or drop --events"
            )
    return cfgs


def describe(cfg: SimConfig) -> str:
    per = cfg.block_chips()
    mtbi = "never" if math.isinf(cfg.mtbi_s) else f"{cfg.mtbi_s / YEAR_S:g} year(s)"
    slowdowns = (
        "none"
        if math.isinf(cfg.slowdown_mtbi_s)
        else f"x{cfg.slowdown_factor:g} for {cfg.slowdown_s:g}s every {cfg.slowdown_mtbi_s / YEAR_S:g} "
        "year(s) per chip"
    )
    return "\n".join(
        [
            f"  cluster: {cfg.chips:,} chips in {cfg.learners} learners of {per[-1]:,}-{per[0]:,} chips, hosts "
            f"of {cfg.host_chips}; one interruption per chip every {mtbi}; {cfg.duration_s / DAY_S:g} days",
            f"  times: step {cfg.step_s:g}s, spare {cfg.spare_s:g}s, restart {cfg.restart_s:g}s, resize "
            f"{cfg.resize_s:g}s, repair {cfg.repair_s / HOUR_S:g}h; learner recovery: {cfg.learner_recovery}",
            f"  heterogeneity: {cfg.slow_learners} learners x{cfg.slow_factor:g}, jitter {cfg.jitter:g}; "
            f"transient slowdowns: {slowdowns}",
            f"  protocol: K={cfg.quorum} grace {'on' if cfg.grace else 'off'}, P={cfg.fragments} "
            f"H={cfg.sync_every} tau={cfg.overlap}; seed {cfg.seed}",
        ]
    )


def _table(rows: list[dict]) -> str:
    cols = [
        ("system", "system", "{}"),
        ("M", "learners", "{}"),
        ("K", "quorum", "{}"),
        ("grace", "grace", "{}"),
        ("goodput", "goodput", "{:.1%}"),
        ("down", "down_frac", "{:.1%}"),
        ("blocked", "blocked_frac", "{:.1%}"),
        ("dropped", "dropped_frac", "{:.1%}"),
        ("aborted", "lost_frac", "{:.1%}"),
        ("failures", "failures", "{:,}"),
        ("merges", "merges", "{:,}"),
        ("wall s", "wall_s", "{:.1f}"),
    ]
    cells = [[c for c, _, _ in cols]]
    for r in rows:
        dp = r["system"] != "decoupled"  # K and the grace window belong to the synchroniser
        cells.append(
            [
                "-"
                if dp and k in ("quorum", "grace")
                else fmt.format(("on" if r[k] else "off") if k == "grace" else r[k])
                for _, k, fmt in cols
            ]
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from sim import simulate
    from sim.accounting import RecordSink

    cfgs = configs_from_args(args)
    if not args.json:
        print("resolved configuration:\n" + describe(cfgs[0]), file=sys.stderr, flush=True)
    rows = []
    for cfg in cfgs:
        sink = None
        if args.events:
            path = args.events
            if len(cfgs) > 1:
                p = Path(path)
                path = str(p.with_name(f"{p.stem}.{cfg.system}{p.suffix}"))
            sink = RecordSink(cfg.block_chips(), path)
        bar = Bar(cfg.system, enabled=not (args.quiet or args.json))
        try:
            res = simulate(cfg, sink, lambda frac, bar=bar: bar(frac, "of virtual time"))
        finally:
            bar.close()
        row = res.as_dict()
        if sink is not None:
            row["events"] = sink.path
        rows.append(row)
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else {"runs": rows}, indent=2))
    else:
        print(_table(rows))
        for r in rows:
            if r["config"]["slow_learners"]:
                per = ", ".join(f"{g:.1%}" for g in r["learner_goodput"])
                print(f"{r['system']}: goodput per learner {per}")
    return 0
