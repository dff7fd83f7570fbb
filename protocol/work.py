"""Weights follow work the swarm can see.

A contribution's weight, c_tokens^2 / c_steps, grows with both counters, and both are its sender's word: a
member that sent c_tokens = 1e9 with c_steps = 1 held the whole weight of every merge it joined. The
synchroniser bounds them by what the swarm can see of the sender:

- tokens per step, c_tokens / c_steps, at most ``factor`` times the median of what the live members publish
  (their tokens per second over their steps per second), once 3 members publish rates: a learner's batch
  is its own, so mixed hardware differs, but not by orders of magnitude. A view that drops below 3 for a
  moment (a record a heartbeat late, a member restarting) keeps the last medians of 3 or more for
  ``keep_s`` (``WorkMeasure``): a loaded suite run took 1e9 tokens in one step in such a moment;
- tokens per step, also at most ``factor`` times what the sender's own record publishes, whenever it
  publishes rates: this holds before 3 members do (a swarm's first rounds, a small swarm), where a member
  whose counters are wrong but whose record is right (a bug, a half-dead process) would otherwise hold the
  whole weight of a merge; a liar that lies in its record as well is bounded by the medians only;
- steps, at most ``factor`` times what the sender's published step rate (itself at most ``factor`` times the
  members' median) allows over the time since its last merged contribution of the fragment, or since this
  node first heard of it, plus ``factor`` rounds of ``sync_every`` steps of slack.

Over a bound the contribution is refused as ``bad_counters``, which costs its sender a point of score.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from protocol.errors import ProtocolError, RejectCode

MIN_MEMBERS = 3  # members publishing rates before their median bounds anyone


@dataclass(frozen=True)
class VisibleWork:
    """The members' medians: tokens per step and steps per second (0.0: fewer than ``MIN_MEMBERS`` publish)."""

    tokens_per_step: float = 0.0
    steps_per_s: float = 0.0


def visible_work(rates: Iterable[tuple[float, float]]) -> VisibleWork:
    """From the live members' published (tokens_per_s, steps_per_s); a member that publishes no rate yet
    (starting, paused) is left out."""
    rates = [(t, s) for t, s in rates if t > 0 and s > 0]
    if len(rates) < MIN_MEMBERS:
        return VisibleWork()
    return VisibleWork(statistics.median(t / s for t, s in rates), statistics.median(s for _, s in rates))


class WorkMeasure:
    """``visible_work`` that outlasts a moment's gap: where fewer than ``MIN_MEMBERS`` publish rates now, the
    last medians of ``MIN_MEMBERS`` or more, for ``keep_s`` seconds after they were seen. A swarm that has
    not had 3 rated members for that long bounds nothing (a small swarm of mixed hardware: one member's
    rate is no measure of another's)."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self.last: VisibleWork | None = None
        self.seen_at = -math.inf

    def measure(self, rates: Iterable[tuple[float, float]], now: float) -> VisibleWork:
        work = visible_work(rates)
        if work.tokens_per_step > 0:
            self.last, self.seen_at = work, now
            return work
        if self.last is not None and now - self.seen_at <= self.keep_s:
            return self.last
        return work


def check_counters(
    c_steps: int,
    c_tokens: int,
    sender_steps_per_s: float,
    elapsed_s: float,
    work: VisibleWork,
    factor: float,
    sync_every: int,
    sender_tokens_per_step: float = 0.0,
) -> None:
    """Raise ``bad_counters`` when a contribution claims more work than the swarm can see its sender do
    (``factor`` 0: no bound). ``elapsed_s``: seconds since the sender's last merged contribution of this
    fragment, or since this node first heard of the sender. ``sender_tokens_per_step``: what the sender's
    own record publishes (its tokens per second over its steps per second; 0.0: none yet)."""
    if c_steps <= 0 or c_tokens <= 0:  # before any bound, which divides by them
        raise ProtocolError(
            RejectCode.BAD_COUNTERS, f"c_steps={c_steps} c_tokens={c_tokens} must be positive"
        )
    if factor <= 0:
        return
    per_step = c_tokens / c_steps
    if sender_tokens_per_step > 0 and per_step > factor * sender_tokens_per_step:
        raise ProtocolError(
            RejectCode.BAD_COUNTERS,
            f"{per_step:.4g} tokens a step is over {factor:g}x what its sender's record publishes "
            f"({sender_tokens_per_step:.4g})",
        )
    if work.tokens_per_step <= 0:
        return
    if per_step > factor * work.tokens_per_step:
        raise ProtocolError(
            RejectCode.BAD_COUNTERS,
            f"{per_step:.4g} tokens a step is over {factor:g}x the members' median "
            f"({work.tokens_per_step:.4g})",
        )
    rate = min(sender_steps_per_s or work.steps_per_s, factor * work.steps_per_s)
    allowed = factor * (rate * max(0.0, elapsed_s) + sync_every)
    if c_steps > allowed:
        raise ProtocolError(
            RejectCode.BAD_COUNTERS,
            f"{c_steps} steps in {elapsed_s:.0f} s is over what {rate:.3g} steps/s allows "
            f"({allowed:.0f} with {factor:g}x slack)",
        )
