"""``ddiloco chaos``: real node processes under kill -9, SIGSTOP and restarts; goodput, stalls, hashes.

    ddiloco chaos                                         # 4 nodes, 300 s, a failure every 60 s on average
    ddiloco chaos --nodes 4 --duration 600 --mtbf-s 60 --seed 1 --json
    ddiloco chaos --plan faults.json --node-flags "--fragments 8 --sync-every 8"

The harness is ``node/chaos/harness.py``, the failure model ``node/chaos/plan.py``, the numbers
``node/chaos/report.py``; docs/chaos.md ("Real nodes under failures") has a run and how to read it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

from node.chaos.plan import FailureModel, plan_from_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = {f.name: f.default for f in fields(FailureModel)}
    cp = sub.add_parser(
        "chaos",
        help="run a local swarm of real nodes under a failure schedule and measure goodput",
        description="Start N 'ddiloco node' processes (as 'ddiloco up' does), then apply failures drawn from "
        "a seeded model: exponential gaps of mean --mtbf-s between failures anywhere in the swarm; each is a "
        "kill -9 of a node's process group (some aimed at the node synchronising a fragment at that moment) "
        "or a SIGSTOP pause; a killed node restarts on its own state folder after its return time. At the "
        "end: learners paused, one model hash awaited, every node stopped; goodput (protocol.goodput over the "
        "nodes' event records), tokens merged, eval loss, the longest global stall and bytes per node.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    cp.add_argument("--nodes", type=int, default=4, help="node processes")
    cp.add_argument("--duration", type=float, default=300.0, help="seconds under the plan, once all are up")
    cp.add_argument("--seed", type=int, default=0, help="seed of the failure plan")
    cp.add_argument(
        "--mtbf-s", type=float, default=d["mtbf_s"], help="mean seconds between failures (0: none)"
    )
    cp.add_argument(
        "--pause-share", type=float, default=d["pause_share"], help="share of failures that are SIGSTOP"
    )
    cp.add_argument(
        "--sync-share", type=float, default=d["sync_share"], help="share of kills aimed at a synchroniser"
    )
    cp.add_argument(
        "--return-s", type=float, default=d["return_s"], help="mean seconds before a killed node restarts"
    )
    cp.add_argument(
        "--pause-s", type=float, default=d["pause_s"], help="mean seconds of a SIGSTOP or partition"
    )
    cp.add_argument(
        "--partition-share",
        type=float,
        default=d["partition_share"],
        help="share of failures that are partitions (needs --netns)",
    )
    cp.add_argument(
        "--quiet-end-s", type=float, default=d["quiet_end_s"], help="no failure starts this close to the end"
    )
    cp.add_argument(
        "--plan",
        metavar="FILE",
        help="JSON list of faults {at_s, kind, node, fragment, hold_s} to apply instead",
    )
    cp.add_argument(
        "--stall-bound-s",
        type=float,
        default=30.0,
        help="bound on the longest interval with no merge anywhere",
    )
    cp.add_argument(
        "--min-alive", type=int, default=2, help="a failure that would leave fewer running nodes is skipped"
    )
    cp.add_argument("--settle-s", type=float, default=90.0, help="bound on the final wait for one model hash")
    cp.add_argument("--run-dir", help="folder for the nodes' state and logs (default: runs/chaos-TIMESTAMP)")
    cp.add_argument("--config", help="TOML file given to every node")
    cp.add_argument(
        "--node-flags", default="", help='extra flags for every node, e.g. "--fragments 8 --sync-every 8"'
    )
    cp.add_argument(
        "--learner-nice",
        type=int,
        default=10,
        help="niceness of every node's learner thread: the nodes share this host's cores, and a restarting "
        "node's start-up and every node's network side go first, as on hosts of their own (0: off)",
    )
    cp.add_argument(
        "--netns", action="store_true", help="each node in its own network namespace (root; iproute2)"
    )
    cp.add_argument(
        "--netns-rate",
        default="",
        help="with --netns: tc tbf cap of each node's link, each way, e.g. 100mbit",
    )
    cp.add_argument(
        "--netns-cpu",
        type=float,
        default=0.0,
        help="with --netns: CPU cores each node may use (a cgroup quota, as if on a host of its own; "
        "0: none, the nodes share the machine)",
    )
    cp.add_argument(
        "--baseline",
        choices=("sync-diloco", "streaming"),
        help="then run the same failure plan against a swarm of this system (the same nodes with --system) "
        "and compare goodput and eval loss",
    )
    cp.add_argument("--json", action="store_true", help="print the report as one JSON object")
    cp.add_argument("--quiet", action="store_true", help="no progress on stderr")  # fmt: skip


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def render(rep: dict) -> str:
    from node.local.launcher import columns

    net = ""
    if rep.get("netns"):
        net = ", one network namespace per node" + (
            f", links capped at {rep['netns_rate']}" if rep["netns_rate"] else ""
        )
    lines = [f"chaos run: {rep['nodes']} nodes, {rep['window_s']:g} s measured, seed {rep['seed']}{net}"]
    rows = [["t s", "fault", "node", "out s", "merges while out", "fragment merged again", "note"]]
    outs = rep.get("outages", [])
    for f in rep["faults"]:
        o = outs[f["outage"]] if "outage" in f and f["outage"] < len(outs) else None
        again = f.get("fragment_merged_again_s")
        where = (
            ",".join(map(str, f["side"])) if "side" in f else "-" if f.get("node") is None else str(f["node"])
        )
        rows.append(
            [
                f"{f['at_s']:.1f}",
                f["kind"] + (f" p{f['fragment']}" if f["kind"] == "kill_sync" else ""),
                where,
                "-" if o is None else f"{o['out_s']:.1f}" + ("" if o["back"] else " (to end)"),
                "-" if o is None else str(o["merges_meanwhile"]),
                "-" if again is None else f"{again:.1f} s",
                f.get("note", "")[:60],
            ]
        )
    lines += ["", columns(rows) if len(rows) > 1 else "no faults", ""]
    rows = [
        [
            "node",
            "peer",
            "lives",
            "steps",
            "MB out",
            "MB in",
            "failovers",
            "forks",
            "resyncs",
            "exit",
            "model hash",
        ]
    ]
    for n in rep.get("per_node", []):
        rows.append(
            [
                str(n["node"]),
                n["peer"][-8:],
                str(n["lives"]),
                str(n["steps"]),
                f"{n['mb_sent']:.1f}",
                f"{n['mb_received']:.1f}",
                str(n["failovers"]),
                str(n["forks"]),
                str(n["resyncs"]),
                str(n["exit_code"]),
                (n["hash"] or f"({n['state']})")[:16],
            ]
        )
    lines += [columns(rows), ""]
    g = rep.get("goodput", {})
    if "goodput" in g:
        lines.append(
            f"goodput {_pct(g['goodput'])}: useful {g['useful_s']:.0f} s of {g['allocated_s']:.0f} s allocated "
            f"(down {g['down_s']:.0f} s, dropped {g['dropped_s']:.0f} s, pending {g['pending_s']:.0f} s left out); "
            f"overlap {g.get('overlap_s', 0.0):.0f} s counted useful, strict {_pct(g.get('strict', g['goodput']))}"
        )
        lines.append(
            f"dropped: {g.get('killed_s', 0.0):.0f} s unsent when a process died, {g.get('left_out_s', 0.0):.0f} s "
            f"sent and left out, {g.get('unsent_s', 0.0):.0f} s overwritten before it was sent, "
            f"{g.get('late_s', 0.0):.0f} s overwritten more than tau steps after it was sent"
        )
    elif g:
        lines.append(f"goodput: {g.get('error')}")
    st = rep.get("stall")
    if st:
        verdict = "ok" if st["ok"] else "OVER"
        lines.append(
            f"longest global stall {st['global_s']:.1f} s at t={st['global_at_s']:.0f}s (bound {st['bound_s']:g} s: "
            f"{verdict}); longest one-fragment stall {st['fragment_s']:.1f} s (fragment {st['fragment']}); "
            f"{st['merges']} merges"
        )
    if "tokens_merged" in rep:
        li, lf = rep["eval_loss_initial"], rep["eval_loss_final"]
        lines.append(
            (f"tokens trained {rep['tokens_trained']:,.0f}, " if "tokens_trained" in rep else "tokens ")
            + f"merged {rep['tokens_merged']:,.0f} (c_tokens); "
            f"rounds merged {rep['rounds_merged']}; eval loss "
            f"{'-' if li is None else f'{li:.3f}'} -> {'-' if lf is None else f'{lf:.3f}'}"
        )
        hashes = set(rep["hashes"].values())
        verdict = "one model hash" if rep["equal_hashes"] else f"{len(hashes)} DIFFERENT hashes"
        lines.append(f"{verdict} across {len(rep['survivors'])} survivors {rep['survivors']}")
    lines.append(f"run folder {rep['run_dir']}")
    return "\n".join(lines)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _with_stop_signals(fn):
    """SIGINT and SIGTERM end the run through its clean-up (nodes stopped, namespaces deleted), also when
    this process was started in the background, where a shell leaves SIGINT ignored."""
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return fn()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run(args: argparse.Namespace) -> int:
    from node.chaos.config import ChaosConfig
    from node.chaos.harness import run_chaos

    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / time.strftime("chaos-%Y%m%d-%H%M%S")
    flags = shlex.split(args.node_flags)
    if args.config:
        flags = ["--config", str(Path(args.config).resolve()), *flags]
    model = FailureModel(
        mtbf_s=args.mtbf_s,
        pause_share=args.pause_share,
        sync_share=args.sync_share,
        return_s=args.return_s,
        pause_s=args.pause_s,
        partition_share=args.partition_share,
        quiet_end_s=args.quiet_end_s,
    )
    cfg = ChaosConfig(
        run_dir=run_dir,
        nodes=args.nodes,
        duration_s=args.duration,
        seed=args.seed,
        model=model,
        plan=plan_from_json(Path(args.plan).read_text()) if args.plan else None,
        node_flags=flags,
        learner_nice=args.learner_nice,
        stall_bound_s=args.stall_bound_s,
        min_alive=args.min_alive,
        settle_s=args.settle_s,
        netns=args.netns,
        netns_rate=args.netns_rate,
        netns_cpu=args.netns_cpu,
        quiet=args.quiet,
    )
    if args.baseline:
        cfg = replace(cfg, run_dir=run_dir / "decoupled")
    rep, plan = _with_stop_signals(lambda: run_chaos(cfg))
    if not args.baseline or rep["interrupted"]:
        print(json.dumps(rep, indent=2) if args.json else render(rep))
        return 130 if rep["interrupted"] else _verdict(rep)
    if not args.json:  # the first report as soon as it is known: the baseline takes as long again
        print(render(rep) + "\n", flush=True)
    if not args.quiet:
        print(f"now the baseline: {args.baseline} under the same {len(plan)} faults", file=sys.stderr)
    base_cfg = replace(
        cfg, run_dir=run_dir / args.baseline, plan=plan, node_flags=[*flags, "--system", args.baseline]
    )
    base, _ = _with_stop_signals(lambda: run_chaos(base_cfg))
    both = {"decoupled": rep, args.baseline: base, "comparison": compare(rep, base, args.baseline)}
    if args.json:
        print(json.dumps(both, indent=2))
    else:
        print(f"-- baseline: {args.baseline} --\n" + render(base) + "\n")
        print(render_comparison(both["comparison"]))
    if base["interrupted"]:
        return 130
    return max(_verdict(rep), _verdict(base, stall=False))  # the baseline's stalls are what it measures


def compare(ours: dict, base: dict, name: str) -> dict:
    """Goodput, tokens and final eval loss of the two runs of one plan, and their ratios."""

    def pick(rep: dict) -> dict:
        g = rep.get("goodput", {}).get("goodput")
        return {
            "goodput": g,
            "tokens_trained": rep.get("tokens_trained"),
            "eval_loss_final": rep.get("eval_loss_final"),
            "faults_applied": sum(
                1 for f in rep.get("faults", []) if not f.get("note", "").startswith("skip")
            ),
        }

    a, b = pick(ours), pick(base)
    ratio = a["goodput"] / b["goodput"] if a["goodput"] and b["goodput"] else None
    tok = a["tokens_trained"] / b["tokens_trained"] if a["tokens_trained"] and b["tokens_trained"] else None
    return {"baseline": name, "decoupled": a, name: b, "goodput_ratio": ratio, "tokens_ratio": tok}


def render_comparison(c: dict) -> str:
    name, a, b = c["baseline"], c["decoupled"], c[c["baseline"]]

    def loss(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    ratio = "-" if c["goodput_ratio"] is None else f"{c['goodput_ratio']:.2f}x"
    tok = "-" if c["tokens_ratio"] is None else f"{c['tokens_ratio']:.2f}x"
    return (
        f"same plan, decoupled against {name}: goodput {_pct(a['goodput'])} vs {_pct(b['goodput'])} "
        f"({ratio}); tokens trained {a['tokens_trained'] or 0:,.0f} vs {b['tokens_trained'] or 0:,.0f} ({tok}); "
        f"final eval loss {loss(a['eval_loss_final'])} vs {loss(b['eval_loss_final'])}; faults applied "
        f"{a['faults_applied']} vs {b['faults_applied']}"
    )


def _verdict(rep: dict, stall: bool = True) -> int:
    good = rep.get("goodput", {}).get("goodput")
    stalled = stall and not rep.get("stall", {}).get("ok")
    ok = rep.get("equal_hashes") and rep["settled"] and not stalled and good is not None
    if not ok:
        print(
            f"ddiloco chaos ({rep['run_dir']}): hashes differ, no quiet period, "
            + ("stall over its bound " if stall else "")
            + "or no goodput",
            file=sys.stderr,
        )
    return 0 if ok else 1
