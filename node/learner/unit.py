"""A learner unit that spans processes: torch.distributed inside one node.

Inside a node the learner is an ordinary data-parallel job: every rank holds the whole model, trains on its
own batches, and DDP averages the gradients (gloo on CPU, NCCL on GPUs), so all ranks keep identical
parameters. Across nodes, only rank 0 speaks: it runs the agent (DHT, transport, synchroniser) and the
learner thread that contributes fragments and adopts merged ones.

Rank 0 leads every step with one small control broadcast, so the other ranks never decide anything:

    [op, step, schedule_step, check_all, save, n, m, p_1 .. p_n, d_1 .. d_m]   op: STATE | STEP | PAUSE | STOP

followed by the tensors of the fragments p_1..p_n that rank 0 adopted since the last step (rank 0's values,
broadcast). Every rank then digests the parameters of those fragments (all fragments when ``check_all``)
and the digests are gathered on rank 0; a rank that differs is counted and logged, and its fragments are
sent again with the next step, so a mismatch is repaired, never ignored. ``STATE`` carries the whole
model, the inner optimizer's state and the lr-schedule step (at the start, after a join or a restore).
``schedule_step`` keeps every rank's fragment schedule on rank 0's, and d_1..d_m are the fragments rank 0
takes after this step (due on the swarm's schedule, which only rank 0 reads), so every rank joins the
same gathers; ``save`` asks every rank to join the gather of a checkpoint (sharded units only).
Followers wait on the control broadcast, so a paused node keeps them idle with ``PAUSE`` every 50 ms and
no collective outlives its deadline. ``node.learner.unit_fsdp.ShardedUnit`` is the same exchange over FSDP2 shards.

Launch: ``torchrun --nproc-per-node N -m node node ...`` or ``ddiloco node --nproc N`` (which runs torchrun).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist

from node.common.lifetime import die_with_parent

logger = logging.getLogger(__name__)

STATE, STEP, PAUSE, STOP = 0, 1, 2, 3
_OPS = {STATE: "state", STEP: "step", PAUSE: "pause", STOP: "stop"}


def digest(tensors) -> torch.Tensor:
    """16-byte blake2b of the tensors' bytes, in order, as two int64s (what the ranks gather)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        h.update(t.numpy().tobytes())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.int64)


