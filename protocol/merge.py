"""The synchroniser's arithmetic (docs/design.md, section 1, steps 3-6), as pure tensor functions.

- weight of a contribution: w = c_tokens^2 / c_steps ("quantity x quality");
- outer gradient anchored at the current global fragment: Delta = Theta_now - theta_m;
- Radial-Directional Averaging per tensor, or the plain weighted mean (used for the embedding);
- the outer step: SGD with Nesterov momentum, written out so every replica computes it bit for bit alike;
- adoption on the learner: overwrite (alpha = 0) or alpha-mixing.
All accumulation is fp32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from protocol.codecs import PACKED, Encoded, fresh, range_align, ranges, read_range

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
    same = base is global_now
    return {k: anchor_tensor(global_now[k], base[k], delta_base[k], same) for k in delta_base}


def anchor_tensor(now: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, same: bool) -> torch.Tensor:
    """One tensor of ``anchor``; ``same``: the base is the current global (the usual case: nothing moved
    since, and no tensor is made for it)."""
    if same:
        return delta.float()
    return (now.float() - base.float()).add_(delta.float())


def _unit(x: torch.Tensor) -> torch.Tensor:
    n = torch.linalg.vector_norm(x)
    return x / n if n > 0 else torch.zeros_like(x)


def _normalised(weights: Sequence[float]) -> list[float]:
    # Normalise first (in float64): equal weights become exact binary fractions, so a weighted mean of
    # equal-weight inputs rounds exactly like a plain mean, and huge token counts never overflow fp32.
    total = math.fsum(float(w) for w in weights)
    return [float(w) / total for w in weights]


def _summed(acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``acc + x`` with ``x`` a temporary of ours, added in place: the values Python's ``sum`` from 0 gives
    (0 + x turns -0.0 into +0.0, as ``add_(0)`` does), with one accumulator instead of a tensor per term."""
    if acc is None:
        return x.add_(0)
    return acc.add_(x)


def _each(deltas: Iterable[torch.Tensor], ws: list[float]) -> Iterator[tuple[float, torch.Tensor]]:
    """(w, D) pairs, one weight per delta (a ValueError otherwise). Not ``zip``: it keeps its last tuple,
    and with it the last delta, while it reads the next one, so two decoded contributions lived at once."""
    i = 0
    for d in deltas:
        if i >= len(ws):
            raise ValueError(f"more contributions than the {len(ws)} weights")
        yield ws[i], d
        del d
        i += 1
    if i != len(ws):
        raise ValueError(f"{i} contributions for {len(ws)} weights")


def rda(deltas: Iterable[torch.Tensor], weights: Sequence[float], owned: bool = False) -> torch.Tensor:
    """Radial-Directional Averaging: (sum w|D| / sum w) * unit(sum w unit(D) / sum w).

    One pass over ``deltas``, which may be a generator: each is read once (its norm and its direction) and
    let go before the next is made, so a merge holds one decoded contribution at a time. ``owned``: the
    tensors are the merge's own to overwrite (no temporary is made for their direction)."""
    radius, direction = 0, None
    for w, d in _each(deltas, _normalised(weights)):
        d = d.float()
        n = torch.linalg.vector_norm(d)
        radius = radius + w * n
        if owned:  # x / n and x * w in place: the values of _unit(x) * w
            u = d.div_(n) if n > 0 else d.zero_()
        else:
            u = _unit(d)
        direction = _summed(direction, u.mul_(w))
        del d, u  # before the next one is made
    return radius * _unit(direction)


