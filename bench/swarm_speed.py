"""A learner's speed inside a swarm at size: N real nodes on this machine, each with ``--threads 1``,
against plain torch loops of the same model run the same way, side by side in this script.

The nodes train for ``--seconds`` after every one of them has made its first step; each node's step rate over
that window comes from its own ``step`` events (every step counted, so evaluations, checkpoints and the agent's
work on the learner's core are all in it). The baselines, run after the nodes have stopped, are ``plain_loop``
of ``bench/scale.py`` in child processes: one alone, and N at once (what N learners on N cores cost each
other in memory bandwidth, without any swarm). Printed per node: steps, the mean seconds per step over the
window, the median, and ``plain/node``, the baseline's median step time over the node's mean (1.0 = as fast as
the plain loop; the issue asks at least 0.85 against one thread), and the same over the window's second half
(past the start's one-off work: each node's first evaluation and its first checkpoint, which comes soon after
a join; ``--settled`` starts the whole window after them); then the CPU seconds per learner step of each
node's parts over the window (``/proc``): its learner thread, its other threads (agent, merges, checkpoints,
status), its DHT process and its p2p daemons; and its peak resident memory against its fp32 weights.

    .venv/bin/python bench/swarm_speed.py                     # 2 nodes, the 85M configuration, 180 s
    .venv/bin/python bench/swarm_speed.py --settled               # the steady rate, past the start's work
    .venv/bin/python bench/swarm_speed.py --size tiny --seconds 60 --json

Every process is killed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.join import _rss_peak, _status  # noqa: E402
from bench.scale import SIZES  # noqa: E402
from node.common.priority import process_tree  # noqa: E402
from node.local.launcher import Child, kill_group, start_node, wait_ready  # noqa: E402


def _plain(size: str, steps: int, copies: int) -> list[float]:
    """Median seconds per step of ``copies`` plain loops run at once, one thread each."""
    cmd = [sys.executable, str(ROOT / "bench" / "scale.py"), "--plain", size, "--steps", str(steps)]
    procs = [
        subprocess.Popen([*cmd, "--threads", "1"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for _ in range(copies)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"the plain loop exited with {p.returncode}")
        out.append(json.loads(stdout)["plain_step_s"])
    return out


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat: str) -> float:
    f = stat.rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / _TICK  # utime + stime


def _faults(stat: str) -> int:
    return int(stat.rsplit(")", 1)[1].split()[7])  # minflt


def cpu_by_part(pid: int) -> dict[str, float]:
    """CPU seconds so far of a node's processes, by part: its learner thread, the rest of the node's own
    process (agent, merges, checkpoints, status), and each kind of child process by its command name."""
    parts: dict[str, float] = {}
    for p in process_tree(pid):  # the node, its DHT process, its p2p daemons
        try:
            with open(f"/proc/{p}/stat") as fh:
                total = _cpu_s(fh.read())
            with open(f"/proc/{p}/comm") as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        if p != pid:
            key = "p2pd" if comm == "p2pd" else "dht process" if comm.startswith("python") else comm
            parts[key] = parts.get(key, 0.0) + total
            continue
        learner, faults = 0.0, 0
        for t in os.listdir(f"/proc/{p}/task"):
            try:
                with open(f"/proc/{p}/task/{t}/comm") as fh:
                    if fh.read().strip() == "ddiloco-learn":
                        with open(f"/proc/{p}/task/{t}/stat") as fh2:
                            stat = fh2.read()
                        learner += _cpu_s(stat)
                        faults += _faults(stat)
            except OSError:
                pass
        parts["learner thread"] = learner
        parts["learner thread page faults"] = faults
        parts["node, other threads"] = total - learner
    return parts


def _events(state: Path, kind: str) -> list[dict]:
    path = state / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(None, lines)) if e.get("kind") == kind]


def _steps(state: Path) -> list[dict]:
    return _events(state, "step")


def run_nodes(
    size: str,
    nodes: int,
    seconds: float,
    timeout_s: float,
    run: Path,
    extra: list[str],
    settled: bool = False,
) -> list[dict]:
    flags = [*SIZES[size], "--threads", "1", *extra]
    deadline = time.time() + timeout_s
    kids: list[Child] = []
    try:
        for i in range(nodes):  # each in its own process group and TMPDIR (kill_group removes both)
            kids.append(start_node(i, run, flags, kids[0].maddrs if kids else []))
            wait_ready([kids[-1]], timeout_s)
        procs = [c.proc for c in kids]
        print(f"swarm_speed: {nodes} nodes up; waiting for every first step", file=sys.stderr, flush=True)
        while not all(_steps(c.state_dir) for c in kids):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"not every node stepped; see the node.log files under {run}")
            time.sleep(1)
        if settled:  # past each node's one-off start work: its first evaluation and first checkpoint
            print("swarm_speed: waiting for every node's first checkpoint", file=sys.stderr, flush=True)
            while not all(_events(c.state_dir, "checkpoint") for c in kids):
                if time.time() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"not every node checkpointed; see the node.log files under {run}")
                time.sleep(1)
        t0 = time.time()
        cpu0 = [cpu_by_part(p.pid) for p in procs]
        print(f"swarm_speed: every node steps; measuring {seconds:.0f} s", file=sys.stderr, flush=True)
        while time.time() < t0 + seconds:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a node exited; see the node.log files under {run}")
            time.sleep(2)
        t1 = time.time()
        cpu1 = [cpu_by_part(p.pid) for p in procs]
        statuses = [_status({"status_url": c.url}) or {} for c in kids]
        peaks = [_rss_peak(p.pid) for p in procs]
    finally:
        for c in kids:
            kill_group(c)
    rows = []
    for i in range(nodes):
        window = [e for e in _steps(run / f"node-{i}") if e["t0"] >= t0 and e["t1"] <= t1]
        if len(window) < 2:
            raise RuntimeError(f"node {i}: {len(window)} steps in the window; give it more --seconds")
        span = window[-1]["t1"] - window[0]["t0"]
        late = window[len(window) // 2 :]  # the window's second half: past the start's one-off work
        rounds = statuses[i].get("rounds_merged")
        rows.append(
            {
                "node": i,
                "steps": len(window),
                "mean_step_s": round(span / len(window), 3),
                "late_step_s": round((late[-1]["t1"] - late[0]["t0"]) / len(late), 3),
                "median_step_s": round(statistics.median(e["t1"] - e["t0"] for e in window), 3),
                "merges": rounds,
                "peak_rss_x_weights": round(peaks[i] / w, 2)
                if (w := (statuses[i].get("memory") or {}).get("weights_bytes"))
                else None,
                # CPU seconds per learner step over the window, by part
                "cpu_per_step": {
                    k: round((v - cpu0[i].get(k, 0.0)) / len(window), 3) for k, v in cpu1[i].items()
                },
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="85m", choices=sorted(SIZES), help="model size (bench/scale.py's)")
    ap.add_argument("--nodes", type=int, default=2, help="nodes on this machine, one torch thread each")
    ap.add_argument("--seconds", type=float, default=180.0, help="measured seconds after every first step")
    ap.add_argument("--steps", type=int, default=12, help="steps of each plain loop")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound on the nodes' start")
    ap.add_argument("--flags", default="", help='more node flags, e.g. "--checkpoint-every-s 300"')
    ap.add_argument(
        "--settled",
        action="store_true",
        help="start the window once every node has written its first checkpoint (10 s after joining) and "
        "made its first evaluation: the one-off start work left out, the steady rate measured",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object")
    ap.add_argument(
        "--keep", help="run the nodes in this new folder and keep it (events, logs); default: removed"
    )
    a = ap.parse_args(argv)
    if a.keep:
        Path(a.keep).mkdir(parents=True)
    with (
        contextlib.nullcontext(a.keep)
        if a.keep
        else tempfile.TemporaryDirectory(prefix="ddiloco-speed-") as tmp
    ):
        rows = run_nodes(a.size, a.nodes, a.seconds, a.timeout_s, Path(tmp), shlex.split(a.flags), a.settled)
    print("swarm_speed: plain loops, one alone and then all at once", file=sys.stderr, flush=True)
    alone = _plain(a.size, a.steps, 1)[0]
    together = statistics.median(_plain(a.size, a.steps, a.nodes))
    for r in rows:
        r["plain_alone_ratio"] = round(alone / r["mean_step_s"], 3)
        r["plain_together_ratio"] = round(together / r["mean_step_s"], 3)
        r["plain_alone_late_ratio"] = round(alone / r["late_step_s"], 3)
    out = {
        "size": a.size,
        "flags": a.flags,
        "window": "settled" if a.settled else "from the first steps",
        "plain_alone_s": round(alone, 3),
        "plain_together_s": round(together, 3),
        "nodes": rows,
    }
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"window: {out['window']}, {a.seconds:.0f} s")
    print(f"plain loop, one thread: alone {alone:.3f} s/step; {a.nodes} at once {together:.3f} s/step each")
    print(
        "node  steps  mean s/step  median  plain(alone)/node  plain(together)/node  merges"
        "  second half: s/step  plain(alone)/node"
    )
    for r in rows:
        print(
            f"{r['node']:>4} {r['steps']:>6} {r['mean_step_s']:>12} {r['median_step_s']:>7} "
            f"{r['plain_alone_ratio']:>18} {r['plain_together_ratio']:>21}  {r['merges']:>6}"
            f"  {r['late_step_s']:>20} {r['plain_alone_late_ratio']:>18}"
        )
    for r in rows:
        parts = ", ".join(f"{k} {v}" for k, v in r["cpu_per_step"].items())
        print(
            f"node {r['node']}: per learner step (CPU seconds; page faults): {parts}; peak RSS {r['peak_rss_x_weights']}x the weights"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
