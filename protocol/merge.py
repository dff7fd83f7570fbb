"""The synchroniser's arithmetic (DESIGN §1 steps 3-6), as pure tensor functions.

- weight of a contribution: w = c_tokens^2 / c_steps ("quantity x quality");
- outer gradient anchored at the current global fragment: Delta = Theta_now - theta_m;
- Radial-Directional Averaging per tensor, or the plain weighted mean (used for the embedding);
- the outer step: SGD with Nesterov momentum, written out so every replica computes it bit for bit alike;
- adoption on the learner: overwrite (alpha = 0) or alpha-mixing.
All accumulation is fp32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

Tensors = Mapping[str, torch.Tensor]


def contribution_weight(c_tokens: int, c_steps: int) -> float:
    """w = c_tokens^2 / c_steps: tokens since the last receipt times tokens per step."""
    if c_steps <= 0 or c_tokens <= 0:
        raise ValueError(f"counters must be positive, got c_tokens={c_tokens} c_steps={c_steps}")
    return float(c_tokens) ** 2 / float(c_steps)


def anchor(global_now: Tensors, base: Tensors, delta_base: Tensors) -> dict[str, torch.Tensor]:
    """Re-anchor an outer gradient taken against an older global ``base`` at the current global.

    The learner sent delta_base = base - theta_m, so theta_m = base - delta_base and
    Theta_now - theta_m = (Theta_now - base) + delta_base. Identity when base is Theta_now.
    """
    if base is global_now:  # the usual case: nothing moved since the base, and no tensor is made for it
        return {k: delta_base[k].float() for k in delta_base}
    return {k: (global_now[k].float() - base[k].float()) + delta_base[k].float() for k in delta_base}


def _unit(x: torch.Tensor) -> torch.Tensor:
    n = torch.linalg.vector_norm(x)
    return x / n if n > 0 else torch.zeros_like(x)


def _normalised(weights: Sequence[float]) -> list[float]:
    # Normalise first (in float64): equal weights become exact binary fractions, so a weighted mean of
    # equal-weight inputs rounds exactly like a plain mean, and huge token counts never overflow fp32.
    total = math.fsum(float(w) for w in weights)
    return [float(w) / total for w in weights]


def rda(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Radial-Directional Averaging: (sum w|D| / sum w) * unit(sum w unit(D) / sum w)."""
    ws = _normalised(weights)
    radius = sum(w * torch.linalg.vector_norm(d.float()) for w, d in zip(ws, deltas))
    direction = sum(w * _unit(d.float()) for w, d in zip(ws, deltas))
    return radius * _unit(direction)


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    ws = _normalised(weights)
    return sum(w * d.float() for w, d in zip(ws, deltas))


def merge_deltas(deltas: Sequence[Tensors], weights: Sequence[float], method: str) -> dict[str, torch.Tensor]:
    """Merge per-learner outer gradients tensor by tensor with ``rda`` or ``mean``."""
    if not deltas or len(deltas) != len(weights):
        raise ValueError(f"need one weight per contribution, got {len(deltas)} and {len(weights)}")
    if any(w <= 0 for w in weights):
        raise ValueError(f"weights must be positive, got {list(weights)}")
    fn = rda if method == "rda" else weighted_mean
    return {name: fn([d[name] for d in deltas], weights) for name in deltas[0]}


def outer_step(
    theta: Tensors, momentum: Tensors, grad: Tensors, lr: float, mu: float
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """SGD with Nesterov momentum (torch.optim.SGD(nesterov=True) with zero-initialised buffer).

    v <- mu * v + g;  Theta <- Theta - lr * (g + mu * v). Returns new tensors; inputs are untouched.
    """
    new_theta, new_mom = {}, {}
    for k, g in grad.items():
        v = mu * momentum[k] + g
        new_mom[k] = v
        new_theta[k] = theta[k] - lr * (g + mu * v)
    return new_theta, new_mom


def adopt(local: torch.Tensor, global_: torch.Tensor, alpha: float) -> torch.Tensor:
    """What the learner's tensor becomes when a merged global fragment arrives."""
    if alpha == 0.0:
        return global_.to(local.dtype).clone()
    return (alpha * local.float() + (1.0 - alpha) * global_.float()).to(local.dtype)
