"""A learner's per-fragment bookkeeping (docs/design.md, section 1, "Learner m").

Counters count since the learner last *received* fragment p: ``c_steps`` inner steps and ``c_tokens``
tokens. The learner contributes fragment p when the schedule says it is due, and keeps counting; when a
merged fragment arrives, it adopts it and the counters for p restart from zero (with ``carry`` they keep
what the learner trained that the round did not merge). ``base_round`` is the global
round of the fragment the learner last received, which its contribution is measured against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.fragments import FragmentPlan


@dataclass
class FragmentCounters:
    c_steps: int = 0
    c_tokens: int = 0
    base_round: int = 0


@dataclass
class LearnerBook:
    plan: FragmentPlan
    step: int = 0
    counters: list[FragmentCounters] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.counters:
            self.counters = [FragmentCounters() for _ in self.plan.fragments]

    def on_step(self, tokens: int) -> list[int]:
        """Count one inner step of ``tokens`` tokens; return the fragments now due to be contributed."""
        self.step += 1
        for c in self.counters:
            c.c_steps += 1
            c.c_tokens += tokens
        return [p for p in self.plan.due(self.step) if self.counters[p].c_steps > 0]

    def on_receive(
        self, fragment: int, round_: int, keep: bool = False, spent: tuple[int, int] = (0, 0)
    ) -> bool:
        """A merged fragment of global round ``round_`` arrived. Returns False (ignore it) if it is older
        than what the learner already holds. ``keep``: the learner carries its unmerged progress onto the
        new global (``ProtocolConfig.carry``), so its counters keep counting, less ``spent`` (the steps and
        tokens of its own contribution that this round merged); only the base moves."""
        c = self.counters[fragment]
        if round_ <= c.base_round:
            return False
        if keep:
            c.base_round = round_
            c.c_steps = max(0, c.c_steps - spent[0])
            c.c_tokens = max(0, c.c_tokens - spent[1])
        else:
            self.counters[fragment] = FragmentCounters(base_round=round_)
        return True

    def state_dict(self) -> dict:
        return {"step": self.step, "counters": [vars(c).copy() for c in self.counters]}

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        self.counters = [FragmentCounters(**c) for c in d["counters"]]
