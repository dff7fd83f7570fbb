"""The rate this node has measured on each peer's link, and the time a body of n bytes is allowed on it.

A request's deadline (``rpc_timeout_s``) is for round trips and the handler: it is what a dead or hung peer
costs. Once a peer has said GO, the body is allowed ``SLACK`` times the time its bytes take at the rate
measured on that peer's link, on top of the deadline, and so are the bodies ahead of it on this node's link,
to and from every peer (``Transport.queued``). Without that, a contribution of a whole
model in fp32 (3.6 MB for the default model, about 10 s over a 3 Mbit/s link) never arrived within a 4 s
deadline, and every try failed over and was dropped.

The rate is measured from the bodies themselves (``MIN_SAMPLE`` bytes or more: a small one measures the
round trip, not the link), both ways, one estimate per peer: a moving average of the samples, halved when a
body runs past its allowance (the link got slower, or was never as fast: the next try gets twice the time).
Before the first sample, and never below it, the rate is ``floor_bps``: the slowest link this node waits for.
"""

from __future__ import annotations

FLOOR_BPS = 1e6 / 8  # 1 Mbit/s: the floor where none is given (``--link-floor-mbps``)
MIN_SAMPLE = 64 << 10  # bytes: a body this large or larger measures the link
SLACK = 2.0  # a body may take this many times its time at the measured rate
WEIGHT = 0.3  # of a new sample in the moving average
# a body that keeps arriving is allowed up to this many times its allowance: its sender's link may be shared
# with bodies the reader cannot see (three snapshots served at once by one node each take three times their
# bytes' time, and the reader of each counted on one); a sender that stops is cut after ``idle_s`` still
SHARED = 8


class LinkRates:
    def __init__(self, floor_bps: float = FLOOR_BPS) -> None:
        if not floor_bps > 0:
            raise ValueError(f"a link floor of {floor_bps} bytes/s: it must be positive")
        self.floor_bps = float(floor_bps)
        self.rates: dict[str, float] = {}  # peer -> bytes/s, measured

    def rate(self, peer: str) -> float:
        """Bytes per second this node counts on for ``peer``'s link: measured, never below the floor."""
        return max(self.floor_bps, self.rates.get(peer, 0.0))

    def allowance_s(self, peer: str, nbytes: int) -> float:
        """The seconds a body of ``nbytes`` may take to or from ``peer``, past the request's deadline."""
        return SLACK * nbytes / self.rate(peer) if nbytes > 0 else 0.0

    def until(self, now: float, deadline_s: float, peer: str, nbytes: int) -> float:
        """The moment a request whose body of ``nbytes`` (with those ahead of it) starts at ``now`` runs out:
        its deadline, and the body's allowance on top."""
        return now + deadline_s + self.allowance_s(peer, nbytes)

    def observe(self, peer: str, nbytes: int, seconds: float) -> None:
        """A body of ``nbytes`` moved in ``seconds`` (from GO to the reply, or as read)."""
        if nbytes < MIN_SAMPLE or seconds <= 0:
            return
        sample = nbytes / seconds
        old = self.rates.get(peer)
        self.rates[peer] = sample if old is None else (1 - WEIGHT) * old + WEIGHT * sample

    def overran(self, peer: str) -> None:
        """A body to or from ``peer`` ran past its allowance: count on half the rate from now on."""
        self.rates[peer] = max(self.floor_bps, self.rate(peer) / 2)

    def snapshot(self) -> dict[str, float]:
        """Each measured peer's rate in bytes/s, for status."""
        return {peer: round(r, 1) for peer, r in self.rates.items()}
