"""``ddiloco status``: a running node's view of the swarm, read from its HTTP status endpoint, or with
``--peer`` through libp2p (py-libp2p in a child process, ``node.cli.remote_status``)."""

from __future__ import annotations

import argparse
import json

from protocol.errors import ConfigError


def add_parser(sub) -> None:
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
    st.add_argument(
        "--peer",
        help="read the status through libp2p instead: the node's /ip4/HOST/tcp/PORT/p2p/PEER_ID (py-libp2p; "
        "no Go daemon started, no HTTP port needed)",
    )
    st.add_argument("--identity", help="with --peer: the caller's key file (default: a throwaway key)")
    st.add_argument(
        "--certificate",
        help="with --peer, in a private swarm: the caller's admission certificate (e.g. role observer)",
    )
    st.add_argument("--timeout-s", type=float, default=20.0, help="with --peer: deadline in seconds")
    st.add_argument(
        "--watch",
        action="store_true",
        help="keep showing the status, redrawn in place every --interval seconds until Ctrl+C "
        "(without a terminal: one frame per interval)",
    )
    st.add_argument("--interval", type=float, default=2.0, help="seconds between frames of --watch")
    st.add_argument(
        "--count", type=int, default=0, help="with --watch: stop after this many frames (0: never)"
    )


def memory_summary(mem: dict | None) -> str:
    """One line: the node's resident memory against its fp32 weights, and its parts (node.swarm.memory)."""
    if not mem or not mem.get("weights_bytes"):
        return "memory: -"
    w = mem["weights_bytes"]
    x = lambda b: f"{b / w:.2f}x"  # noqa: E731
    parts = "  ".join(f"{k} {x(v)}" for k, v in mem["host"].items() if v)
    rss = "-" if not mem.get("rss") else f"{mem['rss'] / 1e9:.2f} GB ({x(mem['rss'])})"
    peak = "-" if not mem.get("peak_rss") else f"{mem['peak_rss'] / 1e9:.2f} GB ({x(mem['peak_rss'])})"
    other = "" if mem.get("other") is None else f"  other {x(mem['other'])}"
    return f"memory: rss {rss}  peak {peak}  of {w / 1e6:.0f} MB fp32 weights; {parts}{other}"


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
        memory_summary(s.get("memory")),
        "",
        f"peers ({s.get('peer_count', len(s['peers']))}, {len(s['peers'])} listed):",
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


def fetch_peer_status(
    peer: str, identity: str | None = None, certificate: str | None = None, timeout_s: float = 20.0
) -> dict:
    """A remote node's status document through libp2p, read by ``node.cli.remote_status`` in a child
    process (py-libp2p and hivemind cannot share one process); StatusError when there is none."""
    import subprocess
    import sys

    from node.common.status_client import StatusError

    cmd = [sys.executable, "-m", "node.cli.remote_status", "--peer", peer, "--timeout-s", str(timeout_s)]
    cmd += ["--identity", identity] if identity else []
    cmd += ["--certificate", certificate] if certificate else []
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 30)
    except subprocess.TimeoutExpired as e:
        raise StatusError(f"{peer}: the libp2p client did not finish within {timeout_s + 30:g} s") from e
    if out.returncode != 0:
        why = out.stderr.strip().splitlines()[-1:] or [f"exit code {out.returncode}"]
        raise StatusError(why[0])
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    if not reply.get("ok"):
        raise StatusError(f"{peer} refused the status request: {reply.get('code')}: {reply.get('message')}")
    return reply["status"]


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from node.common.status_client import fetch_status

    if args.peer:
        s = fetch_peer_status(args.peer, args.identity, args.certificate, args.timeout_s)
        print(json.dumps(s, indent=2) if args.json else _status_table(s))
        return 0
    url = args.url
    if not url:
        ready = Path(args.state_dir) / "ready.json"
        if not ready.is_file():
            raise ConfigError(
                f"no --url given and {ready} does not exist; pass --url http://HOST:PORT or the node's --state-dir"
            )
        url = json.loads(ready.read_text())["status_url"]
    if args.watch:
        from node.cli.watch import watch

        if args.interval <= 0 or args.count < 0:
            raise ConfigError(f"--interval {args.interval} must be > 0 and --count {args.count} >= 0")
        return watch(lambda: fetch_status(url), url, args.interval, args.count)
    s = fetch_status(url)
    print(json.dumps(s, indent=2) if args.json else _status_table(s))
    return 0
