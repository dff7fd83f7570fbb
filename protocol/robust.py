"""The merge of contributions from learners nobody vouches for: weighted CenteredClip.

The plain merge is a weighted mean (or RDA, its radius and direction averaged apart): one learner that sends
the negative of the honest direction, at honest size and inside every bound, pulls it as far as its weight
lets it, and its weight is its own word (``protocol.work`` bounds it to 16x an honest learner's, not less).
The robust merge bounds what any minority of the weight can do, whatever it sends:

- **Weights.** Each contribution's weight is capped at ``share_cap`` times the low median of the merge's
  weights. A learner that claims more work than a typical one in the same merge gets a typical one's say;
  two liars of six hold at most a third of the weight (share_cap 1), whatever counters they send.
- **CenteredClip** (Karimireddy, He and Jaggi 2021, the rule BTARD runs on hivemind), tensor by tensor:
  start at v = 0 and, ``ITERS`` times, move v by the weighted mean of (x_i - v), each clipped to the radius
  tau = the weighted median of the distances |x_i - v|. The honest majority of the weight sets tau; a
  contribution further out pulls with a force of tau at most, so a minority of weight delta moves the
  result by about tau * delta / (1 - delta) in any direction it likes, and no further.

Every iterate is a weighted sum of the contributions, so the iterations run on its coefficients and the
contributions' inner products: two passes over the contributions in all, a range at a time (their wire forms
decoded range by range, re-anchored as ``protocol.merge.mean_step`` does), the first for the inner products,
the second to sum the result. What it holds beyond the inputs is the result, one fp32 tensor, and a range of
each contribution. A small tensor's contributions (``WHOLE_BYTES`` in all) are decoded once and held for both.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

from protocol.codecs import Encoded, range_align, ranges
from protocol.merge import anchored_range
from protocol.norms import dot

ROBUST_RULES = ("auto", "off", "centered-clip")  # auto: on in a public swarm (protocol.systems)
ITERS = 5  # CenteredClip's iterations (on coefficients: each pass over the data is not one); docs/security.md
TAU = 1.0  # the clipping radius, as a multiple of the weighted median distance
# A tensor whose contributions hold at most this many fp32 bytes in all is decoded once, not once a pass (the
# tiny model's robust merge took 3.2x the plain one's time, most of it decoding int4 six times over)
WHOLE_BYTES = 64 << 20
# The agreement cosines (``agreements``) of a tensor over this many values read every SAMPLE_STEP-th value
SAMPLE_ABOVE, SAMPLE_STEP = 1 << 20, 16

Part = tuple["torch.Tensor | Encoded", "torch.Tensor | None", float]  # (outer gradient, its base, clip scale)


def capped_weights(weights: Sequence[float], share_cap: float) -> list[float]:
    """``weights``, each at most ``share_cap`` times their low median (0: no cap). The low median of two is
    the smaller: a liar beside one honest learner gets that learner's weight, not the mean of both."""
    if share_cap <= 0 or len(weights) < 2:
        return [float(w) for w in weights]
    cap = share_cap * statistics.median_low(weights)
    return [min(float(w), cap) for w in weights]


def weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The smallest value at which the weights of the values up to it reach half of all the weight."""
    total = math.fsum(weights)
    acc = 0.0
    for v, w in sorted(zip(values, weights)):
        acc += w
        if acc >= total / 2:
            return v
    return max(values)


def robust_parts(
    theta: torch.Tensor,
    parts: list[Part],
    weights: Sequence[float],
    cfg,
    radial: bool,
    gram: torch.Tensor | None = None,
) -> tuple[list[Part], list[float]]:
    """What ``protocol.merge.mean_step`` merges for one tensor under ``cfg.robust``: the parts and weights
    as they are (``off``), or the one robust outer gradient with weight 1. ``gram``: the inner products of
    the learners' own outer gradients over this tensor are added to it (``agreements``)."""
    if cfg.robust != "centered-clip":  # auto, unresolved: trusted learners (protocol.systems resolves it)
        return parts, list(weights)
    if len(parts) == 1:  # CenteredClip of one contribution is that contribution: no passes over it
        return parts, [1.0]
    ws = capped_weights(weights, cfg.share_cap)
    return [(centered_clip(theta, parts, ws, radial=radial, iters=ITERS, gram_out=gram), None, 1.0)], [1.0]


def new_gram(cfg, n: int) -> torch.Tensor | None:
    """Where a merge of ``n`` contributions under ``cfg`` is robust, a zero matrix for ``robust_parts`` to
    add their inner products to (``agreements``); else None."""
    return torch.zeros(n, n, dtype=torch.float64) if cfg.robust == "centered-clip" and n > 1 else None


