"""Learners whose outer gradients point against everyone else's, round after round (issue 32, item 2).

The robust merge (``protocol.robust``) bounds what a minority of the weight moves one merge by, not what it
does over many: a learner that sends its negated outer gradient at honest size sits inside the honest spread
(late in training an outer gradient is mostly noise, and the signal is a small part of it), so it is
clipped little or not at all, and each round it takes back its share of the signal the others brought.
Two such learners in rounds of five held 40% of the weight; the merge kept a fifth of the honest signal.

No single round tells it apart; many do. Each robust merge measures, per contribution, the cosine between
its outer gradient and the sum of the others' (``protocol.robust.agreements``, read off the inner products
CenteredClip computes anyway). An honest learner's expected cosine is positive (its signal is the swarm's);
a negated one's is negative. A synchroniser keeps the last ``KEEP`` cosines of each learner it merged, and
leaves a learner out of its merges while the mean of those is below zero by ``Z`` standard errors (after
``MIN_ROUNDS`` of them). Each node judges from its own merges: nothing here is a vote, and an identity
earns nothing by existing. Each ``FORGET_EVERY`` contributions left out forget the learner's oldest cosine,
so that one judged wrongly (or one that turned honest) is merged again, and measured again, after a while:
a learner negated every round is back for ``MIN_ROUNDS`` merges in about every
``MIN_ROUNDS + (KEEP - MIN_ROUNDS) * FORGET_EVERY``.

What it does not catch: an attack inside the honest spread that keeps its cosine positive ("a little is
enough"), whose cost the robust merge bounds; a majority of the weight, which sets what "the others" are.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

KEEP = 64  # cosines kept per learner
MIN_ROUNDS = 8  # before any judgement
Z = 3.0  # standard errors below zero
FORGET_EVERY = 4  # contributions left out per cosine forgotten
REMEMBER = 4096  # learners kept (the least recently merged forgotten)


class AgreementBook:
    """Per learner, the cosines its contributions had with the rest of each robust merge made here."""

    def __init__(self, keep: int = KEEP, min_rounds: int = MIN_ROUNDS, z: float = Z) -> None:
        self.keep, self.min_rounds, self.z = keep, min_rounds, z
        self.seen: OrderedDict[str, deque[float]] = OrderedDict()
        self.left_out: dict[str, int] = {}

    def add(self, learners: Sequence[str], cosines: Sequence[float]) -> list[str]:
        """Take one merge's cosines (NaN and anything out of [-1, 1] ignored); the learners that became
        distrusted by it."""
        turned = []
        for learner, a in zip(learners, cosines):
            if not (math.isfinite(a) and -1.0 - 1e-6 <= a <= 1.0 + 1e-6):
                continue
            was = self.distrusted(learner)
            xs = self.seen.get(learner)
            if xs is None:
                xs = self.seen[learner] = deque(maxlen=self.keep)
            xs.append(a)
            self.seen.move_to_end(learner)
            if not was and self.distrusted(learner):
                turned.append(learner)
        while len(self.seen) > REMEMBER:
            self.left_out.pop(self.seen.popitem(last=False)[0], None)
        return turned

    def mean(self, learner: str) -> float | None:
        xs = self.seen.get(learner)
        return statistics.fmean(xs) if xs else None

    def distrusted(self, learner: str) -> bool:
        xs = self.seen.get(learner)
        if xs is None or len(xs) < self.min_rounds:
            return False
        m, sd = statistics.fmean(xs), statistics.pstdev(xs)
        return m + self.z * sd / math.sqrt(len(xs)) < 0.0

    def keep_trusted(self, contributions: Iterable) -> tuple:
        """``contributions`` less those of distrusted learners (anything with a ``learner``); each one
        left out counts toward forgetting that learner's oldest cosine."""
        kept = []
        for c in contributions:
            if not self.distrusted(c.learner):
                kept.append(c)
                continue
            n = self.left_out[c.learner] = self.left_out.get(c.learner, 0) + 1
            if n % FORGET_EVERY == 0:
                self.seen[c.learner].popleft()
        return tuple(kept)

    def status(self) -> dict:
        return {"distrusted": sorted(p for p in self.seen if self.distrusted(p))}
