"""The sizes of outer gradients: their norms (of fp32 tensors, or of their wire form a range at a time) and
each learner's recent size, which the robust merge and the refusal of outliers measure against."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import torch

from protocol.codecs import Encoded, range_align, ranges, read_range

SQ_BLOCK = 2048  # values summed in fp32 before their partial sums are added in float64


def _sq_norm(t: torch.Tensor) -> float:
    """The sum of squares of t: the squares of ``SQ_BLOCK`` values at a time summed in fp32, those partial sums
    added in float64 (relative error about 1e-8 at 4M values; accumulating every value in float64 took 11-25x
    as long on one thread, a third of a robust merge of a transformer block). inf or NaN when t holds one: a
    finite value whose square overflows fp32 is summed again in float64, which no float32 value can overflow."""
    x = t.detach().reshape(-1)
    n = x.numel()
    if x.dtype != torch.float32 or n < 2 * SQ_BLOCK:
        return _sq_norm64(x)
    k = n // SQ_BLOCK * SQ_BLOCK
    s = float(torch.linalg.vector_norm(x[:k].view(-1, SQ_BLOCK), dim=1).double().square().sum())
    s += _sq_norm64(x[k:]) if k < n else 0.0
    return _sq_norm64(x) if math.isinf(s) else s


def _sq_norm64(x: torch.Tensor) -> float:
    """The sum of squares accumulated value by value in float64."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float64)) ** 2


def dot(x: torch.Tensor, y: torch.Tensor) -> float:
    """The inner product of two fp32 tensors of one size, summed as ``_sq_norm`` sums: ``SQ_BLOCK`` products at a
    time in fp32 (one batched matrix product), those partial sums added in float64. Where a product overflows
    fp32 the sum is made again in float64."""
    x, y = x.detach().reshape(-1), y.detach().reshape(-1)
    n = x.numel()
    if x.dtype != torch.float32 or y.dtype != torch.float32 or n < 2 * SQ_BLOCK:
        return float(torch.dot(x.double(), y.double()))
    k = n // SQ_BLOCK * SQ_BLOCK
    # y as rows transposed, not a column view: 8x the speed on one thread
    part = torch.bmm(x[:k].view(-1, 1, SQ_BLOCK), y[:k].view(-1, 1, SQ_BLOCK).transpose(1, 2))
    s = float(part.double().sum())
    s += float(torch.dot(x[k:].double(), y[k:].double())) if k < n else 0.0
    return float(torch.dot(x.double(), y.double())) if not math.isfinite(s) else s


def sq_norm(v: torch.Tensor | Encoded) -> float:
    """``_sq_norm`` of a tensor, or of its wire form decoded a range at a time (not all of it at once)."""
    if not isinstance(v, Encoded):
        return _sq_norm(v)
    return sum(_sq_norm(read_range(v, a, b)) for a, b in ranges(math.prod(v.shape), range_align(v)))


def global_norm(tensors: Mapping[str, torch.Tensor | Encoded]) -> float:
    return math.sqrt(sum(sq_norm(t) for t in tensors.values()))


class NormBook:
    """Each learner's recent outer-gradient size, as RMS per parameter over whatever fragments it sent.

    One book is shared by all fragments of a node, so the robust merge has a reference as soon as three
    learners have contributed anything: the median over learners of each one's median recent RMS. A single
    lying learner among three or more cannot move it far."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.rms: dict[str, list[float]] = {}

    def add(self, learner: str, rms: float) -> None:
        xs = self.rms.setdefault(learner, [])
        xs.append(rms)
        del xs[: -self.keep]

    def reference_rms(self) -> float | None:
        per = [statistics.median(xs) for xs in self.rms.values() if xs]
        per = [x for x in per if x > 0]
        return statistics.median(per) if len(per) >= 3 else None
