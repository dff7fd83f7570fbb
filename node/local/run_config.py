"""What one in-process run is (its learners' plans, the virtual network) and what it returns."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from protocol.errors import ConfigError
from protocol.systems import SYSTEMS


@dataclass(frozen=True)
class LearnerPlan:
    """How one learner behaves in virtual time: its speed, jitter and down intervals."""

    speed: float = 1.0  # relative; 0.8 means steps take 25% longer
    jitter: float = 0.0  # each step's time is scaled by a uniform factor in [1 - jitter, 1 + jitter]
    down: tuple[tuple[float, float], ...] = ()  # (crash, return) in virtual seconds
    scale: float = 1.0  # multiplies the learner's outer gradients: >1 plays a hostile learner (robust merge)
    inflate: int = (
        1  # multiplies the tokens its contributions claim (weight: tokens^2/steps): a hostile learner
    )
    alie: float = 0.0  # > 0: sends "a little is enough" at this z instead (node.local.hostile)
    start_s: float = 0.0  # joins at this virtual time (downloading the global model), as a late node does
    # the virtual seconds its first steps take, as given, before speed and jitter apply (bench.parity: a
    # node's steps while the other nodes were still starting on the same host, which starve it)
    first_steps_s: tuple[float, ...] = ()

    @property
    def hostile(self) -> bool:
        """Its outer gradients are not its own (``scale`` or ``alie``)."""
        return self.scale != 1.0 or self.alie > 0


@dataclass(frozen=True)
class NetConfig:
    latency_s: float = field(default=0.05, metadata={"help": "one-way message latency (virtual s)"})
    bandwidth_mbps: float = field(default=1000.0, metadata={"help": "per-learner link (Mbit/s)"})
    merge_s: float = field(default=0.02, metadata={"help": "time a merge takes (virtual s)"})

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes * 8 / (self.bandwidth_mbps * 1e6)


@dataclass(frozen=True)
class RunConfig:
    system: str = "decoupled"
    learners: int = 4
    token_budget: int = 4_000_000
    step_time_s: float = 1.0
    eval_points: int = 10
    # swarm token counts at which to evaluate the global model, instead of eval_points evenly spaced
    # (bench.parity: the real nodes' evaluation points, so both drivers' curves are read alike)
    eval_tokens: tuple[int, ...] = ()
    seed: int = 0
    net: NetConfig = NetConfig()
    plans: tuple[LearnerPlan, ...] = ()
    # inner steps each learner's lr schedule spans (a node's --steps); 0: its share of the budget
    lr_steps: int = 0

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ConfigError(f"system={self.system!r} is invalid: choose one of {', '.join(SYSTEMS)}")
        if self.plans and len(self.plans) != self.learners:
            raise ConfigError(f"{len(self.plans)} learner plans given for learners={self.learners}")
        if self.token_budget <= 0:
            raise ConfigError(f"token_budget={self.token_budget} is invalid: must be > 0")
        if any(t <= 0 for t in self.eval_tokens):
            raise ConfigError(f"eval_tokens={self.eval_tokens} is invalid: every count must be > 0")

    def eval_thresholds(self) -> list[int]:
        """Token counts at which the global model is evaluated, ascending, the budget's last."""
        if self.eval_tokens:
            return sorted({t for t in self.eval_tokens if t < self.token_budget} | {self.token_budget})
        return [self.token_budget * (k + 1) // self.eval_points for k in range(self.eval_points)]

    def plan(self, m: int) -> LearnerPlan:
        return self.plans[m] if self.plans else LearnerPlan()


@dataclass
class RunResult:
    system: str
    final_loss: float
    evals: list[tuple[int, float, float]]  # (tokens, virtual t, eval loss)
    goodput: float
    virtual_s: float
    tokens: int
    merges: int
    bytes_sent: int
    steps: int
    model_hash: str
    rejected: int = 0
    final_params: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def summary(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("evals", "final_params")}
        d["tokens_per_virtual_s"] = self.tokens / self.virtual_s if self.virtual_s else 0.0
        return d


def jittered(rng: random.Random, plan: LearnerPlan, step_time_s: float, step: int = -1) -> float:
    """How long the learner's step number ``step`` (0 for its first) takes: ``plan.first_steps_s[step]``
    while there is one, else ``step_time_s`` at the plan's speed, times a draw of its jitter."""
    f = 1.0 + (rng.uniform(-plan.jitter, plan.jitter) if plan.jitter else 0.0)
    if 0 <= step < len(plan.first_steps_s):
        return plan.first_steps_s[step]
    return step_time_s / plan.speed * f
