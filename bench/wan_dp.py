"""The baselines of ``bench/wan.py`` that run in one gloo process group: one worker process per network
namespace, a real gloo process group across them, over the node's default learner. Data-parallel (DDP), and
synchronous DiLoCo as its authors run it (``--mode diloco``: an all-reduce of fp32 outer gradients).

Each worker is a ``node.learner.learner.Learner`` (the embedded task's model, AdamW, lr schedule, gradient clipping,
the same per-worker batch as a node) whose forward model is wrapped in ``DistributedDataParallel``, as a
multi-process learner unit's is (``node.learner.unit``): DDP's gradient buckets are all-reduced over gloo while the
backward pass runs, so every step's gradients cross the capped links. ``--grads bf16`` registers the
equivalent of DDP's ``bf16_compress_hook`` (gradients travel as bf16, half the bytes); ``fp32`` is DDP's
default.

``--mode diloco``: synchronous DiLoCo as the DiLoCo papers and OpenDiLoCo run it. Each worker takes
``--sync-every`` H inner steps alone (its own AdamW, kept across rounds), then the group all-reduces the outer
gradient (the global model less the worker's, fp32, one flat buffer: a ring of 2 (N-1)/N of the model's
bytes each way on every link), averages it, and every worker takes the same outer step (SGD, lr 0.7,
Nesterov momentum 0.9, no clipping) and starts again from the new global model. Workers wait for each
other only in that all-reduce. The model it evaluates is the global one, right after a round.

Rank 0 leads: it evaluates the model every ``--eval-every-s`` (the others wait in the next all-reduce, as
they would in any DP job), every ``--eval-every-steps`` and after each of ``--eval-at-steps``, and writes
``events.jsonl`` (``step`` and ``eval`` records in the nodes' shape, tokens counted over all workers).
When the harness creates ``STOP`` in the run folder, or once ``--stop-at-tokens`` are trained, rank 0
broadcasts the stop with the next step's control tensor, so every rank leaves the loop after the same
step and writes ``final-RANK.json`` (steps, model hash). Every collective runs under the process group's timeout, and a
worker dies with its launcher (``PR_SET_PDEATHSIG``).

The launcher side (``start_workers``, ``stop_workers``, ``run_reference``) is what ``bench/wan.py`` calls;
``run_reference`` is the uncapped run that gives DP's eval loss per token past the capped runs' few tokens.

    ip netns exec NS python bench/wan_dp.py --rank R --world N --master ADDR:PORT --run-dir DIR
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from node.common.events import read_events

GRADS = ("fp32", "bf16")
MODES = ("dp", "diloco")
REFERENCE_POINTS = 30  # evaluations on the reference run's step grid
DP_PORT = 29500  # rank 0's rendezvous, on node 0's address inside the lab


def bf16_allreduce_hook(state, bucket):
    """DDP's ``bf16_compress_hook`` (which refuses anything but NCCL): each gradient bucket is cast to bf16,
    divided by the world size, all-reduced, and cast back into the bucket."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    packed = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(packed, async_op=True).get_future()

    def unpack(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(unpack)


class OuterSync:
    """DiLoCo's round over the process group: the outer gradient (global less local), all-reduced in fp32 as
    one flat buffer and averaged; the outer SGD step with Nesterov momentum on the global model (torch's
    ``SGD(nesterov=True)``, as OpenDiLoCo takes it); the model set to the new global."""

    def __init__(self, model, lr: float, momentum: float, world: int) -> None:
        import torch
        import torch.distributed as dist

        self.params = [p for p in model.parameters()]
        with torch.no_grad():
            for p in self.params:  # rank 0's initial model, as DDP broadcasts it
                dist.broadcast(p.data, src=0)
        self.glob = [p.detach().clone() for p in self.params]
        for g in self.glob:
            g.grad = torch.zeros_like(g)
        self.opt = torch.optim.SGD(self.glob, lr=lr, momentum=momentum, nesterov=True)
        self.world = world
        self.rounds = 0

    def round(self) -> None:
        import torch
        import torch.distributed as dist

        with torch.no_grad():
            flat = torch.cat([(g - p.detach()).reshape(-1) for g, p in zip(self.glob, self.params)])
            dist.all_reduce(flat)  # the sum of the workers' outer gradients
            flat.div_(self.world)
            at = 0
            for g in self.glob:
                g.grad.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()
            self.opt.step()
            for g, p in zip(self.glob, self.params):
                p.copy_(g)
        self.rounds += 1


def worker(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from node.learner.learner import InnerConfig, Learner
    from node.learner.task import TaskConfig, evaluate, load_task
    from protocol.config import ProtocolConfig
    from protocol.hashing import tensors_hash

    torch.set_num_threads(1)
    run_dir = Path(a.run_dir)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}",
        rank=a.rank,
        world_size=a.world,
        timeout=timedelta(seconds=a.timeout_s),
    )
    task = load_task(None, TaskConfig(batch_size=a.batch_size))
    lrn = Learner(
        f"dp{a.rank}",
        task,
        ProtocolConfig(fragments=1),
        InnerConfig(),
        a.steps,
        seed=a.seed * 1000 + a.rank + 1,
        device=torch.device("cpu"),
    )
    if a.mode == "dp":
        ddp = DDP(lrn.model)  # broadcasts rank 0's parameters (all start from the task's one init anyway)
        if a.grads == "bf16":
            ddp.register_comm_hook(None, bf16_allreduce_hook)
        lrn.forward_model = ddp
        outer = None
    else:
        outer = OuterSync(lrn.model, a.outer_lr, a.outer_momentum, a.world)
    lrn.tokens_per_step = task.tokens_per_batch * a.world
    lead = a.rank == 0
    ev = open(run_dir / "events.jsonl", "a", encoding="utf-8") if lead else None

    def emit(kind: str, **rec) -> None:
        if ev is not None:
            ev.write(json.dumps({"kind": kind, **rec}) + "\n")
            ev.flush()

    def do_eval() -> float:
        loss = evaluate(task, lrn.model)
        emit("eval", t=time.time(), tokens=lrn.steps * lrn.tokens_per_step, loss=loss, step=lrn.steps)
        return loss

    if lead:
        do_eval()
        (run_dir / "ready.json").write_text(json.dumps({"t": time.time(), "world": a.world}))
    next_eval = time.monotonic() + a.eval_every_s
    at_steps = {int(x) for x in a.eval_at_steps.split(",") if x.strip()}
    ctrl = torch.zeros(1, dtype=torch.int64)
    while True:
        t0 = time.time()
        res = lrn.train_step()
        if outer is not None and lrn.steps % a.sync_every:
            emit("step", t0=t0, t1=time.time(), step=lrn.steps, tokens=res.tokens, loss=res.loss)
            continue  # DiLoCo: the group meets once every H steps, in the round's all-reduce
        if outer is not None:
            outer.round()  # the step's record spans the round: the time this worker waited for it
        t1 = time.time()
        emit("step", t0=t0, t1=t1, step=lrn.steps, tokens=res.tokens, loss=res.loss)
        if lead:
            on_grid = a.eval_every_steps > 0 and lrn.steps % a.eval_every_steps == 0
            if time.monotonic() >= next_eval or on_grid or lrn.steps in at_steps:
                do_eval()
                next_eval = time.monotonic() + a.eval_every_s
            done = a.stop_at_tokens > 0 and lrn.steps * lrn.tokens_per_step >= a.stop_at_tokens
            ctrl[0] = int(done or (run_dir / "STOP").exists())
        dist.broadcast(ctrl, src=0)  # one 8-byte message: every rank leaves after the same step
        if ctrl.item():
            break
    params = {k: v.detach() for k, v in lrn.model.named_parameters()}  # after a round: the global model
    doc = {
        "rank": a.rank,
        "steps": lrn.steps,
        "tokens": lrn.steps * lrn.tokens_per_step,
        "eval_loss": do_eval() if lead else None,
        "model_hash": tensors_hash(params),  # every rank's: DDP keeps them identical
        "grads": a.grads,
        "mode": a.mode,
        "rounds": outer.rounds if outer is not None else None,
        "world": a.world,
    }
    (run_dir / f"final-{a.rank}.json").write_text(json.dumps(doc, indent=1))
    if ev is not None:
        ev.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------ the launcher side