def weighted_mean(deltas: Iterable[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum w D / sum w, in one pass over ``deltas`` (``mean_step`` is the same a range at a time)."""
    acc = None
    for w, d in _each(deltas, _normalised(weights)):
        acc = _summed(acc, w * d.float())
        del d  # before the next one is made
    return acc


def merge_deltas(deltas: Sequence[Tensors], weights: Sequence[float], method: str) -> dict[str, torch.Tensor]:
    """Merge per-learner outer gradients tensor by tensor with ``rda`` or ``mean``."""
    check_weights(len(deltas), weights)
    fn = rda if method == "rda" else weighted_mean
    return {name: fn((d[name] for d in deltas), weights) for name in deltas[0]}


def check_weights(n: int, weights: Sequence[float]) -> None:
    if not n or n != len(weights):
        raise ValueError(f"need one weight per contribution, got {n} and {len(weights)}")
    if any(w <= 0 for w in weights):
        raise ValueError(f"weights must be positive, got {list(weights)}")


def outer_step(
    theta: Tensors, momentum: Tensors, grad: Mapping[str, torch.Tensor | Encoded], lr: float, mu: float
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """SGD with Nesterov momentum (torch.optim.SGD(nesterov=True) with zero-initialised buffer).

    v <- mu * v + g;  Theta <- Theta - lr * (g + mu * v). Returns new tensors; inputs are untouched. ``grad``
    may be in its wire form, read a range at a time (``protocol.codecs.ranges``), one temporary of a range
    at a time. The products and sums are taken in place on tensors made here (x * a == a * x and
    x + y == y + x exactly), so the values are those of the formula as written, whatever the ranges."""
    return outer_theta(theta, momentum, grad, lr, mu), stepped_momentum(momentum, grad, mu, in_place=False)


def _step_range(th, mo, g, lr: float, mu: float, out_t) -> None:
    v = torch.mul(mo, mu).add_(g)  # the new momentum's values, a temporary of the range
    torch.sub(th, torch.mul(v, mu).add_(g).mul_(lr), out=out_t)


def outer_theta(
    theta: Tensors, momentum: Tensors, grad: Mapping[str, torch.Tensor | Encoded], lr: float, mu: float
) -> dict[str, torch.Tensor]:
    """The new parameters of ``outer_step`` alone, bit for bit the same, with the momentum's new values held
    one range at a time; ``stepped_momentum`` makes those once the new parameters are known to be right, in
    place where no one else reads the momentum. Together they hold one new tensor per parameter where
    ``outer_step`` holds two."""
    return {k: outer_theta_tensor(theta[k], momentum[k], g, lr, mu) for k, g in grad.items()}


def outer_theta_tensor(
    theta: torch.Tensor, momentum: torch.Tensor, g: torch.Tensor | Encoded, lr: float, mu: float
) -> torch.Tensor:
    new = torch.empty_like(theta, dtype=torch.float32)
    th, mo, out = theta.reshape(-1), momentum.reshape(-1), new.view(-1)
    for a, b in ranges(th.numel(), range_align(g)):
        _step_range(th[a:b], mo[a:b], read_range(g, a, b), lr, mu, out[a:b])
    return new


def stepped_momentum(
    momentum: Tensors, grad: Mapping[str, torch.Tensor | Encoded], mu: float, in_place: bool
) -> dict[str, torch.Tensor]:
    """v <- mu * v + g, a range at a time: the values ``outer_step`` gives its new momentum, written into the
    momentum's own tensors (``in_place``; each must be a contiguous fp32 tensor, ``can_step_in_place``) or
    into new ones."""
    out = {}
    for k, g in grad.items():
        mo = momentum[k]
        new = mo if in_place else torch.empty_like(mo)
        src, dst = mo.reshape(-1), new.view(-1)
        for a, b in ranges(src.numel(), range_align(g)):
            torch.mul(src[a:b], mu, out=dst[a:b]).add_(read_range(g, a, b))
        out[k] = new
    return out


def can_step_in_place(momentum: Tensors) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in momentum.values())


def mean_step(
    theta: torch.Tensor,
    momentum: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor | Encoded, torch.Tensor | None, float]],
    weights: Sequence[float],
    share: float,
    codec,
    block: int,
    lr: float,
    mu: float,
    step: bool = True,
) -> tuple[Encoded | torch.Tensor, torch.Tensor | None]:
    """The weighted mean of one tensor's contributions, its quantisation with the record's ``codec`` (None:
    fp32) and the outer step, a range at a time: what the merge of a large tensor holds beyond the new
    tensors is a range of each, never the whole merged gradient in fp32. ``parts``: per contribution its
    outer gradient (a tensor or its wire form), the base it was taken on (None: the current global) and its
    clip scale. The values are those of ``anchor``, ``weighted_mean``, ``codec`` and ``outer_step`` over the
    whole tensor (each is elementwise, or blockwise on the codec's blocks). Returns (the merged gradient's
    wire form, or fp32 tensor with no codec; new theta, None without ``step``); ``stepped_momentum`` makes the
    new momentum."""
    ws = _normalised(weights)
    blocked = codec is not None and codec.name in PACKED  # its ranges must hold whole blocks
    align = math.lcm(range_align(*(src for src, _, _ in parts)), block if blocked else 1)
    new_theta = torch.empty_like(theta, dtype=torch.float32) if step else None
    th, mo = theta.reshape(-1), momentum.reshape(-1)
    pieces = []
    for a, b in ranges(th.numel(), align):
        acc = None
        for (src, base, scale), w in zip(parts, ws):
            d = anchored_range(src, base, scale, th, a, b, writable=True)
            acc = _summed(acc, d.mul_(w))
            del d
        if share < 1.0:
            acc = acc * share
        if codec is not None:
            pieces.append(codec.encode(acc, block))
            acc = codec.decode(pieces[-1])
        else:
            pieces.append(acc)
        if new_theta is not None:
            _step_range(th[a:b], mo[a:b], acc, lr, mu, new_theta.view(-1)[a:b])
        del acc
    if not pieces:  # a tensor of no values
        empty = theta.new_zeros(0)
        pieces.append(empty if codec is None else codec.encode(empty, block))
    if codec is None:
        return torch.cat(pieces).view(theta.shape), new_theta
    wire = {p: torch.cat([e.parts[p] for e in pieces]) for p in pieces[0].parts}
    return Encoded(codec.name, tuple(theta.shape), wire), new_theta


def anchored_range(
    src: torch.Tensor | Encoded,
    base: torch.Tensor | None,
    scale: float,
    th: torch.Tensor,
    a: int,
    b: int,
    writable: bool = False,
) -> torch.Tensor:
    """Values [a, b) of one contribution's outer gradient, clipped by ``scale`` and re-anchored at the current
    global ``th`` (flattened) from the ``base`` it was taken on (None: ``th`` itself), in fp32. ``writable``:
    a tensor of the caller's own, never a view of what the contribution holds."""
    d = read_range(src, a, b)
    if scale != 1.0:
        d = d * scale
    elif writable and base is None and not fresh(src):
        d = d.clone()  # a view of what the contribution holds
    if base is not None:
        d = (th[a:b] - base.reshape(-1)[a:b]).add_(d)
    return d


def adopt(local: torch.Tensor, global_: torch.Tensor, alpha: float) -> torch.Tensor:
    """What the learner's tensor becomes when a merged global fragment arrives."""
    if alpha == 0.0:
        return global_.to(local.dtype).clone()
    return (alpha * local.float() + (1.0 - alpha) * global_.float()).to(local.dtype)
