"""``ddiloco up`` as a user runs it, with its memory measured: each node process's
resident memory sampled beside it.

Every ``--every-s`` (0.1 s) this script reads ``/proc/PID/status`` of each node (``up``'s node processes; their
DHT processes are left out) and keeps VmHWM, the kernel's own peak, so a spike shorter than the interval still
counts. Each rise of a node's peak is set against that node's events within ``--window-s`` and the largest
are printed. At the end, per node: peak RSS against its fp32 weights (``weights_bytes`` from the node's own
memory account) and the 8x budget; then how staggered the rounds were: for each merge in the run's second
half on node 0, the fragments due within half a step of it (1.0: one round a step, as the plan staggers
them). The run folder's checkpoints and model files are deleted afterwards (a 124M run writes gigabytes).

    .venv/bin/python bench/up_memory.py                      # 3 nodes of GPT-2 small's shape, 600 s
    .venv/bin/python bench/up_memory.py --duration 20 --node-flags "--dim 32 --layers 2 --heads 2"
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACCEPTANCE = "--preset gpt2-125m --seq-len 128 --batch-size 2"


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _nodes(up_pid: int, run_dir: Path) -> dict[int, str]:
    """The node processes of ``up``, by pid, and their folder's name. ``up`` forks its nodes from a fork
    server (``node.local.forks``; with ``--fresh-processes`` they are its own children): a node is named by
    the pid its ``ready.json`` gives, and is measured from the moment it wrote it (VmHWM is the kernel's
    peak of the process's life, so nothing is missed)."""
    named = {}
    for ready in run_dir.glob("node-*/ready.json"):
        try:
            named[int(json.loads(ready.read_text())["pid"])] = ready.parent.name
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written
    pids = _children(up_pid)
    pids += [g for c in pids for g in _children(c)]  # a fork server's nodes
    return {pid: named[pid] for pid in pids if pid in named}


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _weights(node_dir: Path) -> int | None:
    """The node's fp32 weights in bytes, from its status endpoint (``ready.json`` names it)."""
    try:
        ready = json.loads((node_dir / "ready.json").read_text())
        with urllib.request.urlopen(ready["status_url"].rstrip("/") + "/status", timeout=5) as r:
            return int(json.loads(r.read())["memory"]["weights_bytes"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _bunching(events: Path) -> tuple[float, int] | None:
    ms = [json.loads(line) for line in events.read_text().splitlines() if '"kind": "merge"' in line]
    ms = [m for m in ms if m.get("period")]
    if not ms:
        return None
    mid = (min(m["due"] for m in ms) + max(m["due"] for m in ms)) / 2
    late = [m for m in ms if m["due"] > mid]
    counts = [len({x["fragment"] for x in late if abs(x["due"] - m["due"]) <= m["period"] / 2}) for m in late]
    return sum(counts) / len(counts), max(counts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--node-flags", default=ACCEPTANCE)
    ap.add_argument("--every-s", type=float, default=0.1)
    ap.add_argument(
        "--fresh-processes", action="store_true", help="up's nodes as fresh processes, not forked (up's flag)"
    )
    ap.add_argument("--window-s", type=float, default=3.0, help="events shown around each rise of a peak")
    ap.add_argument("--run-dir", default="", help="keep the run here (default: a temporary folder, removed)")
    a = ap.parse_args()
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="up_memory_"))
    cmd = [sys.executable, "-m", "node", "up", "--nodes", str(a.nodes), "--duration", str(a.duration)]
    cmd += ["--json", "--run-dir", str(run_dir), "--node-flags", a.node_flags]
    cmd += ["--fresh-processes"] if a.fresh_processes else []
    up = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(up.stdout.read()), daemon=True)
    reader.start()
    peak: dict[int, int] = {}
    rises: list[tuple[float, int, int]] = []
    names: dict[int, str] = {}
    weights: dict[int, int] = {}
    last_print = time.time()
    try:
        while up.poll() is None:
            for pid, name in _nodes(up.pid, run_dir).items():
                try:
                    st = _status(pid)
                except OSError:
                    continue
                names[pid] = name
                h = st.get("VmHWM", 0)
                if h > peak.get(pid, 0) + (2 << 20):
                    rises.append((time.time(), pid, h))
                peak[pid] = max(peak.get(pid, 0), h)
                if pid not in weights and (w := _weights(run_dir / names[pid])):
                    weights[pid] = w
            if time.time() - last_print > 30:
                last_print = time.time()
                print(" ".join(f"{names[p]} {v >> 20} MiB" for p, v in sorted(peak.items())), flush=True)
            time.sleep(a.every_s)
        reader.join(30)
        summary = json.loads(out[0]) if out and out[0].strip() else {}
        print(f"one hash: {summary.get('equal_hashes')}, rounds merged: {summary.get('rounds_merged')}")
        for pid, h in sorted(peak.items()):
            w = weights.get(pid)
            ratio = (
                f"{h / w:.3f}x the fp32 weights ({w >> 20} MiB), budget 8x = {8 * w >> 20} MiB" if w else ""
            )
            print(f"{names[pid]}: peak {h >> 20} MiB {ratio}")
            ev_path = run_dir / names[pid] / "events.jsonl"
            events = [json.loads(x) for x in ev_path.read_text().splitlines()] if ev_path.exists() else []
            for t, _, v in sorted((r for r in rises if r[1] == pid), key=lambda r: -r[2])[:3]:
                near = [
                    f"{e['kind']}{'/' + str(e['fragment']) if 'fragment' in e else ''}@{e['t'] - t:+.1f}s"
                    for e in sorted(events, key=lambda e: abs(e.get("t", 0) - t))
                    if abs(e.get("t", 0) - t) < a.window_s
                ]
                print(f"    rose to {v >> 20} MiB beside: {' '.join(near[:12])}")
        b = _bunching(run_dir / "node-0" / "events.jsonl") if (run_dir / "node-0").exists() else None
        if b:
            print(
                f"rounds due within half a step of a merge (node 0, second half): mean {b[0]:.2f}, max {b[1]}"
            )
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(60)
        for d in run_dir.glob("node-*"):
            shutil.rmtree(d / "checkpoints", ignore_errors=True)
            for f in d.glob("model*"):
                shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)
        if not a.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
