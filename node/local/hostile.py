"""What a hostile learner of the in-process runner sends in place of its outer gradient (``LearnerPlan``):
a scaled copy of its own, or "a little is enough" (Baruch, Baruch and Goldberg, NeurIPS 2019), which knows
every honest learner's outer gradient and sends their coordinate-wise mean shifted by ``z`` of their
standard deviations, every coordinate the same way: inside the honest spread, where a robust rule cannot
tell it from an honest update, and the same bias every round."""

from __future__ import annotations

from statistics import NormalDist

import torch


def alie_z(n: int, hostile: int) -> float:
    """The paper's z for ``hostile`` of ``n`` learners: the largest shift that still leaves the hostile
    updates closer to the mean than the honest ones the majority needs (``s = n // 2 + 1 - hostile`` of them);
    for 1 of 5: 0.25, for 2 of 6: 0.43."""
    s = n // 2 + 1 - hostile
    return NormalDist().inv_cdf((n - s) / n)


def alie_gradient(honest: list[dict[str, torch.Tensor]], z: float) -> dict[str, torch.Tensor]:
    """The honest updates' coordinate-wise mean minus ``z`` of their standard deviations (population)."""
    out = {}
    for name in honest[0]:
        stack = torch.stack([g[name] for g in honest])
        out[name] = stack.mean(0) - z * stack.std(0, correction=0)
    return out


def hostile_gradient(slots, s, p: int) -> dict[str, torch.Tensor]:
    """What slot ``s`` (a hostile learner: ``s.plan.hostile``) sends for fragment p instead of its own outer
    gradient; ``slots``: every learner of the run, the honest ones' gradients read as they stand now."""
    if s.plan.alie:
        honest = [t.learner.outer_gradient(p) for t in slots if not t.plan.hostile]
        return alie_gradient(honest, s.plan.alie)
    return {k: v * s.plan.scale for k, v in s.learner.outer_gradient(p).items()}
