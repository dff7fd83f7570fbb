"""Configuration of ``ddiloco train-local``: the in-process swarm's shape and the sections it runs with."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from node.learner.learner import InnerConfig
from node.learner.model import ModelConfig
from node.learner.task import TaskConfig
from node.local.run_config import NetConfig
from protocol.config import ProtocolConfig
from protocol.errors import ConfigError
from protocol.systems import SYSTEMS


@dataclass(frozen=True)
class LocalRunConfig:
    """The in-process swarm that ``ddiloco train-local`` runs."""

    system: str = field(default="decoupled", metadata={"help": f"comma-separated, of: {', '.join(SYSTEMS)}"})
    learners: int = field(default=4, metadata={"help": "M: learners in the swarm"})
    tokens: int = field(default=1_200_000, metadata={"help": "token budget over all learners"})
    seed: int = field(default=0, metadata={"help": "learner data order and jitter seed"})
    slow_learners: int = field(default=0, metadata={"help": "how many learners run slower"})
    slow_factor: float = field(default=1.2, metadata={"help": "their steps take this many times longer"})
    jitter: float = field(default=0.0, metadata={"help": "step time jitter, e.g. 0.1 for +-10%"})
    down: str = field(default="", metadata={"help": "failures 'learner:from_s:to_s,...' in virtual s"})
    eval_points: int = field(default=10, metadata={"help": "evaluations of the global model per run"})
    events: str | None = field(default=None, metadata={"help": "write event records (JSON lines) here"})
    task: str | None = field(default=None, metadata={"help": "custom task 'module:function'"})
    export: str | None = field(
        default=None,
        metadata={
            "help": "write the final global model here (safetensors); a transformers model (--model gpt2 or "
            "hf:PATH) also as a save_pretrained folder beside it (out.safetensors -> out-hf/)"
        },
    )

    def __post_init__(self) -> None:
        for s in self.system.split(","):
            if s not in SYSTEMS:
                raise ConfigError(f"system={s!r} is invalid: choose from {', '.join(SYSTEMS)}")
        if self.learners < 1:
            raise ConfigError(f"learners={self.learners} is invalid: need at least 1")
        if not 0 <= self.slow_learners <= self.learners:
            raise ConfigError(
                f"slow_learners={self.slow_learners} is invalid: must be in [0, {self.learners}]"
            )
        if self.slow_factor <= 0:
            raise ConfigError(f"slow_factor={self.slow_factor} is invalid: must be > 0")
        if not 0 <= self.jitter < 1:
            raise ConfigError(f"jitter={self.jitter} is invalid: must be in [0, 1)")
        self.down_intervals()  # validates

    def down_intervals(self) -> dict[int, list[tuple[float, float]]]:
        out: dict[int, list[tuple[float, float]]] = {}
        for item in filter(None, (x.strip() for x in self.down.split(","))):
            try:
                m, a, b = item.split(":")
                m_, a_, b_ = int(m), float(a), float(b)
            except ValueError:
                raise ConfigError(
                    f"down={self.down!r} is invalid: expected 'learner:from_s:to_s', got {item!r}"
                ) from None
            if not (0 <= m_ < self.learners and 0 <= a_ < b_):
                raise ConfigError(
                    f"down={item!r} is invalid: need 0 <= learner < {self.learners} and 0 <= from_s < to_s"
                )
            out.setdefault(m_, []).append((a_, b_))
        return out


@dataclass(frozen=True)
class TrainLocalConfig:
    run: LocalRunConfig = LocalRunConfig()
    protocol: ProtocolConfig = ProtocolConfig()
    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig()
    inner: InnerConfig = InnerConfig()
    net: NetConfig = NetConfig()

    def task_config(self) -> TaskConfig:
        return replace(self.task, model=self.model)
