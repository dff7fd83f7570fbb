"""How long each synchroniser takes to merge the rounds that took this node's contributions, and which one is
slow enough to pass over (docs/security.md, "A synchroniser that holds its rounds").

A synchroniser that merges honestly but holds each round until just before its senders' stall deadline
(``node.swarm.deadlines``) is never found stalled, yet the fragment merges fewer rounds. Each round that took a
contribution of ours and merged it gives one sample: the seconds from the synchroniser's ``ok`` to its record
applied here, in the fragment's round periods. A signer whose median over its last ``KEEP`` samples (at least
``MIN_SAMPLES``) is over ``SLOW_FACTOR`` times the median of every other signer's samples, and over it by
``SLOW_MARGIN`` periods at least, is slow: the caller passes it over for a while, as a stalled one.
Every sample is this node's own measurement, and the comparison is against other signers measured the same
way, so a swarm whose rounds are all slow (a thin link, a big model) judges no one. Pure bookkeeping: the
caller passes the samples."""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque

KEEP = 8  # samples kept per signer
MIN_SAMPLES = 4  # of a signer, and of the others together, before it is judged
SLOW_FACTOR = 3.0  # a slow signer's median over the others'
SLOW_MARGIN = 0.25  # ... and above it by this many round periods at least
SIGNERS = 4096  # signers remembered (the oldest forgotten first)


class MergeLatency:
    """Per signer, its recent merge latencies (in round periods) as this node measured them."""

    def __init__(self) -> None:
        self.samples: OrderedDict[str, deque[float]] = OrderedDict()

    def add(self, signer: str, periods: float) -> bool:
        """One round ``signer`` merged, ``periods`` round periods after it took our contribution; True where
        ``signer`` is now judged slow (``slow``)."""
        if not periods >= 0.0:  # NaN, or a clock that stepped back
            return False
        kept = self.samples.pop(signer, None) or deque(maxlen=KEEP)
        kept.append(periods)
        self.samples[signer] = kept
        while len(self.samples) > SIGNERS:
            self.samples.popitem(last=False)
        return self.slow(signer)

    def slow(self, signer: str) -> bool:
        mine = self.samples.get(signer, ())
        others = [x for q, xs in self.samples.items() if q != signer for x in xs]
        if len(mine) < MIN_SAMPLES or len(others) < MIN_SAMPLES:
            return False
        m, o = statistics.median(mine), statistics.median(others)
        return m > SLOW_FACTOR * o and m - o > SLOW_MARGIN

    def medians(self) -> dict[str, float]:
        """Each signer's median latency, in round periods (status)."""
        return {q: round(statistics.median(xs), 3) for q, xs in self.samples.items() if xs}
