"""The ``ddiloco`` command line (also ``python -m node``). One parser, one subcommand per job.

  ddiloco train-local    an in-process swarm of M learners on a virtual clock (this machine, no network)
  ddiloco node           one node of a real swarm (DHT discovery, elected synchronisers)
  ddiloco up             a local swarm of N node processes with a live status table
  ddiloco status         a node's view of the swarm (peers, roles, rounds, loss, bandwidth, goodput)
  ddiloco keygen         create a node identity and print its peer id

Run ``ddiloco SUBCOMMAND --help`` for the flags. ``main(argv)`` returns an exit code so tests can call it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from protocol.errors import ConfigError, DDiLoCoError

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    from node.cli.config import add_config_args

    p = argparse.ArgumentParser(prog="ddiloco", description="Peer-to-peer Decoupled DiLoCo training node.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    tl = sub.add_parser(
        "train-local",
        help="train M learners in one process on a virtual clock, and compare systems",
        description="Train M real learners in this process through the Decoupled DiLoCo core, on a virtual "
        "clock (step times, links and failures are simulated; the training is real). Runs on the embedded "
        "default (a small byte-level transformer on generated text) unless --data/--task say otherwise.",
    )
    tl.add_argument("--config", help="TOML file with [run] [protocol] [task] [model] [inner] [net] tables")
    tl.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    tl.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_args(tl)
    from node.swarm.settings import NodeConfig

    nd = sub.add_parser(
        "node",
        help="run one node of a swarm: a learner plus its network agent",
        description="Run one swarm node: it joins the DHT through --initial-peers (or starts a swarm), "
        "trains its learner, sends contributions to the elected synchroniser of each fragment, takes that "
        "role when elected, and keeps a replica of the global model. Status: GET STATUS_URL/status (the URL "
        "is in STATE_DIR/ready.json). SIGTERM or Ctrl+C stops it after a checkpoint and an export.",
    )
    nd.add_argument("--config", help="TOML file with [node] [protocol] [task] [model] [inner] tables")
    add_config_args(nd, root=NodeConfig)
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
    from node.cli.swarm import add_swarm_parser

    add_swarm_parser(sub)
    st = sub.add_parser(
        "status",
        help="show a node's view of the swarm",
        description="Read a running node's status endpoint (plain HTTP; no p2p daemon is started) and show "
        "peers, who synchronises which fragment, rounds, loss, tokens/s, bytes sent and received, refusals "
        "and goodput.",
    )
    st.add_argument(
        "--url", help="status URL, e.g. http://127.0.0.1:8470 (default: from STATE_DIR/ready.json)"
    )
    st.add_argument("--state-dir", default="node-state", help="node state folder holding ready.json")
    st.add_argument("--json", action="store_true", help="print the raw JSON")
    kg = sub.add_parser(
        "keygen",
        help="create a node identity (Ed25519 key; prints its libp2p peer id)",
        description="Write a new Ed25519 node identity in the libp2p key format that the "
        "node's DHT daemon reads, and print its peer id.",
    )
    kg.add_argument("--out", default="identity.key", help="key file to write (default: identity.key)")
    kg.add_argument("--force", action="store_true", help="overwrite an existing key file")
    from node.cli.sim import add_sim_parser

    add_sim_parser(sub)
    from node.cli.chaos import add_chaos_parser

    add_chaos_parser(sub)
    return p


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        self.label, self.enabled = label, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self._last_decile = -1

    def __call__(self, done: int, total: int, loss: float) -> None:
        if not self.enabled:
            return
        frac = min(1.0, done / total)
        decile = int(frac * 10)
        if not self.tty and decile == self._last_decile:
            return
        self._last_decile = decile
        bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
        line = (
            f"{self.label:<12} [{bar}] {frac * 100:5.1f}%  tokens {done / 1e6:.2f}M/{total / 1e6:.2f}M  "
            f"eval loss {loss:.3f}  {time.monotonic() - self.t0:5.1f}s"
        )
        print(("\r" if self.tty else "") + line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


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


def cmd_train_local(args: argparse.Namespace) -> int:
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
        bar = Progress(system, enabled=not (args.quiet or args.json))
        t0 = time.monotonic()
        try:
            res = run_system(task, run, replace(cfg.protocol), cfg.inner, events, bar)
        finally:
            events.close()
            bar.done()
        if r.export:
            from node.swarm.checkpoint import export_model

            out = _per_system(r.export, system, "," in r.system)
            export_model(out, res.final_params, {"system": system, "model_hash": res.model_hash})
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


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """argv less ``flag VALUE`` / ``flag=VALUE`` (torchrun's parser would take --nproc as its own prefix)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def cmd_node(args: argparse.Namespace, argv: list[str]) -> int:
    import os

    from node.cli.config import build_config, describe
    from node.learner.unit import Unit, run_rank
    from node.swarm.agent import Node
    from node.swarm.settings import NodeConfig

    cfg = build_config(args, args.config, root=NodeConfig)
    n = cfg.node.nproc
    world = os.environ.get("WORLD_SIZE")
    unit_cls = Unit
    if cfg.node.shard:
        from node.learner.task import load_task
        from node.learner.unit_fsdp import ShardedUnit, check_shardable

        if max(n, int(world or 1)) < 2:
            raise ConfigError(
                "shard=True is invalid for a single-process learner: FSDP2 shards across the processes of a "
                "learner unit; add --nproc N with N >= 2 (or start the node under torchrun)"
            )
        check_shardable(load_task(None, cfg.task_config()).new_model())
        unit_cls = ShardedUnit
    if n > 1 and world is None:
        # A multi-process learner unit: torchrun starts n copies of this command, ranks in the environment.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
        cmd += ["-m", "node", *_without_flag(argv, "--nproc")]
        print(f"starting a {n}-process learner unit: {' '.join(cmd)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os.execv(sys.executable, cmd)
    if n > 1 and int(world) != n:
        raise ConfigError(f"nproc={n} is invalid: torchrun started {world} processes (WORLD_SIZE)")
    unit = unit_cls.from_env(cfg.node.unit_timeout_s)
    if unit is not None and not unit.lead:
        rc = run_rank(cfg, unit)
        # No interpreter teardown: after destroy_process_group, gloo's threads now and then abort it
        # (SIGABRT, "terminate called without an active exception") once all the rank's work is done.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    print("resolved configuration:\n" + describe(cfg), file=sys.stderr, flush=True)
    node = Node(cfg, unit)
    print(f"node {node.peer_id} starting (state in {cfg.node.state_dir})", file=sys.stderr, flush=True)
    return node.run()


def cmd_up(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from node.local.launcher import up

    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / time.strftime("up-%Y%m%d-%H%M%S")
    flags = shlex.split(args.node_flags)
    if args.config:
        flags = ["--config", str(Path(args.config).resolve()), *flags]
    return up(args.nodes, args.duration, run_dir, flags, as_json=args.json, quiet=args.quiet)


def _status_table(s: dict) -> str:
    lr = s["learner"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines = [
        f"node {s['peer_id']}  swarm {s['swarm']}{'  (client mode)' if s['client_mode'] else ''}  "
        f"up {s['uptime_s']:.0f}s  joined by {s['joined_by']}",
        f"learner: steps {lr['steps']}  tokens {lr['tokens']:,}  {lr['tokens_per_s']:.0f} tok/s  "
        f"loss {fmt(lr['loss'], '.3f')}  eval loss {fmt(lr['eval_loss'], '.3f')}"
        f"{'  PAUSED' if lr['paused'] else ''}",
        *(
            [
                f"learner unit: {u['world']} processes ({u['backend']}"
                f"{', FSDP2 shards' if u.get('mode') == 'fsdp' else ''}), {lr['tokens_per_step']:,} tokens/step, "
                f"rank checks {u['checks']}, mismatches {u['mismatches']}"
            ]
            if (u := lr.get("unit"))
            else []
        ),
        f"global model {s['model_hash'][:16]}  rounds merged {s['rounds_merged']}  "
        f"tokens merged {s['tokens_merged']:,.0f}  goodput {fmt(s['goodput'], '.1%')}",
        f"bytes sent {s['bytes_sent'] / 1e6:.2f} MB  received {s['bytes_received'] / 1e6:.2f} MB  "
        f"refused {s['refused'] or 'none'}",
        "counters: " + "  ".join(f"{k} {v}" for k, v in s["counters"].items()),
        "",
        f"peers ({len(s['peers'])}):",
    ]
    for m in s["peers"]:
        lines.append(
            f"  {m['peer_id']}  step {m['step']}  {m['tokens_per_s']:.0f} tok/s  rounds {m['rounds']}"
            f"{'  client' if m['client_mode'] else ''}"
        )
    lines.append("")
    lines.append("fragment  round  hash              synchroniser")
    for f in s["fragments"]:
        me = "  (this node)" if f["synchroniser"] == s["peer_id"] else ""
        lines.append(f"{f['fragment']:>8}  {f['round']:>5}  {f['hash']}  {f['synchroniser'] or '-'}{me}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from node.common.status_client import fetch_status

    url = args.url
    if not url:
        ready = Path(args.state_dir) / "ready.json"
        if not ready.is_file():
            raise ConfigError(
                f"no --url given and {ready} does not exist; pass --url http://HOST:PORT or the node's --state-dir"
            )
        url = json.loads(ready.read_text())["status_url"]
    s = fetch_status(url)
    print(json.dumps(s, indent=2) if args.json else _status_table(s))
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dht.identity import Identity
    from protocol.errors import ConfigError

    if Path(args.out).exists() and not args.force:
        raise ConfigError(
            f"out={args.out!r} already exists; it is a node's identity, so it is not replaced "
            "unless you pass --force"
        )
    ident = Identity.generate()
    ident.save(args.out)
    print(ident.peer_id)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "train-local":
            return cmd_train_local(args)
        if args.command == "keygen":
            return cmd_keygen(args)
        if args.command == "node":
            return cmd_node(args, sys.argv[1:] if argv is None else list(argv))
        if args.command == "up":
            return cmd_up(args)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "sim":
            from node.cli.sim import cmd_sim

            return cmd_sim(args)
        if args.command == "swarm":
            from node.cli.swarm import cmd_swarm

            return cmd_swarm(args)
        if args.command == "chaos":
            from node.cli.chaos import cmd_chaos

            return cmd_chaos(args)
    except DDiLoCoError as e:
        print(f"ddiloco: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ddiloco: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
