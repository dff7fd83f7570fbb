"""A joiner's download at size: two donor nodes train until every fragment has moved past its
first round, then a third node joins and downloads the whole global state (every fragment's parameters and
outer momentum) from them, verifies it against the fragments' hashes, and starts training.

Printed: the model's parameters, how it joined (``join`` event: from which peers), the seconds of its
``state`` phase (from the swarm's membership to a verified state), the bytes it had received by the first
status read after joining (the download, plus any merge record since) and their rate over that phase, and
the joiner's peak resident memory against the fp32 weights.

    .venv/bin/python bench/join.py                          # the 85M configuration
    .venv/bin/python bench/join.py --flags "--preset small" --json

Real processes on loopback, each with its own p2p daemon; every process is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from node.common.status_client import read_control_token, send_control

ROOT = Path(__file__).resolve().parent.parent
M85 = "--dim 768 --layers 12 --heads 12 --seq-len 128 --batch-size 2"


def _start(state: Path, flags: list[str], peers: list[str]) -> subprocess.Popen:
    state.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "node", "node", "--state-dir", str(state), *flags]
    if peers:
        cmd += ["--initial-peers", ",".join(peers)]
    log = open(state / "node.log", "wb")
    # a TMPDIR inside the run's folder: what a node killed -9 leaves there (its DHT's sockets) goes with it
    (state / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(state / "tmp"))
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )


def _ready(state: Path, deadline: float) -> dict:
    while time.time() < deadline:
        try:
            return json.loads((state / "ready.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.5)
    raise TimeoutError(f"{state}: not ready in time (see its node.log)")


def _status(doc: dict) -> dict | None:
    try:
        with urllib.request.urlopen(doc["status_url"] + "/status", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _rss_peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(x for x in fh if x.startswith("VmHWM")).split()[1]) * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flags", default=M85, help="node flags of the model (default: the 85M configuration)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each node")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound on the whole run")
    ap.add_argument(
        "--pause-donors",
        action="store_true",
        help="pause the donors' learners while the joiner downloads (their agents serve it): on one machine "
        "the donors' training otherwise takes the cores the transfer runs on",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object")
    a = ap.parse_args(argv)
    flags = [*shlex.split(a.flags), "--threads", str(a.threads), "--eval-every-s", "3600"]
    deadline = time.time() + a.timeout_s
    procs = []
    with tempfile.TemporaryDirectory(prefix="ddiloco-join-") as tmp:
        run = Path(tmp)
        try:
            procs.append(_start(run / "donor-0", flags, []))
            d0 = _ready(run / "donor-0", deadline)
            procs.append(_start(run / "donor-1", flags, d0["maddrs"]))
            d1 = _ready(run / "donor-1", deadline)
            print("join: donors up; training until every fragment has moved ...", file=sys.stderr, flush=True)
            while True:
                st = [_status(d0), _status(d1)]
                if all(s and all(f["round"] >= 1 for f in s["fragments"]) for s in st):
                    break
                if time.time() > deadline:
                    raise TimeoutError("the donors did not move every fragment in time")
                time.sleep(2)
            if a.pause_donors:
                for d, name in ((d0, "donor-0"), (d1, "donor-1")):
                    send_control(d["status_url"], "pause", token=read_control_token(run / name))
            print("join: every fragment moved; the joiner starts", file=sys.stderr, flush=True)
            joiner = _start(run / "joiner", flags, d0["maddrs"] + d1["maddrs"])
            procs.append(joiner)
            j = _ready(run / "joiner", deadline)
            events = run / "joiner" / "events.jsonl"
            join = None
            while join is None:
                if time.time() > deadline:
                    raise TimeoutError("the joiner did not join in time")
                for line in events.read_text().splitlines() if events.exists() else []:
                    rec = json.loads(line)
                    if rec.get("kind") == "join":
                        join = rec
                time.sleep(0.5)
            doc = _status(j) or {}
            peak = _rss_peak(joiner.pid)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    weights = (doc.get("memory") or {}).get("weights_bytes") or 0
    su = join["startup"]
    state_s = su["state"] - su["membership"]
    received = doc.get("bytes_received", 0)
    out = {
        "params": weights // 4,
        "donors": "paused" if a.pause_donors else "training",
        "how": join.get("how"),
        "state_s": round(state_s, 2),
        "received_mb": round(received / 1e6, 1),
        "mb_per_s": round(received / 1e6 / state_s, 1) if state_s > 0 else None,
        "peak_rss_mb": round(peak / 1e6),
        "peak_x_weights": round(peak / weights, 2) if weights else None,
        "startup": su,
    }
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            f"{out['params']:,} parameters, donors {out['donors']}: joined by {out['how']}, state in {out['state_s']} s, "
            f"{out['received_mb']} MB received ({out['mb_per_s']} MB/s), peak RSS {out['peak_rss_mb']} MB "
            f"({out['peak_x_weights']}x the weights)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