def agreements(gram: torch.Tensor) -> tuple[float, ...]:
    """Per contribution, the cosine between its learner's own outer gradient and the sum of the others'
    *directions* (``gram``: their inner products over a whole fragment). An honest learner's shares the
    swarm's direction and is above 0 on average; a learner that sends the negated direction is below it,
    however noisy one round is (``protocol.agreement``). NaN where it has no meaning (a zero contribution,
    fewer than 2).

    Not re-anchored: the global's movement since a stale base is common to every contribution taken on it
    (at 2 learners of 6 negated their cosines were -0.4 to +0.1 against an honest +0.13 to +0.40). Of
    directions, each of unit length, not of the gradients as sent: against the plain sum, two learners of
    six that negated at 2.5 times honest size outweighed the four honest ones in "the others" of every
    honest learner, so the honest read below 0 as well, and nobody could be told apart."""
    n = gram.shape[0]
    if n < 2:
        return (math.nan,) * n
    g = gram.double()
    norms = g.diagonal().clamp(min=0.0).sqrt()
    live = norms > 0
    inv = torch.where(live, 1.0 / torch.where(live, norms, torch.ones_like(norms)), torch.zeros_like(norms))
    unit = g * inv[:, None] * inv[None, :]  # inner products of the directions (0 for a zero contribution)
    total, rows = float(unit.sum()), unit.sum(dim=1).tolist()
    out = []
    for i in range(n):
        u_ii = float(unit[i, i])  # 1, or 0 for a zero contribution
        rest = total - 2.0 * rows[i] + u_ii  # |sum of the others' directions|^2
        dot_i = rows[i] - u_ii
        out.append(dot_i / math.sqrt(rest) if u_ii > 0 and rest > 1e-12 else math.nan)
    return tuple(out)


def centered_clip(
    theta: torch.Tensor,
    parts: Sequence[Part],
    weights: Sequence[float],
    radial: bool = False,
    iters: int = ITERS,
    gram_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted CenteredClip of one tensor's contributions, anchored at the current global ``theta``: an
    fp32 tensor of ``theta``'s shape. ``weights``: as merged (capped by the caller), positive. ``radial``:
    RDA's split (``protocol.merge.rda``) made robust: CenteredClip of the contributions' unit directions,
    scaled to the weighted median of their norms.

    Every iterate is a weighted sum of the contributions (v = 0 at the start, and each step moves v towards
    each of them), so the passes run on its coefficients: each distance |x_i - v|^2 is read off the
    contributions' inner products (their Gram matrix, one pass over them), and v is summed once at the end
    (a second pass). Each contribution is read twice, whatever ``iters``."""
    total = math.fsum(weights)
    ws = [w / total for w in weights]
    th = theta.reshape(-1)
    numel, n = th.numel(), len(parts)
    if n * numel * 4 <= WHOLE_BYTES:  # small: each decoded once, not once a pass
        whole = [anchored_range(src, base, scale, th, 0, numel) for src, base, scale in parts]
        spans = [(0, numel)]

        def read(i: int, a: int, b: int) -> torch.Tensor:
            return whole[i][a:b]
    else:
        spans = list(ranges(numel, range_align(*(src for src, _, _ in parts))))

        def read(i: int, a: int, b: int) -> torch.Tensor:
            return anchored_range(*parts[i], th, a, b)

    gram = torch.zeros(n, n, dtype=torch.float64)
    own = None if gram_out is None else torch.zeros(n, n, dtype=torch.float64)
    step = 1 if numel <= SAMPLE_ABOVE else SAMPLE_STEP
    for a, b in spans:
        xs = [read(i, a, b) for i in range(n)]
        for i in range(n):
            for j in range(i, n):
                gram[i, j] += dot(xs[i], xs[j])
        if own is not None:  # the learners' own outer gradients, less the anchoring every stale one shares
            ds = [x[::step] if base is None else x[::step] - (th[a:b:step] - base.reshape(-1)[a:b:step])
                  for x, (_, base, _) in zip(xs, parts)]  # fmt: skip
            for i in range(n):
                for j in range(i, n):
                    own[i, j] += dot(ds[i], ds[j])
            del ds
        del xs
    gram = torch.triu(gram) + torch.triu(gram, 1).T
    if gram_out is not None:
        gram_out += torch.triu(own) + torch.triu(own, 1).T
    norms = gram.diagonal().clamp(min=0).sqrt().tolist()
    unit = torch.tensor([1.0 / x if radial and x > 0 else 1.0 for x in norms], dtype=torch.float64)
    gram = gram * unit.outer(unit)  # radial: the unit directions' inner products
    coef = torch.zeros(n, dtype=torch.float64)  # v = sum_i coef_i * unit_i * x_i
    sq = gram.diagonal().clone()  # distances from v = 0
    for it in range(iters):
        dist = sq.clamp(min=0).sqrt().tolist()
        tau = TAU * weighted_median(dist, ws)
        pull = torch.tensor(
            [w * (1.0 if d <= tau else tau / d) for w, d in zip(ws, dist)], dtype=torch.float64
        )
        coef = coef * (1.0 - float(pull.sum())) + pull  # v += sum_i pull_i * (x_i - v)
        if it + 1 < iters:  # |x_i - v|^2 = G_ii - 2 (G c)_i + c'Gc
            gc = gram @ coef
            sq = gram.diagonal() - 2.0 * gc + float(coef @ gc)
    scale = (coef * unit).tolist()
    v = torch.zeros(numel, dtype=torch.float32)
    for a, b in spans:
        vr = v[a:b]
        for i, c in enumerate(scale):
            if c:
                vr.add_(read(i, a, b), alpha=c)
    if radial:
        m = torch.linalg.vector_norm(v)
        v = v.mul_(weighted_median(norms, ws) / m) if m > 0 else v
    return v.view(theta.shape)
