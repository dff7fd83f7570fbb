"""Whether a fragment's snapshot follows from the merge records that lead to it (issue 31, item 3).

A node on another branch than the swarm's best head (a fork, a round merged twice) repairs it with a
snapshot; the donor could serve any tensors under the head it claims. Where this replica still keeps the
rounds back to the common ancestor (its history), the snapshot can be checked without trusting anyone:
walk this replica's own outer steps back to the ancestor, take the donor's signed records forward from
there, and compare. The walk back is fp32 arithmetic, not bit for bit (``FragmentReplica.base``: a few ulps
a step), so the comparison has a tolerance; a snapshot that is not the state the records reach, all zeros
or a momentum scaled up, is far outside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

THETA_TOL = 1e-5  # |rebuilt - served| / |rebuilt| per parameter tensor
MOMENTUM_TOL = 1e-3  # the same for the outer momentum (the walk back divides by mu: more rounding)

Tensors = Mapping[str, torch.Tensor]
Step = tuple[Mapping[str, torch.Tensor], float, float]  # (merged outer gradient, outer lr, outer momentum)


def _far(rebuilt: torch.Tensor, served: torch.Tensor, tol: float) -> float | None:
    """The relative distance of ``served`` from ``rebuilt`` when it is over ``tol``, else None."""
    if served.shape != rebuilt.shape:
        return float("inf")
    diff = torch.linalg.vector_norm(served.float() - rebuilt)
    scale = torch.linalg.vector_norm(rebuilt)
    if not torch.isfinite(diff):
        return float("inf")
    if diff <= tol * scale:
        return None
    return float(diff / scale) if scale > 0 else float("inf")


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
    One tensor at a time: what it holds beyond its inputs is a few copies of one tensor."""
    if set(served_theta) != set(theta) or set(served_momentum) != set(theta):
        return "the snapshot names other tensors"
    for k in theta:
        th, mo = theta[k].float().clone(), momentum[k].float().clone()
        for grad, lr, mu in back:  # theta = theta' + lr (g + mu v'); v = (v' - g) / mu
            g = grad[k].float()
            th.add_(torch.mul(mo, mu).add_(g), alpha=lr)
            if mu != 0:
                mo = mo.sub_(g).div_(mu)
        for grad, lr, mu in forward:  # v' = mu v + g; theta' = theta - lr (g + mu v')
            g = grad[k].float()
            mo = mo.mul_(mu).add_(g)
            th.sub_(torch.mul(mo, mu).add_(g), alpha=lr)
        for what, rebuilt, served, tol in (
            ("parameters", th, served_theta[k], THETA_TOL),
            ("momentum", mo, served_momentum[k], MOMENTUM_TOL),
        ):
            far = _far(rebuilt, served, tol)
            if far is not None:
                return f"{what} of {k} are {far:.3g} (relative) from what the records reach"
    return None
