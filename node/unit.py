"""A learner unit that spans processes: torch.distributed inside one node (issue 6).

Inside a node the learner is an ordinary data-parallel job: every rank holds the whole model, trains on its
own batches, and DDP averages the gradients (gloo on CPU, NCCL on GPUs), so all ranks keep identical
parameters. Across nodes, only rank 0 speaks: it runs the agent (DHT, transport, synchroniser) and the
learner thread that contributes fragments and adopts merged ones.

Rank 0 leads every step with one small control broadcast, so the other ranks never decide anything:

    [op, step, check_all, n, p_1 .. p_n]      op: STATE | STEP | PAUSE | STOP

followed by the tensors of the fragments p_1..p_n that rank 0 adopted since the last step (rank 0's values,
broadcast). Every rank then digests the parameters of those fragments (all fragments when ``check_all``)
and the digests are gathered on rank 0; a rank that differs is counted and logged, and its fragments are
sent again with the next step, so a mismatch is repaired, never ignored. ``STATE`` carries the whole
model, the inner optimizer's state and the lr-schedule step (at the start, after a join or a restore).
Followers wait on the control broadcast, so a paused node keeps them idle with ``PAUSE`` every 50 ms and
no collective outlives its deadline.

Launch: ``torchrun --nproc-per-node N -m node node ...`` or ``ddiloco node --nproc N`` (which runs torchrun).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

STATE, STEP, PAUSE, STOP = 0, 1, 2, 3
_OPS = {STATE: "state", STEP: "step", PAUSE: "pause", STOP: "stop"}


@dataclass
class Unit:
    rank: int
    world: int
    local_rank: int
    timeout_s: float = 600.0
    backend: str = ""
    checks: int = 0  # digest comparisons made on rank 0
    mismatches: int = 0  # ranks found to differ (each repaired by a re-broadcast)
    _repair: set[int] = field(default_factory=set)

    @classmethod
    def from_env(cls, timeout_s: float = 600.0) -> Unit | None:
        """The unit torchrun describes in the environment, or None for a single-process learner."""
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return None
        for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(k):
                raise RuntimeError(f"WORLD_SIZE={world} but {k} is not set: start the node with torchrun")
        rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        return cls(rank=rank, world=world, local_rank=local, timeout_s=timeout_s)

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    def init(self) -> None:
        """Join the unit's process group (rank 0 calls this after forking its DHT process)."""
        dev = self.device()
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        self.backend = backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, rank=self.rank, world_size=self.world, timeout=timedelta(seconds=self.timeout_s)
        )
        logger.info("rank %d/%d joined the unit's %s group", self.rank, self.world, backend)

    def close(self, learner=None) -> None:
        """Leave the group. The learner's DDP wrapper goes first: destroyed after its process group, DDP's
        reducer can block for good in its destructor (seen under heavy CPU load), and the rank never exits."""
        if learner is not None and learner.forward_model is not learner.model:
            learner.forward_model = learner.model
            gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        dev = self.device()
        return DistributedDataParallel(model, device_ids=[dev] if dev.type == "cuda" else None)

    # ------------------------------------------------------------------ one step's exchange
    def _ctrl(self, learner, op: int, frags: list[int], check_all: bool) -> tuple[int, int, bool, list[int]]:
        P = len(learner.plan.fragments)
        t = torch.zeros(4 + P, dtype=torch.int64, device=self.device())
        if self.lead:
            t[0], t[1], t[2], t[3] = op, learner.steps, int(check_all), len(frags)
            if frags:
                t[4 : 4 + len(frags)] = torch.tensor(frags, dtype=torch.int64)
        dist.broadcast(t, 0)
        v = t.tolist()
        return v[0], v[1], bool(v[2]), v[4 : 4 + v[3]]

    def exchange(self, learner, op: int, adopted: list[int] = (), check_all: bool = False) -> int:
        """Rank 0: lead one exchange. Other ranks: follow one (arguments ignored). Returns the op."""
        frags = sorted(set(adopted) | self._repair) if self.lead else []
        self._repair = set()
        op, step, check_all, frags = self._ctrl(learner, op, frags, check_all)
        with torch.no_grad():
            for p in frags:
                for n in learner.plan.fragments[p].names:
                    dist.broadcast(learner.params[n].data, 0)
        if op == STATE:
            self._state(learner)
        learner.steps = step
        whole = check_all or op in (STATE, STOP)
        checked = list(range(len(learner.plan.fragments))) if whole else frags
        if checked:
            self._check(learner, checked)
        return op

    def _state(self, learner) -> None:
        with torch.no_grad():
            for p in learner.params.values():
                dist.broadcast(p.data, 0)
        box = [(learner.opt.state_dict(), learner.seed) if self.lead else None]
        dist.broadcast_object_list(box, 0, device=self.device())
        if not self.lead:
            opt_state, seed = box[0]
            learner.load_optimizer(opt_state)
            learner.gen.manual_seed(seed + 1_000_003 * self.rank)  # each rank its own batches

    def _digest(self, learner, frags: list[int]) -> torch.Tensor:
        h = hashlib.blake2b(digest_size=16)
        for p in frags:
            for n in learner.plan.fragments[p].names:
                t = learner.params[n].detach().to("cpu").contiguous()
                if t.dtype == torch.bfloat16:
                    t = t.view(torch.int16)
                h.update(t.numpy().tobytes())
        return torch.frombuffer(bytearray(h.digest()), dtype=torch.int64).to(self.device())

    def _check(self, learner, frags: list[int]) -> None:
        mine = self._digest(learner, frags)
        got = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(got, mine)
        if not self.lead:
            return
        self.checks += 1
        bad = [r for r, d in enumerate(got) if not torch.equal(d, got[0])]
        if bad:
            self.mismatches += len(bad)
            self._repair |= set(frags)
            logger.error(
                "unit ranks %s hold other parameters than rank 0 for fragments %s; re-sending them",
                bad,
                frags if len(frags) <= 8 else f"{frags[:8]}...",
            )

    def status(self) -> dict:
        return {
            "world": self.world,
            "rank": self.rank,
            "backend": self.backend,
            "checks": self.checks,
            "mismatches": self.mismatches,
        }


def follow(learner, unit: Unit) -> int:
    """The loop of a rank > 0: do what rank 0's control says until it says stop."""
    steps = 0
    while True:
        op = unit.exchange(learner, PAUSE)
        if op == STOP:
            break
        if op == STEP:
            learner.train_step()
            steps += 1
    logger.info("rank %d stops after %d steps", unit.rank, steps)
    return 0


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this rank when its launcher (torchrun's agent) dies, e.g. when the
    node's process group is killed: a rank holds no state of its own, and must not outlive its node."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        logger.debug("no PR_SET_PDEATHSIG here; this rank exits when rank 0's collectives fail")


def run_rank(cfg, unit: Unit) -> int:
    """A rank > 0 of a node's learner unit: the learner only (no DHT, no state folder), led by rank 0.

    It ignores SIGINT and SIGTERM: rank 0 stops it with its last control message after its own clean
    shutdown, and if rank 0 dies the unit's collectives fail and this process exits."""
    import signal

    from node.learner import Learner
    from node.task import load_task

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()
    s = cfg.node
    if s.threads > 0:
        torch.set_num_threads(s.threads)
    task = load_task(None, cfg.task_config())
    learner = Learner(
        f"rank{unit.rank}", task, cfg.protocol, cfg.inner, s.steps, seed=0, device=unit.device()
    )
    unit.init()
    try:
        learner.attach_unit(unit)
        return follow(learner, unit)
    finally:
        unit.close(learner)
