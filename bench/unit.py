"""Learner-unit benchmark: a 2-process unit's throughput inside a swarm against the same unit alone.

The swarm has two nodes of different speeds: node 0 is a learner unit of ``--nproc`` processes
(``ddiloco node --nproc N``: torchrun, DDP over gloo on CPU, one torch thread per rank; with ``--shard``,
FSDP2 shards instead of DDP replicas), node 1 a single learner that sleeps ``--slow-delay`` seconds after
each step (a slower chip). Alone, the same two run side by side without any network: the unit as a plain
loop of ``Learner.train_step`` over the same kind of group (``--nproc`` spawned ranks, DDP or FSDP2), and
the single learner with the same sleep, so both measurements share the CPU the same way. Half of the alone
time runs before the swarm and half after; throughput is the unit's tokens per second (all ranks' tokens)
in the swarm over alone. In the swarm the unit also gathers and encodes each due fragment (sharded: an
all-gather of the fragment per step) and broadcasts adopted ones; alone it only trains, so the ratio
includes that cost.

    python bench/unit.py             # ~2.5 min on two CPU cores (50 s measured after 10 s warm-up)
    python bench/unit.py --shard     # the same with an FSDP2 unit
    python bench/unit.py --quick     # smoke run, ~1.5 min (16 s measured)
    python bench/unit.py --json

GPUs: ``--device cuda`` runs every rank and the slow node on GPUs (NCCL, one GPU per rank, bf16 autocast,
fragment snapshots copied to the host on a side stream) and refuses to start without them; pick a model
that keeps a GPU busy, e.g. ``python bench/unit.py --device cuda --nproc 8 --shard --dim 2048 --layers 24
--seq-len 1024 --batch-size 8``. This mode has not been run by the authors (no GPU where it was written).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from swarm import TARGET_THROUGHPUT, _snapshot, log  # noqa: E402  (the sibling benchmark's helpers)

from node.learner.model import ModelConfig  # noqa: E402
from node.local.launcher import start_node, stop_all, wait_ready  # noqa: E402


def _task_config(a: argparse.Namespace):
    from node.learner.model import ModelConfig
    from node.learner.task import TaskConfig

    return TaskConfig(
        batch_size=a.batch_size, model=ModelConfig(dim=a.dim, layers=a.layers, seq_len=a.seq_len)
    )


def _model_flags(a: argparse.Namespace) -> list[str]:
    return ["--batch-size", str(a.batch_size), "--dim", str(a.dim), "--layers", str(a.layers)] + [
        "--seq-len",
        str(a.seq_len),
    ]


# ------------------------------------------------------------------------------------------- alone workers
def _rank_main(rank: int, a: argparse.Namespace, init_file: str, out: str) -> None:
    import torch

    from node.learner.learner import InnerConfig, Learner
    from node.learner.task import load_task
    from node.learner.unit import STATE, Unit
    from node.learner.unit_fsdp import ShardedUnit
    from node.swarm.settings import NodeSettings
    from protocol.config import ProtocolConfig

    torch.set_num_threads(1)
    world, seconds, warm_s = a.nproc, a.duration, a.warm
    cls = ShardedUnit if a.shard else Unit
    unit = cls(rank=rank, world=world, local_rank=rank, timeout_s=300, init_method=f"file://{init_file}")
    unit.init()
    task = load_task(None, _task_config(a))
    lrn = Learner(
        "alone", task, ProtocolConfig(), InnerConfig(), NodeSettings().steps, 1 + rank, unit.model_device()
    )
    lrn.attach_unit(unit)
    unit.exchange(lrn, STATE)  # rank 0's model and optimizer on every rank, as a node's unit starts
    # Every rank must run the same number of steps (their collectives pair up): rank 0 decides, for the
    # warm-up as for the measured window, and broadcasts its decision before each step.
    import torch.distributed as dist

    go = torch.ones(1, dtype=torch.int64, device=unit.device())

    def steps_for(limit_s: float) -> tuple[int, float]:
        n, t0 = 0, time.perf_counter()
        while True:
            go.fill_(int(time.perf_counter() - t0 < limit_s))
            dist.broadcast(go, 0)
            if not go.item():
                return n, time.perf_counter() - t0
            lrn.train_step()
            n += 1

    steps_for(warm_s)
    steps, elapsed = steps_for(seconds)
    unit.close(lrn)
    if rank == 0:
        tokens = steps * lrn.tokens_per_step
        with open(out, "w") as fh:
            json.dump(
                {"steps": steps, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}, fh
            )


def alone_unit(a: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        mp.spawn(_rank_main, args=(a, os.path.join(d, "rendezvous"), out), nprocs=a.nproc, join=True)
        print(Path(out).read_text())
    return 0


def alone_single(a: argparse.Namespace) -> int:
    import torch

    from node.learner.learner import InnerConfig, Learner, default_device
    from node.learner.task import load_task
    from node.swarm.settings import NodeSettings
    from protocol.config import ProtocolConfig

    torch.set_num_threads(1)
    seconds, warm_s, delay = a.duration, a.warm, a.slow_delay
    task = load_task(None, _task_config(a))
    lrn = Learner("slow", task, ProtocolConfig(), InnerConfig(), NodeSettings().steps, 9, default_device())
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
    me = [sys.executable, os.path.abspath(__file__), "--warm", str(min(3.0, a.warm)), *_model_flags(a)]
    me += ["--device", a.device, *(["--shard"] if a.shard else [])]
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
    flags = ["--threads", "1", "--swarm", f"bench-unit-{os.getpid()}", *_model_flags(a)]
    unit_flags = ["--nproc", str(a.nproc), *(["--shard"] if a.shard else [])]
    children = []
    try:
        children.append(start_node(0, run_dir, [*flags, *unit_flags], []))
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
    ap.add_argument("--shard", action="store_true", help="node 0's unit shards with FSDP2 instead of DDP")
    ap.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda: every rank on its own GPU (refused without GPUs); cpu: GPUs hidden; auto: GPUs if any",
    )
    ap.add_argument("--dim", type=int, default=ModelConfig.dim, help="model width")
    ap.add_argument("--layers", type=int, default=ModelConfig.layers, help="transformer blocks")
    ap.add_argument("--seq-len", type=int, default=ModelConfig.seq_len, help="context length")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--alone", choices=("unit", "single"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # for this process and every process it starts
    if a.device == "cuda":
        import torch

        if torch.cuda.device_count() < a.nproc:
            ap.error(
                f"--device cuda needs {a.nproc} GPUs (one per rank); this machine has {torch.cuda.device_count()}"
            )
    if a.alone == "unit":
        return alone_unit(a)
    if a.alone == "single":
        return alone_single(a)
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
            "shard": a.shard,
            "device": a.device,
            "model": {"dim": a.dim, "layers": a.layers, "seq_len": a.seq_len},
            "batch_size": a.batch_size,
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
    kind = "FSDP2" if a.shard else "DDP"
    print(
        f"{a.nproc}-process learner unit ({kind}, {sw['unit']['backend']}, one torch thread per rank, batch "
        f"{a.batch_size} per rank) + a slow node ({a.slow_delay:g} s sleep/step)"
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
