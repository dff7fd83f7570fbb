"""A block of chips in virtual time: its failure and slowdown clocks, its chips away for repair.

Shared by both drivers (``sim.engine`` for the data-parallel systems, ``sim.decoupled`` for learners). A
clock is an exponential budget in "expected events": a group of n chips running for d seconds spends
n * d / mtbi of it, and the event happens where the budget runs out. This is exact for exponential
failures (the superposition of n exponential clocks is one of rate n / mtbi), and it lets the group's size
change between steps without redrawing anything.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from sim.accounting import RecordSink, Tally
from sim.model import SimConfig


@dataclass
class Counts:
    """What a driver counts besides goodput."""

    failures: int = 0
    steps: int = 0
    merges: int = 0
    rejected: int = 0


class Block:
    """Chips that step together, in hosts of ``host`` chips (the last one may be smaller). A failed chip
    takes its host out; ``away`` maps such a host to when it (or its replacement) is ready again."""

    __slots__ = (
        "index",
        "chips",
        "host",
        "factor",
        "away",
        "returns",
        "away_chips",
        "down_at",
        "hazard",
        "slow_hazard",
        "slow_until",
    )

    def __init__(self, index: int, chips: int, host: int, factor: float, rng: random.Random) -> None:
        self.index = index
        self.chips = chips
        self.host = max(1, min(host, chips))
        self.factor = factor
        self.away: dict[int, float] = {}
        self.returns: list[tuple[float, int]] = []  # heap of (ready, host) for the hosts in ``away``
        self.away_chips = 0
        self.down_at: dict[int, float] = {}
        self.hazard = rng.expovariate(1.0)
        self.slow_hazard = rng.expovariate(1.0)
        self.slow_until = -math.inf

    @property
    def present(self) -> int:
        return self.chips - self.away_chips

    def host_chips(self, h: int) -> range:
        return range(h * self.host, min(self.chips, (h + 1) * self.host))

    def away_slots(self) -> set[int]:
        """Chip slots of the hosts that are away (for per-chip records)."""
        return {i for h in self.away for i in self.host_chips(h)}


def make_blocks(cfg: SimConfig, rng: random.Random) -> list[Block]:
    return [Block(m, n, cfg.host_chips, cfg.block_factor(m), rng) for m, n in enumerate(cfg.block_chips())]


def step_factor(cfg: SimConfig, rng: random.Random, blk: Block, t: float) -> float:
    """This step's time multiplier: the block's speed, a transient slowdown if one is on, and jitter."""
    f = blk.factor
    if t < blk.slow_until:
        f *= cfg.slowdown_factor
    if cfg.jitter:
        f *= 1.0 + rng.uniform(-cfg.jitter, cfg.jitter)
    return f


def advance_slowdowns(cfg: SimConfig, rng: random.Random, blk: Block, t: float, d: float) -> None:
    """Spend the slowdown clock over a step [t, t + d]; a slowdown that starts in it slows later steps."""
    if math.isinf(cfg.slowdown_mtbi_s) or blk.present == 0:
        return
    rate = blk.present / cfg.slowdown_mtbi_s
    rem = rate * d
    while blk.slow_hazard <= rem:
        rem -= blk.slow_hazard
        start = t + d - rem / rate
        blk.slow_until = max(blk.slow_until, start + cfg.slowdown_s)
        blk.slow_hazard = rng.expovariate(1.0)
    blk.slow_hazard -= rem


def failure_in(cfg: SimConfig, hazard: float, present: int, t: float, d: float) -> float | None:
    """When, within the step [t, t + d], ``present`` running chips with this much clock left fail."""
    if present == 0 or math.isinf(cfg.mtbi_s):
        return None
    spend = present * d / cfg.mtbi_s
    return t + hazard * cfg.mtbi_s / present if hazard <= spend else None


def spend(cfg: SimConfig, hazard: float, present: int, d: float) -> float:
    return hazard if math.isinf(cfg.mtbi_s) else hazard - present * d / cfg.mtbi_s


def pick_host(rng: random.Random, blk: Block) -> int:
    """The host of a uniformly chosen present chip (hosts away are few next to the block: O(1))."""
    while True:
        h = rng.randrange(blk.chips) // blk.host
        if h not in blk.away:
            return h


def fail_host(blk: Block, h: int, t: float, ready: float, rec: RecordSink | None) -> None:
    blk.away[h] = ready
    heapq.heappush(blk.returns, (ready, h))
    blk.away_chips += len(blk.host_chips(h))
    blk.down_at[h] = t
    if rec is not None:
        for i in blk.host_chips(h):
            rec.down(blk.index, i, t)


def return_hosts(blk: Block, t: float, tally: Tally, rec: RecordSink | None) -> None:
    """Hosts ready by t join the block at this step boundary."""
    while blk.returns and blk.returns[0][0] <= t:
        _, h = heapq.heappop(blk.returns)
        del blk.away[h]
        n = len(blk.host_chips(h))
        blk.away_chips -= n
        tally.down_s += n * (t - blk.down_at.pop(h))
        if rec is not None:
            for i in blk.host_chips(h):
                rec.up(blk.index, i, t)


def seed_repairs(
    cfg: SimConfig, rng: random.Random, blk: Block, rec: RecordSink | None, group_chips: int
) -> None:
    """Start an elastic group in its steady state: the hosts that failed in the last ``repair_s`` before
    the run began are still away, so a run of any length sees the long-run share of chips out for repair.
    They count as down from t = 0. Failures come only while the group runs, which is 1 / (1 + g * resize_s)
    of the time for a group (``group_chips``: the whole elastic job, or one learner) failing at rate g, so
    the block's hosts fail as a Poisson process of rate (chips / mtbi) / (1 + g * resize_s)."""
    if math.isinf(cfg.mtbi_s) or cfg.repair_s == 0:
        return
    rate = blk.chips / cfg.mtbi_s / (1.0 + group_chips / cfg.mtbi_s * cfg.resize_s)
    s = -cfg.repair_s + rng.expovariate(rate)
    while s < 0 and blk.away_chips + blk.host < blk.chips:
        fail_host(blk, pick_host(rng, blk), 0.0, s + cfg.repair_s, rec)
        s += rng.expovariate(rate)


def pause(blk: Block, t0: float, t1: float, tally: Tally, rec: RecordSink | None) -> None:
    """The block's present chips wait from t0 to t1 (clipped by the caller to the end of the run)."""
    if t1 > t0:
        tally.blocked_s += blk.present * (t1 - t0)
        if rec is not None:
            rec.pause(blk.index, t0, t1, blk.away_slots())


def close_downs(blocks: list[Block], end_s: float, tally: Tally) -> None:
    """Chips still away at the end were down until the end (as ``compute_goodput`` counts them)."""
    for blk in blocks:
        for h, t in blk.down_at.items():
            tally.down_s += len(blk.host_chips(h)) * (end_s - t)
