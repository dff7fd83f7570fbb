"""``ddiloco up``: the quick-start, a local swarm of N node processes with a live status table."""

from __future__ import annotations

import argparse
import time


def add_parser(sub) -> None:
    upp = sub.add_parser(
        "up",
        help="start a local swarm of N node processes (the quick-start)",
        description="Start N 'ddiloco node' processes on this machine, node 0 as the others' bootstrap "
        "peer, training the embedded default model; show a live status table. Ctrl+C (or --duration) pauses "
        "the learners, waits for one model hash, stops every node and prints a summary.",
    )
    upp.add_argument("--nodes", type=int, default=3, help="number of nodes (default: 3)")
    upp.add_argument(
        "--duration", type=float, default=0.0, help="seconds of training, then stop (0: until Ctrl+C)"
    )
    upp.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    upp.add_argument("--quiet", action="store_true", help="no live table")
    upp.add_argument("--run-dir", help="folder for the nodes' state and logs (default: runs/up-TIMESTAMP)")
    upp.add_argument("--config", help="TOML file given to every node (its [node] state_dir is overridden)")
    upp.add_argument(
        "--node-flags", default="", help='extra flags for every node, e.g. "--fragments 8 --sync-every 8"'
    )
    upp.add_argument(
        "--fresh-processes",
        action="store_true",
        help="start every node as a fresh 'ddiloco node' process (default: forked from one process that "
        "imported torch and the node once: seconds of start-up and CPU saved for every node after the first)",
    )


def run(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from node.local.launcher import up

    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / time.strftime("up-%Y%m%d-%H%M%S")
    flags = shlex.split(args.node_flags)
    if args.config:
        flags = ["--config", str(Path(args.config).resolve()), *flags]
    return up(
        args.nodes,
        args.duration,
        run_dir,
        flags,
        as_json=args.json,
        quiet=args.quiet,
        fork=not args.fresh_processes,
    )