@dataclass
class Unit:
    """A data-parallel (DDP) unit: every rank holds the whole model."""

    rank: int
    world: int
    local_rank: int
    timeout_s: float = 600.0
    init_method: str | None = None  # torch.distributed rendezvous; None: torchrun's env:// (MASTER_ADDR/PORT)
    backend: str = ""
    checks: int = 0  # digest comparisons made on rank 0
    mismatches: int = 0  # ranks found to differ (each repaired by a re-broadcast)
    _repair: set[int] = field(default_factory=set)
    due_next: list[int] = field(default_factory=list)  # fragments taken after the step under way
    mode: ClassVar[str] = "ddp"

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

    def model_device(self) -> torch.device:
        """Where the learner builds its model before ``attach`` (a sharded unit builds it on the CPU)."""
        return self.device()

    def init(self) -> None:
        """Join the unit's process group (rank 0 calls this after forking its DHT process)."""
        dev = self.device()
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        self.backend = backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=self.init_method,
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=self.timeout_s),
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

    def attach(self, learner) -> None:
        learner.forward_model = self.wrap(learner.model)

    def after_step(self, learner, due: list[int]) -> None:
        """A rank > 0, after each step: its part in taking the fragments due (nothing: rank 0 holds them)."""

    # ------------------------------------------------------------------ one step's exchange
    def _ctrl(self, learner, op: int, frags: list[int], check_all: bool, save: bool, due: list[int]) -> tuple:
        P = len(learner.plan.fragments)
        t = torch.zeros(7 + 3 * P, dtype=torch.int64, device=self.device())
        if self.lead:
            head = [op, learner.steps, learner.book.step, check_all, save, len(frags), len(due)]
            t[: 7 + len(frags) + len(due)] = torch.tensor(head + list(frags) + list(due), dtype=torch.int64)
        dist.broadcast(t, 0)
        v = t.tolist()
        n, m = v[5], v[6]
        return v[0], v[1], v[2], bool(v[3]), bool(v[4]), v[7 : 7 + n], v[7 + n : 7 + n + m]

    def exchange(
        self,
        learner,
        op: int,
        adopted: list[int] = (),
        check_all: bool = False,
        save: bool = False,
        due: list[int] = (),
    ) -> int:
        """Rank 0: lead one exchange. Other ranks: follow one (arguments ignored). Returns the op. ``due``:
        the fragments rank 0 takes after the step this exchange starts (``due_next`` on every rank)."""
        frags = sorted(set(adopted) | self._repair) if self.lead else []
        self._repair = set()
        P = len(learner.plan.fragments)
        # a fragment whose adoption carried the unit's progress travels as p + P: every rank then knows to
        # join the gather of its old values (``ShardedUnit._send``)
        frags = [p + P if learner.shift.get(p) else p for p in frags]
        op, step, schedule_step, check_all, save, frags, self.due_next = self._ctrl(
            learner, op, frags, check_all, save, list(due) if self.lead else []
        )
        carried = {p - P for p in frags if p >= P}
        frags = [p % P for p in frags]
        self._send(learner, frags, set(adopted) if self.lead else set(), carried)
        if op == STATE:
            self._state(learner)
        learner.steps = step
        learner.book.step = schedule_step
        checked = self._to_check(learner, op, frags, check_all)
        if checked:
            self._check(learner, checked)
        if save:
            self._save(learner)
        if op == STOP:
            self._stop(learner)
        return op

    def _send(self, learner, frags: list[int], fresh: set[int], carried: set[int]) -> None:
        """Rank 0's values of ``frags`` to every rank (``fresh``: adopted since the last exchange;
        ``carried``: adopted by adding a change, see ``Learner.adopt``): rank 0 holds them whole."""
        with torch.no_grad():
            for p in frags:
                for n in learner.plan.fragments[p].names:
                    dist.broadcast(learner.tensor(n).data, 0)

    def _to_check(self, learner, op: int, frags: list[int], check_all: bool) -> list[int]:
        whole = check_all or op in (STATE, STOP)
        return list(range(len(learner.plan.fragments))) if whole else frags

    def _save(self, learner) -> None:
        """Every rank holds the whole model: rank 0's ``Learner.state()`` needs no help."""

    def _stop(self, learner) -> None:
        """Nothing to gather: rank 0 holds the whole model."""

    def _state(self, learner) -> None:
        with torch.no_grad():
            for p in learner.params.values():
                dist.broadcast(p.data, 0)
        box = [(learner.opt.state_dict(), learner.seed, learner.data_position()) if self.lead else None]
        dist.broadcast_object_list(box, 0, device=self.device())
        if not self.lead:
            opt_state, seed, position = box[0]
            learner.load_optimizer(opt_state)
            learner.gen.manual_seed(seed + 1_000_003 * self.rank)  # each rank its own batches
            learner.seed = seed
            learner.use_lane(self.rank, self.world, position)  # its own part of the data

    def _digest(self, learner, frags: list[int]) -> torch.Tensor:
        """This rank's digest of the parameters of ``frags``."""
        return digest(learner.tensor(n) for p in frags for n in learner.plan.fragments[p].names)

    def _expect(self, learner, frags: list[int], got: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rank 0: the digest each rank should have sent: rank 0's own, every rank holding the whole model."""
        return [got[0]] * self.world

    def _check(self, learner, frags: list[int]) -> None:
        mine = self._digest(learner, frags).to(self.device())
        got = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(got, mine)
        if not self.lead:
            return
        self.checks += 1
        want = self._expect(learner, frags, [g.cpu() for g in got])
        bad = [r for r, (d, w) in enumerate(zip(got, want)) if not torch.equal(d.cpu(), w)]
        if not bad:
            self._checked(frags)
            return
        self.mismatches += len(bad)
        self._repair |= set(frags)
        logger.error(
            "unit ranks %s hold other parameters than rank 0 sent for fragments %s; re-sending them",
            bad,
            frags if len(frags) <= 8 else f"{frags[:8]}...",
        )

    def _checked(self, frags: list[int]) -> None:
        """Rank 0: ``frags`` were found as they should be on every rank."""

    def status(self) -> dict:
        return {
            "world": self.world,
            "rank": self.rank,
            "mode": self.mode,
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
            unit.after_step(learner, unit.due_next)
            steps += 1
    logger.info("rank %d stops after %d steps", unit.rank, steps)
    return 0


def run_rank(cfg, unit: Unit) -> int:
    """A rank > 0 of a node's learner unit: the learner only (no DHT, no state folder), led by rank 0.

    It ignores SIGINT and SIGTERM: rank 0 stops it with its last control message after its own clean
    shutdown, and if rank 0 dies the unit's collectives fail and this process exits."""
    import signal

    from node.learner.learner import Learner
    from node.learner.task import load_task

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()  # again, in case this rank was started another way than ``python -m node``
    s = cfg.node
    if s.threads > 0:
        torch.set_num_threads(s.threads)
    task = load_task(None, cfg.task_config())
    from protocol.systems import system_protocol

    # the same protocol settings as rank 0's learner (the agent's): the same fragments, the same rules
    pcfg, _ = system_protocol(s.system, cfg.protocol, 1 << 16)
    learner = Learner(f"rank{unit.rank}", task, pcfg, cfg.inner, s.steps, seed=0, device=unit.model_device())
    unit.init()
    try:
        learner.attach_unit(unit)
        return follow(learner, unit)
    finally:
        unit.close(learner)
