"""The learner's inner optimisation: its AdamW settings and learning-rate schedule (warm-up, then cosine)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from protocol.errors import ConfigError


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
