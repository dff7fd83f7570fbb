"""Per-peer limits: exponential backoff for retries toward a peer that fails (``Backoff``), and a
token bucket for what one peer may ask of us (``TokenBucket``). Pure bookkeeping: the caller passes the
time (monotonic seconds), so both are tested without a clock."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Backoff:
    """After ``n`` failures in a row toward a peer, wait ``min(cap_s, base_s * 2 ** (n - 1))`` before trying
    it again; a success forgets the peer. ``should_log`` says which failures deserve a warning: the first,
    then one each time the delay doubles up to the cap, then one every ``log_every_s`` (the others are
    logged at debug level)."""

    base_s: float = 0.25
    cap_s: float = 30.0
    log_every_s: float = 60.0
    failures: dict[str, int] = field(default_factory=dict)
    not_before: dict[str, float] = field(default_factory=dict)
    _logged_at: dict[str, float] = field(default_factory=dict)

    def ready(self, peer: str, now: float) -> bool:
        return now >= self.not_before.get(peer, float("-inf"))

    def delay(self, n: int) -> float:
        """The wait after the ``n``-th failure in a row (n >= 1)."""
        return min(self.cap_s, self.base_s * 2.0 ** min(n - 1, 60))

    def failed(self, peer: str, now: float) -> float:
        """Record a failure; returns how long to wait before the next try."""
        n = self.failures.get(peer, 0) + 1
        self.failures[peer] = n
        d = self.delay(n)
        self.not_before[peer] = now + d
        if len(self.failures) > 4096:  # bounded memory: forget the peers that failed longest ago
            for old in sorted(self.not_before, key=self.not_before.get)[:2048]:
                self.forget(old)
        return d

    def succeeded(self, peer: str) -> None:
        self.forget(peer)

    def forget(self, peer: str) -> None:
        self.failures.pop(peer, None)
        self.not_before.pop(peer, None)
        self._logged_at.pop(peer, None)

    def should_log(self, peer: str, now: float) -> bool:
        n = self.failures.get(peer, 0)
        doubling = n <= 1 or (n & (n - 1) == 0 and self.delay(n - 1) < self.cap_s)
        if doubling or now - self._logged_at.get(peer, float("-inf")) >= self.log_every_s:
            self._logged_at[peer] = now
            return True
        return False


@dataclass
class TokenBucket:
    """Each peer holds up to ``burst`` tokens, refilled at ``per_s`` tokens a second; ``take`` spends
    ``n`` of them or, when the peer has fewer, spends none and returns the seconds until it would have
    enough (0.0 means taken)."""

    burst: float
    per_s: float
    tokens: dict[str, tuple[float, float]] = field(default_factory=dict)  # peer -> (tokens, at)

    def take(self, peer: str, n: float, now: float) -> float:
        have, at = self.tokens.get(peer, (self.burst, now))
        have = min(self.burst, have + max(0.0, now - at) * self.per_s)
        if n <= have:
            self.tokens[peer] = (have - n, now)
            self._trim(now)
            return 0.0
        self.tokens[peer] = (have, now)
        if n > self.burst or self.per_s <= 0:
            return float("inf")
        return (n - have) / self.per_s

    def _trim(self, now: float) -> None:
        if len(self.tokens) > 4096:  # peers whose bucket is full again need no entry
            full = [p for p, (t, at) in self.tokens.items() if t + (now - at) * self.per_s >= self.burst]
            for p in full:
                del self.tokens[p]
