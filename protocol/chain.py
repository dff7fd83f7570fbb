"""Whether a fragment's snapshot follows from the merge records that lead to it.

A node on another branch than the swarm's best head (a fork, a round merged twice) repairs it with a
snapshot; the donor could serve any tensors under the head it claims. Where this replica still keeps the
rounds back to the common ancestor (its history), the snapshot can be checked without trusting anyone:
walk this replica's own outer steps back to the ancestor, take the donor's signed records forward from
there, and compare. The walk back is fp32 arithmetic, not bit for bit (``FragmentReplica.base``: a few ulps
a step), so the comparison has a tolerance; a snapshot that is not the state the records reach, all zeros
or a momentum scaled up, is far outside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from protocol.codecs import Decoded, range_align, ranges, read_range
from protocol.norms import sq_norm

THETA_TOL = 1e-5  # |rebuilt - served| / |rebuilt| per parameter tensor
MOMENTUM_TOL = 1e-3  # the same for the outer momentum (the walk back divides by mu: more rounding)

Tensors = Mapping[str, torch.Tensor]
Step = tuple[Mapping[str, torch.Tensor], float, float]  # (merged outer gradient, outer lr, outer momentum)


def _wire(grad: Mapping[str, torch.Tensor], k: str):
    """Tensor ``k`` of a merged gradient in the form ``read_range`` reads a range of: its wire form where the
    mapping keeps one (``Decoded``: decoded a range at a time, never whole), else the tensor."""
    return grad.encoded[k] if isinstance(grad, Decoded) else grad[k]


def _relative(diff2: float, scale2: float) -> float:
    if not math.isfinite(diff2):
        return float("inf")
    return math.sqrt(diff2 / scale2) if scale2 > 0 else (0.0 if diff2 == 0 else float("inf"))


def snapshot_mismatch(
    theta: Tensors,
    momentum: Tensors,
    back: Sequence[Step],
    forward: Sequence[Step],
    served_theta: Tensors,
    served_momentum: Tensors,
) -> str | None:
    """Rebuild a state from this replica's ``theta``/``momentum``: undo the outer steps ``back`` (newest
    first, as ``FragmentReplica.past_steps`` gives them), then take the steps ``forward`` (oldest first);
    compare with the served tensors. None when they match within the tolerances, else what differs.
    A range of one tensor at a time (``protocol.codecs.ranges``): what it holds beyond its inputs is a few
    ranges, whatever the model's size (an 85M-parameter model's embedding is 154 MB in fp32)."""
    if set(served_theta) != set(theta) or set(served_momentum) != set(theta):
        return "the snapshot names other tensors"
    for k in theta:
        if served_theta[k].shape != theta[k].shape or served_momentum[k].shape != theta[k].shape:
            return f"{k} has another shape in the snapshot"
        grads = (
            [(_wire(g, k), lr, mu) for g, lr, mu in back],
            [(_wire(g, k), lr, mu) for g, lr, mu in forward],
        )
        sums = [0.0, 0.0, 0.0, 0.0]  # |diff|^2 and |rebuilt|^2, parameters then momentum
        for a, b in ranges(theta[k].numel(), range_align(*(g for g, _, _ in grads[0] + grads[1]))):
            th, mo = read_range(theta[k], a, b).clone(), read_range(momentum[k], a, b).clone()
            for g, lr, mu in grads[0]:  # theta = theta' + lr (g + mu v'); v = (v' - g) / mu
                g = read_range(g, a, b)
                th.add_(torch.mul(mo, mu).add_(g), alpha=lr)
                if mu != 0:
                    mo.sub_(g).div_(mu)
            for g, lr, mu in grads[1]:  # v' = mu v + g; theta' = theta - lr (g + mu v')
                g = read_range(g, a, b)
                mo.mul_(mu).add_(g)
                th.sub_(torch.mul(mo, mu).add_(g), alpha=lr)
            for i, (rebuilt, served) in enumerate(((th, served_theta[k]), (mo, served_momentum[k]))):
                sums[2 * i] += sq_norm(read_range(served, a, b) - rebuilt)
                sums[2 * i + 1] += sq_norm(rebuilt)
        for what, (d2, s2), tol in (
            ("parameters", sums[:2], THETA_TOL),
            ("momentum", sums[2:], MOMENTUM_TOL),
        ):
            far = _relative(d2, s2)
            if not far <= tol:
                return f"{what} of {k} are {far:.3g} (relative) from what the records reach"
    return None
