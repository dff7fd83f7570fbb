"""A learner: one model training on its own data with its own AdamW, never waiting on peers (DESIGN §1).

The learner owns its parameters, its inner optimizer and ``LearnerBook`` counters. It hands out fragment
contributions (outer gradient against the global fragment it last received, encoded by the wire codec) and
adopts merged global fragments when they arrive. Transport, clock and scheduling belong to whoever drives it:
the in-process runner or a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from node.task import Task
from protocol.codecs import Encoded, encode_tensors
from protocol.config import ProtocolConfig
from protocol.errors import ConfigError
from protocol.fragments import FragmentPlan, plan_fragments
from protocol.learner_book import LearnerBook
from protocol.merge import adopt


@dataclass(frozen=True)
class InnerConfig:
    lr: float = field(default=3e-3, metadata={"help": "peak AdamW learning rate"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay"})
    warmup_frac: float = field(default=0.05, metadata={"help": "share of steps spent warming up"})
    min_lr_frac: float = field(default=0.1, metadata={"help": "cosine floor as a share of the peak lr"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip gradient norm (0 disables)"})

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr} is invalid: must be > 0")
        if not 0 <= self.warmup_frac < 1:
            raise ConfigError(f"warmup_frac={self.warmup_frac} is invalid: must be in [0, 1)")


def lr_lambda(total_steps: int, inner: InnerConfig):
    warm = max(1, int(total_steps * inner.warmup_frac))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        prog = min(1.0, (step - warm) / max(1, total_steps - warm))
        return inner.min_lr_frac + (1 - inner.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog))

    return f


def plan_for(task: Task, model: torch.nn.Module, pcfg: ProtocolConfig) -> FragmentPlan:
    shapes = {n: p.numel() for n, p in model.named_parameters()}
    return plan_fragments(shapes, pcfg.fragments, pcfg.sync_every, embedding=task.embedding)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class StepResult:
    loss: float
    tokens: int
    due: list[int]


class Learner:
    def __init__(
        self,
        name: str,
        task: Task,
        pcfg: ProtocolConfig,
        inner: InnerConfig,
        total_steps: int,
        seed: int,
        device: torch.device | None = None,
        plan: FragmentPlan | None = None,
    ) -> None:
        self.name = name
        self.task = task
        self.pcfg = pcfg
        self.inner = inner
        self.device = device or default_device()
        self.model = task.new_model().to(self.device)
        self.params = dict(self.model.named_parameters())
        self.plan = plan or plan_for(task, self.model, pcfg)
        self.total_steps = total_steps
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)
        self.forward_model: torch.nn.Module = self.model  # a DDP wrapper when the learner spans processes
        self.tokens_per_step = task.tokens_per_batch  # the whole unit's tokens in one inner step
        self.book = LearnerBook(self.plan)
        self.steps = 0  # inner steps over the learner's life; drives the lr schedule, survives rejoins
        self._lr = lr_lambda(total_steps, inner)
        self._new_optimizer()
        # The global fragment last received, per fragment: contributions are measured against it.
        self.base = [self._fragment_fp32(f.index) for f in self.plan.fragments]
        self.last_loss = float("nan")

    def attach_unit(self, unit) -> None:
        """Span a ``node.unit.Unit``: gradients averaged over its ranks, steps count the unit's tokens."""
        self.forward_model = unit.wrap(self.model)
        self.tokens_per_step = self.task.tokens_per_batch * unit.world

    def load_optimizer(self, state: dict) -> None:
        self._new_optimizer()
        self.opt.load_state_dict(state)

    def _new_optimizer(self) -> None:
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=self.inner.lr, betas=(0.9, 0.95), weight_decay=self.inner.weight_decay
        )

    def _fragment_fp32(self, p: int) -> dict[str, torch.Tensor]:
        return {n: self.params[n].detach().to(torch.float32).clone() for n in self.plan.fragments[p].names}

    def train_step(self) -> StepResult:
        batch = self.task.batch(self.gen)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.task.loss(self.forward_model, batch)
        for g in self.opt.param_groups:
            g["lr"] = self.inner.lr * self._lr(self.steps)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
        self.opt.step()
        self.steps += 1
        self.last_loss = loss.item()
        due = self.book.on_step(self.tokens_per_step)
        return StepResult(self.last_loss, self.tokens_per_step, due)

    def outer_gradient(self, p: int) -> dict[str, torch.Tensor]:
        """base - theta for fragment p, fp32 on the CPU."""
        base = self.base[p]
        return {n: (base[n] - self.params[n].detach().to("cpu", torch.float32)) for n in base}

    def contribution(self, p: int) -> dict[str, Encoded]:
        return encode_tensors(self.outer_gradient(p), self.pcfg.codec, self.pcfg.codec_block)

    def adopt(self, p: int, round_: int, theta: dict[str, torch.Tensor]) -> bool:
        """Adopt merged global fragment p of ``round_``; False if it is older than what we hold."""
        if not self.book.on_receive(p, round_):
            return False
        with torch.no_grad():
            for n, g in theta.items():
                self.params[n].copy_(adopt(self.params[n].detach(), g.to(self.device), self.pcfg.alpha))
        self.base[p] = {n: g.detach().to("cpu", torch.float32).clone() for n, g in theta.items()}
        return True

    def join(self, rounds: list[int], thetas: list[dict[str, torch.Tensor]], schedule_step: int = 0) -> None:
        """(Re)join: take the whole global model, start fresh counters and a fresh inner optimizer.

        ``schedule_step`` puts the learner's fragment schedule in phase with the swarm's (a donor's step), so
        systems whose learners wait for each other's fragments keep contributing the same fragment together.
        """
        self.book = LearnerBook(self.plan, step=schedule_step)
        with torch.no_grad():
            for p, (r, theta) in enumerate(zip(rounds, thetas)):
                for n, g in theta.items():
                    self.params[n].copy_(g.to(self.device))
                self.base[p] = {n: g.detach().to("cpu", torch.float32).clone() for n, g in theta.items()}
                self.book.counters[p].base_round = r
        self._new_optimizer()

    def resync(self, p: int, round_: int, theta: dict[str, torch.Tensor]) -> None:
        """Take global fragment p of ``round_`` whatever round we hold (the swarm settled on another chain)."""
        self.book.counters[p].base_round = round_ - 1
        self.adopt(p, round_, theta)

    # ---- checkpoints: tensors (flat names) and JSON metadata
    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {f"learner/{n}": p.detach().to("cpu").clone() for n, p in self.params.items()}
        for p, base in enumerate(self.base):
            for n, t in base.items():
                tensors[f"base/{p}/{n}"] = t.clone()
        opt = self.opt.state_dict()
        for i, st in opt["state"].items():
            for k, v in st.items():
                tensors[f"opt/{i}/{k}"] = torch.as_tensor(v).detach().to("cpu").clone()
        tensors["gen"] = self.gen.get_state()
        meta = {"steps": self.steps, "book": self.book.state_dict(), "param_groups": opt["param_groups"]}
        return tensors, meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(tensors[f"learner/{n}"].to(self.device))
        for p, base in enumerate(self.base):
            self.base[p] = {n: tensors[f"base/{p}/{n}"].clone() for n in base}
        state: dict[int, dict] = {}
        for key, v in tensors.items():
            if key.startswith("opt/"):
                _, i, k = key.split("/", 2)
                state.setdefault(int(i), {})[k] = v.to(self.device) if v.dim() else v
        self._new_optimizer()
        self.opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        self.gen.set_state(tensors["gen"])
        self.steps = int(meta["steps"])
        self.book.load_state_dict(meta["book"])
