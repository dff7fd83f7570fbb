"""Learner-unit benchmark (issue 6): a 2-process unit's throughput inside a swarm against the same unit alone.

The swarm has two nodes of different speeds: node 0 is a learner unit of ``--nproc`` processes
(``ddiloco node --nproc N``: torchrun, DDP over gloo on CPU, one torch thread per rank), node 1 a single
learner that sleeps ``--slow-delay`` seconds after each step (a slower chip). Alone, the same two run side by
side without any network: the unit as a plain DDP loop of ``Learner.train_step`` over the same gloo group
(``--nproc`` spawned ranks), and the single learner with the same sleep, so both measurements share the CPU
the same way. Half of the alone time runs before the swarm and half after; throughput is the unit's tokens
per second (all ranks' tokens) in the swarm over alone.

    python bench/unit.py             # ~2.5 min on two CPU cores (50 s measured after 10 s warm-up)
    python bench/unit.py --quick     # smoke run, ~1.5 min (16 s measured)
    python bench/unit.py --json

On a GPU machine the same command runs the unit on NCCL (one GPU per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from swarm import TARGET_THROUGHPUT, _snapshot, log  # noqa: E402  (the sibling benchmark's helpers)

from node.launcher import start_node, stop_all, wait_ready  # noqa: E402


# ------------------------------------------------------------------------------------------- alone workers
def _rank_main(rank: int, world: int, port: int, seconds: float, warm_s: float, out: str, batch: int) -> None:
    import torch

    from node.config import NodeSettings
    from node.learner import InnerConfig, Learner
    from node.task import TaskConfig, load_task
    from node.unit import Unit
    from protocol.config import ProtocolConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    unit = Unit(rank=rank, world=world, local_rank=rank, timeout_s=300)
    unit.init()
    task = load_task(None, TaskConfig(batch_size=batch))
    lrn = Learner(
        "alone", task, ProtocolConfig(), InnerConfig(), NodeSettings().steps, 1 + rank, unit.device()
    )
    lrn.attach_unit(unit)
    t_warm = time.perf_counter() + warm_s
    while time.perf_counter() < t_warm:
        lrn.train_step()
    # every rank must run the same number of steps (DDP): rank 0 decides when the time is up
    import torch.distributed as dist

    steps, t0 = 0, time.perf_counter()
    go = torch.ones(1, dtype=torch.int64, device=unit.device())
    while True:
        go.fill_(int(time.perf_counter() - t0 < seconds))
        dist.broadcast(go, 0)
        if not go.item():
            break
        lrn.train_step()
        steps += 1
    elapsed = time.perf_counter() - t0
    unit.close()
    if rank == 0:
        tokens = steps * lrn.tokens_per_step
        with open(out, "w") as fh:
            json.dump(
                {"steps": steps, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}, fh
            )


def alone_unit(world: int, seconds: float, warm_s: float, batch: int) -> int:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(_rank_main, args=(world, port, seconds, warm_s, out, batch), nprocs=world, join=True)
        print(Path(out).read_text())
    return 0


def alone_single(seconds: float, warm_s: float, delay: float, batch: int) -> int:
    import torch

    from node.config import NodeSettings
    from node.learner import InnerConfig, Learner
    from node.task import TaskConfig, load_task
    from protocol.config import ProtocolConfig

    torch.set_num_threads(1)
    task = load_task(None, TaskConfig(batch_size=batch))
    lrn = Learner("slow", task, ProtocolConfig(), InnerConfig(), NodeSettings().steps, 9, torch.device("cpu"))
    t0 = time.perf_counter()
    steps = 0
    while time.perf_counter() - t0 < seconds + warm_s:
        lrn.train_step()
        steps += 1
        time.sleep(delay)
    print(json.dumps({"steps": steps}))
    return 0


def run_alone(a: argparse.Namespace, seconds: float, label: str) -> dict:
    log(
        f"[alone {label}] {a.nproc}-process unit + slow learner side by side, {a.warm:g} s warm-up + {seconds:g} s"
    )
    me = [
        sys.executable,
        os.path.abspath(__file__),
        "--warm",
        str(min(3.0, a.warm)),
        "--batch-size",
        str(a.batch_size),
    ]
    unit = subprocess.Popen(
        [*me, "--alone", "unit", "--nproc", str(a.nproc), "--duration", str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    slow = subprocess.Popen(
        [*me, "--alone", "single", "--slow-delay", str(a.slow_delay), "--duration", str(seconds)],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        out, _ = unit.communicate(timeout=seconds + 300)
        slow.wait(timeout=seconds + 60)
        if unit.returncode != 0:
            raise RuntimeError(f"alone unit exited with code {unit.returncode}")
        r = json.loads(out.strip().splitlines()[-1])
        log(f"[alone {label}] unit tokens/s {r['tokens_per_s']:.0f}")
        return r
    finally:
        for p in (unit, slow):
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


# --------------------------------------------------------------------------------------------- the swarm
def run_swarm(a: argparse.Namespace, run_dir: Path) -> dict:
    flags = ["--threads", "1", "--swarm", f"bench-unit-{os.getpid()}", "--batch-size", str(a.batch_size)]
    children = []
    try:
        children.append(start_node(0, run_dir, [*flags, "--nproc", str(a.nproc)], []))
        wait_ready(children, 240)
        children.append(
            start_node(1, run_dir, [*flags, "--step-delay-s", str(a.slow_delay)], children[0].maddrs)
        )
        wait_ready(children, 240)
        log(f"[swarm] up; warming up {a.warm:g} s")
        time.sleep(a.warm)
        s0, t0 = _snapshot(children), time.monotonic()
        log(f"[swarm] measuring {a.duration:g} s")
        time.sleep(a.duration)
        s1, t1 = _snapshot(children), time.monotonic()
        dt = s1[0]["uptime_s"] - s0[0]["uptime_s"]
        u0, u1 = s0[0]["learner"], s1[0]["learner"]
        return {
            "tokens_per_s": (u1["tokens"] - u0["tokens"]) / dt,
            "steps": u1["steps"] - u0["steps"],
            "tokens_per_step": u1["tokens_per_step"],
            "slow_steps": s1[1]["learner"]["steps"] - s0[1]["learner"]["steps"],
            "unit": u1["unit"],
            "cpu_cores_unit_tree": (s1[0]["cpu_tree_s"] - s0[0]["cpu_tree_s"]) / dt,
            "seconds": t1 - t0,
            "rounds_merged": s1[0]["rounds_merged"],
            "equal_hash_at_end": s1[0]["model_hash"] == s1[1]["model_hash"],
        }
    finally:
        log("[swarm] stopping nodes")
        stop_all(children, timeout_s=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="processes in node 0's learner unit")
    ap.add_argument("--slow-delay", type=float, default=0.5, help="node 1's sleep after each step (s)")
    ap.add_argument("--duration", type=float, default=50.0, help="measured seconds in the swarm")
    ap.add_argument("--warm", type=float, default=10.0, help="warm-up seconds before measuring")
    ap.add_argument("--quick", action="store_true", help="short run: 16 s measured, 5 s warm-up")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per inner step per rank")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--alone", choices=("unit", "single"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.alone == "unit":
        return alone_unit(a.nproc, a.duration, a.warm, a.batch_size)
    if a.alone == "single":
        return alone_single(a.duration, a.warm, a.slow_delay, a.batch_size)
    if a.quick:
        a.duration, a.warm = 16.0, 5.0
    t_start = time.monotonic()
    before = run_alone(a, a.duration / 2, "before")
    run_dir = Path(tempfile.mkdtemp(prefix="ddiloco-bench-unit-"))
    try:
        sw = run_swarm(a, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    after = run_alone(a, a.duration / 2, "after")
    alone = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
    ratio = sw["tokens_per_s"] / alone
    res = {
        "settings": {
            "nproc": a.nproc,
            "slow_delay_s": a.slow_delay,
            "duration_s": a.duration,
            "warm_s": a.warm,
        },
        "alone": [before, after],
        "swarm": sw,
        "ratio": ratio,
        "target": TARGET_THROUGHPUT,
        "wall_s": time.monotonic() - t_start,
    }
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    print(
        f"{a.nproc}-process learner unit (DDP, gloo, one torch thread per rank, batch {a.batch_size} per rank) + a "
        f"slow node ({a.slow_delay:g} s sleep/step)"
    )
    print(f"alone, before swarm : {before['tokens_per_s']:.0f} tokens/s")
    print(f"alone, after swarm  : {after['tokens_per_s']:.0f} tokens/s")
    print(
        f"in the swarm        : {sw['tokens_per_s']:.0f} tokens/s ({sw['steps']} steps of {sw['tokens_per_step']} "
        f"tokens; slow node {sw['slow_steps']} steps; unit tree {sw['cpu_cores_unit_tree']:.2f} cores)"
    )
    print(f"unit digest checks  : {sw['unit']['checks']}, mismatches {sw['unit']['mismatches']}")
    ok = ratio >= TARGET_THROUGHPUT
    print(
        f"  [{'HOLDS ' if ok else 'MISSED'}] unit throughput swarm / alone {ratio:.3f} (target >= {TARGET_THROUGHPUT})"
    )
    print(f"wall time: {res['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