def start_workers(lab, run_dir: Path, port: int, grads: str, eval_every_s: float, batch: int, timeout_s: float,
                  steps: int, seed: int = 0, extra: list[str] | tuple[str, ...] = ()) -> list[subprocess.Popen]:  # fmt: skip
    """One worker per namespace of ``lab`` (``node.chaos.netns.NetLab``); rank 0 listens on node 0's address.
    ``extra``: more worker flags (the reference run's ``--stop-at-tokens`` and evaluation grid)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    procs = []
    for r in range(lab.nodes):
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(r)]
        cmd += ["--world", str(lab.nodes), "--master", f"{lab.addr(0)}:{port}", "--run-dir", str(run_dir)]
        cmd += ["--grads", grads, "--eval-every-s", str(eval_every_s), "--batch-size", str(batch)]
        cmd += ["--timeout-s", str(timeout_s), "--steps", str(steps), "--seed", str(seed), *extra]
        cmd = lab.command(r, cmd)
        with open(run_dir / f"worker-{r}.log", "ab") as fh:
            procs.append(
                subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=env)
            )
    return procs


def stop_workers(procs: list[subprocess.Popen], run_dir: Path, timeout_s: float) -> None:
    """Ask rank 0 to stop (the ``STOP`` file), wait up to ``timeout_s``, then kill whatever is left."""
    (run_dir / "STOP").touch()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        kill_workers(procs)


def kill_workers(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


def run_reference(
    cfg, grads: str, tokens: int, capped: list[dict], run_dir: Path, say: Callable[[str], None]
) -> dict:
    """DP's eval loss per token beyond what the capped runs reached: the same workers, model, data and seeds
    on uncapped links until ``tokens``, evaluated on a step grid and at every step the capped runs evaluated
    at. A DP step's arithmetic does not depend on the link (the same gradients, all-reduced in the same
    order), so where both evaluated after the same step the losses must agree; ``max_gap`` says how far
    they do."""
    from node.chaos.netns import NetLab
    from node.local.launcher import LaunchError

    tps = next((c["tokens_per_step"] for c in capped if c.get("tokens_per_step")), 0)
    if not tps:
        raise LaunchError("no capped DP run took a step: nothing to take a reference for")
    steps = -(-tokens // tps)
    at = sorted({st for c in capped for lr in c["learners"] for st, _ in lr.get("eval_steps", [])})
    grid = max(1, steps // REFERENCE_POINTS)
    extra = ["--stop-at-tokens", str(tokens), "--eval-every-steps", str(grid)]
    extra += ["--eval-at-steps", ",".join(map(str, at))]
    say(f"starting {cfg.nodes} DDP workers on uncapped links until {tokens:,} tokens ({steps} steps)")
    lab = NetLab(cfg.nodes, "", tag=f"r{os.getpid() % 10000}").open()
    ev_path = run_dir / "events.jsonl"
    procs: list[subprocess.Popen] = []
    try:
        procs = start_workers(
            lab, run_dir, DP_PORT, grads, 1e9, cfg.batch_size, cfg.gloo_timeout_s, cfg.steps, cfg.seed, extra
        )
        deadline = time.monotonic() + cfg.start_timeout_s + steps * 10.0
        last_note = time.monotonic()
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise LaunchError(f"the DP reference run did not reach {tokens:,} tokens in time")
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                tail = (run_dir / f"worker-{bad[0]}.log").read_text(errors="replace").splitlines()[-15:]
                raise LaunchError(f"DP reference worker {bad[0]} failed; its log:\n" + "\n".join(tail))
            if time.monotonic() - last_note >= 15:
                done = sum(1 for r in read_events(ev_path) if r["kind"] == "step")
                say(f"reference  steps {done}/{steps}")
                last_note = time.monotonic()
            time.sleep(1.0)
    finally:
        kill_workers(procs)
        lab.close()
    ev = [r for r in read_events(ev_path) if r["kind"] == "eval"]
    by_step = {r["step"]: r["loss"] for r in ev}
    gaps = [abs(loss - by_step[st]) for c in capped for lr in c["learners"]
            for st, loss in lr.get("eval_steps", []) if st in by_step]  # fmt: skip
    return {
        "curve": sorted({(r["tokens"], r["loss"]) for r in ev}),
        "tokens_total": max((r["tokens"] for r in ev), default=0),
        "compared_evals": len(gaps),
        "max_gap": max(gaps, default=None),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="ADDR:PORT of rank 0's rendezvous")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--grads", choices=GRADS, default="fp32", help="gradients on the wire (dp)")
    ap.add_argument("--mode", choices=MODES, default="dp", help="data-parallel, or synchronous DiLoCo")
    ap.add_argument("--sync-every", type=int, default=24, help="H: inner steps between rounds (diloco)")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD learning rate (diloco)")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum (diloco)")
    ap.add_argument("--eval-every-s", type=float, default=10.0)
    ap.add_argument("--eval-every-steps", type=int, default=0, help="also evaluate every N steps (0: off)")
    ap.add_argument("--eval-at-steps", default="", help="also evaluate after these steps (comma-separated)")
    ap.add_argument("--stop-at-tokens", type=int, default=0, help="stop once this many tokens are trained")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step per worker")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="process group (and collective) timeout")
    ap.add_argument("--steps", type=int, default=5000, help="steps the lr schedule spans (a node's --steps)")
    ap.add_argument("--seed", type=int, default=0, help="data seed base (rank r draws with seed*1000+r+1)")
    a = ap.parse_args(argv)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher
    if os.getppid() == 1:
        return 1  # the launcher was already gone
    return worker(a)


if __name__ == "__main__":
    sys.exit(main())
