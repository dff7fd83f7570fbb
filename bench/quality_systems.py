"""The systems and scenarios bench/quality.py compares, and its small printing helpers."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

from node.local.run_config import LearnerPlan
from protocol.config import ProtocolConfig


@dataclass(frozen=True)
class System:
    key: str
    label: str
    runner: str  # a node.runner system
    overrides: tuple[tuple[str, object], ...] = ()  # ProtocolConfig fields; "M" stands for the learner count


SYSTEMS = (
    System("dp", "DP", "dp"),
    System("sync", "Sync DiLoCo", "sync-diloco"),
    System("streaming", "Streaming DiLoCo", "streaming"),
    System("dec-kM", "Decoupled K=M", "decoupled", (("quorum", "M"), ("grace", False))),
    System("dec-k1", "Decoupled K=1", "decoupled", (("quorum", 1), ("grace", False))),
    System(
        "dec-k1-grace",
        "Decoupled K=1+grace",
        "decoupled",
        (("quorum", 1), ("grace", True), ("grace_gamma", 0.5)),
    ),
)
SCENARIOS = ("homogeneous", "heterogeneous", "one-down")


def scenario_plans(name: str, learners: int, steps: int, step_time_s: float) -> tuple[LearnerPlan, ...]:
    """Learner plans for a scenario; ``steps`` is the expected inner steps of a speed-1 learner."""
    if name == "homogeneous":
        return tuple(LearnerPlan() for _ in range(learners))
    if name == "heterogeneous":
        slow = set(range(learners - learners // 2, learners))  # the second half
        return tuple(LearnerPlan(speed=1 / 1.2 if m in slow else 1.0, jitter=0.1) for m in range(learners))
    if name == "one-down":
        duration = steps * step_time_s
        down = ((0.25 * duration, 0.50 * duration),)
        return tuple(LearnerPlan(down=down if m == learners - 1 else ()) for m in range(learners))
    raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")


def protocol_for(system: System, base: ProtocolConfig, learners: int) -> ProtocolConfig:
    fields = {k: (learners if v == "M" else v) for k, v in system.overrides}
    return ProtocolConfig(**{**asdict(base), **fields})


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt_s(s: float) -> str:
    return f"{int(s // 60)}m{s % 60:04.1f}s" if s >= 60 else f"{s:.1f}s"
