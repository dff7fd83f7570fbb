"""``ddiloco doctor``: why a node is not contributing, in plain words.

Against a running node (``--state-dir`` on its host, or ``--url``) it reads the node's status and event
records and dials the address the node announces from a fresh p2p daemon; as a pre-flight check before a
start (``--initial-peers``, ``--host-maddrs``) it dials each initial peer and binds each listen port. Each
check is one line: ok, warn or fail, with the evidence and a fix (the rules: ``node.common.diagnosis``).
The exit code is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from node.common import diagnosis as dx
from node.common.diagnosis import Check

EVENTS_TAIL = 8 << 20  # bytes of events.jsonl read from its end: the newest records are what matter


def add_parser(sub) -> None:
    d = sub.add_parser(
        "doctor",
        help="diagnose why a node is not contributing (or will not start)",
        description="Checks, each with evidence and a fix: initial peers (each dialed), the listen port, "
        "the announced address dialed back from a fresh p2p daemon, client mode / NAT, the state download "
        "(donors, bytes, rate, stuck donors), the last contributions' outcomes and refusal codes, rounds "
        "behind the swarm per fragment, checkpoint disk space, and the torch build and device. Against a "
        "running node give --state-dir (or --url); before a start give the flags you will start it with. "
        "Exit code 1 when a check fails.",
    )
    d.add_argument(
        "--state-dir", help="a running node's state folder (ready.json, events.jsonl, checkpoints)"
    )
    d.add_argument("--url", help="a running node's status URL, e.g. http://127.0.0.1:8470")
    d.add_argument(
        "--initial-peers", default="", help="comma-separated multiaddrs with /p2p/<peer id> to dial"
    )
    d.add_argument("--host-maddrs", default="", help="pre-flight: comma-separated listen addresses to bind")
    d.add_argument(
        "--announce-maddrs", default="", help="addresses to dial back (default: what the node announces)"
    )
    d.add_argument("--stall-s", type=float, default=10.0, help="a donor with no byte for this long is stuck")
    d.add_argument("--dial-timeout-s", type=float, default=10.0, help="deadline of each dial")
    d.add_argument("--json", action="store_true", help="print the checks as JSON")


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _endpoint(state_dir: Path) -> dict | None:
    """ready.json of a node that runs, else starting.json of one still joining (same fields)."""
    for name in ("ready.json", "starting.json"):
        p = state_dir / name
        if p.is_file():
            try:
                return json.loads(p.read_text())
            except ValueError:
                continue
    return None


def tail_events(path: Path, max_bytes: int = EVENTS_TAIL) -> list[dict]:
    """The newest event records of ``events.jsonl`` (its last ``max_bytes``; a torn line is skipped)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - max_bytes))
            raw = fh.read()
    except OSError:
        return []
    lines = raw.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _torch() -> Check:
    import torch

    build = f"torch {torch.__version__}" + (
        f", CUDA {torch.version.cuda}" if torch.version.cuda else ", CPU build"
    )
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return Check("torch", "ok", f"{build}; devices: {', '.join(names)}")
    if torch.version.cuda:
        return Check(
            "torch",
            "warn",
            f"{build}, but no GPU is visible (CUDA_VISIBLE_DEVICES, driver?); the learner runs on the CPU",
            "check nvidia-smi and the driver, or install the CPU build if this host has no GPU",
        )
    return Check("torch", "ok", f"{build}; the learner runs on the CPU ({torch.get_num_threads()} threads)")


def _disk(state_dir: Path) -> Check:
    folder = state_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    ckpts = sorted((state_dir / "checkpoints").glob("ckpt-*.safetensors"))
    size = ckpts[-1].stat().st_size if ckpts else 0
    return dx.disk(str(state_dir), shutil.disk_usage(folder).free, size)


def _with_peer_id(addrs: list[str], peer_id: str) -> list[str]:
    return [a if "/p2p/" in a else f"{a}/p2p/{peer_id}" for a in addrs]


def diagnose(args: argparse.Namespace) -> list[Check]:
    from node.common.status_client import StatusError, fetch_status
    from node.swarm.probe import dial, port_errors

    checks: list[Check] = []
    state_dir = Path(args.state_dir) if args.state_dir else None
    url, ep = args.url, None
    if state_dir is not None and not url:
        ep = _endpoint(state_dir)
        url = ep["status_url"] if ep else None
    running = bool(url)
    status: dict | None = None
    if running:
        try:
            status = fetch_status(url, timeout_s=10.0)
            checks.append(
                Check("node", "ok", f"{status['peer_id']} answers at {url}, up {status['uptime_s']:.0f} s")
            )
        except StatusError as e:
            checks.append(
                Check("node", "fail", str(e), "start the node, or give the --url it prints in ready.json")
            )
    elif state_dir is not None and (state_dir / "events.jsonl").exists():
        checks.append(
            Check(
                "node",
                "fail",
                f"{state_dir} has event records but neither ready.json nor starting.json: the node is not running "
                "or has not reached its network start",
                f"start it, or read {state_dir}/node.log for why it stopped",
            )
        )
    peers = _split(args.initial_peers)
    hosts = _split(args.host_maddrs)
    announce = _split(args.announce_maddrs)
    own = [] if status is None else _with_peer_id(announce or status.get("maddrs", []), status["peer_id"])
    dials = list(dict.fromkeys(peers + own))
    try:
        dialed = dict(dial(dials, args.dial_timeout_s))
    except Exception as e:  # noqa: BLE001 - the probe daemon itself could not start
        dialed = {a: f"the probe's own p2p daemon failed: {type(e).__name__}: {e}" for a in dials}
    if peers:
        checks.append(dx.initial_peers([(a, dialed[a]) for a in peers]))
    if hosts and not running:
        checks.append(dx.ports(port_errors(hosts)))
    if status is not None:
        checks.append(dx.reachability([(a, dialed[a]) for a in own], bool(status.get("client_mode"))))
        checks.append(dx.mode(status))
        events = tail_events(state_dir / "events.jsonl") if state_dir is not None else []
        checks.append(dx.download(status, events, args.stall_s))
        checks.append(dx.quorum(status, events))
        checks.append(dx.schedule(status))
        checks.append(dx.own_link(status))
    elif announce and not running:
        checks.append(
            Check(
                "announced address",
                "warn",
                f"{announce}: nothing listens there before the node starts",
                "run 'ddiloco doctor --state-dir STATE_DIR' once the node runs: it dials the address back",
            )
        )
    if state_dir is not None:
        checks.append(_disk(state_dir))
    checks.append(_torch())
    return checks


def run(args: argparse.Namespace) -> int:
    from protocol.errors import ConfigError

    if not (args.state_dir or args.url or args.initial_peers or args.host_maddrs):
        raise ConfigError(
            "nothing to check: give a running node's --state-dir or --url, or the --initial-peers and "
            "--host-maddrs you will start a node with"
        )
    checks = diagnose(args)
    if args.json:
        doc = {"ok": dx.exit_code(checks) == 0, "checks": [c.to_dict() for c in checks]}
        print(json.dumps(doc, indent=2))
    else:
        print(dx.render(checks))
    sys.stdout.flush()
    return dx.exit_code(checks)
