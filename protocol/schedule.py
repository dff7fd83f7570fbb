"""The swarm's round schedule: when round r of fragment p is due (docs/design.md, section 1, "Rounds
belong to the swarm").

No fixed synchroniser owns a step counter here, so the schedule is carried by the replicated merge records.
Each record of round r of fragment p names the moment the round was taken (``due``) and the swarm's step
period at that moment (``period``, the median step time of the live learners). Round r + 1 is then due at
``due + H * period``: every node that holds record r derives the same moment, whoever signed it and
whichever node has died since. A round that does not merge in time is due again every ``H * period``
after that (the slots of ``RoundClock``), so a round whose synchroniser died is taken again by the next one.

Before a fragment's first record (start-up), or on a node that holds a fragment by snapshot with no clock,
the fragment takes the slot the stagger gives it from the clocked fragment just before it in the stagger
(``swarm_clocks``): its offset in steps (``FragmentPlan``) after that fragment's last round. So a node that
joins while the swarm is starting contributes every fragment with the others, not at its own step count (a
learner that starts 20 steps after the first one would otherwise send fragment p 20 steps after the
round of p that the first one opened, and that round, merged without it, overwrites its work). With no clock
anywhere (the swarm's first steps, or records that carry no period yet) learners go by their own step
count (``FragmentPlan.due``). The first record of a fragment starts its own chain.

A learner contributes fragment p at the end of its last step before a slot: after the step that ends at
``end`` when the next one would end past the slot, ``end + step_s`` (``RoundClock.slot_at``). The
synchroniser then holds every learner's contribution at the slot, unless a step ran long, and the grace
window after the slot is left for those. (Contributing at the step end *nearest* the slot, as before, put
half the learners up to half a step after it; with the heavy tail of step times on a shared host, 3-4% of
contributions then missed their round.)
Pure: times are arguments, in seconds of whatever clock the driver shares with its peers (the node: the
wall clock; the in-process runner: virtual time).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from protocol.fragments import FragmentPlan

MIN_PERIOD_S = 1e-3  # a step period outside these bounds is not a learner's: clamp (a record may lie)
MAX_PERIOD_S = 3600.0


@dataclass(frozen=True)
class RoundClock:
    """When ``round`` of one fragment is due: at ``first`` and again every ``every`` seconds until it merges."""

    round: int
    first: float
    every: float

    def slot_at(self, now: float, lead: float = 0.0) -> int | None:
        """The index of the newest slot at or before ``now + lead``; None before the first one."""
        t = now + lead
        if t < self.first:
            return None
        return int(math.floor((t - self.first) / self.every))

    def slot_time(self, k: int) -> float:
        return self.first + k * self.every


def usable(clock: RoundClock | None, now: float) -> RoundClock | None:
    """``clock``, unless its first slot is more than two repeats ahead of ``now`` (a record written on a
    clock far ahead of ours, or a lie): then None, and the learners go by their steps until a sane one."""
    if clock is None or clock.first > now + 2 * clock.every:
        return None
    return clock


def sane_clock(clock: RoundClock | None, sync_every: int) -> RoundClock | None:
    """A clock received from a peer (a snapshot's) with its repeat held to ``sync_every`` periods of the
    bounds every record's period is held to; None for one that is not finite."""
    if clock is None or not (math.isfinite(clock.first) and math.isfinite(clock.every)):
        return None
    return RoundClock(clock.round, clock.first, sync_every * clamp_period(clock.every / sync_every))


def clamp_period(period: float) -> float:
    if not math.isfinite(period) or period <= 0:
        return MIN_PERIOD_S
    return min(MAX_PERIOD_S, max(MIN_PERIOD_S, period))


def next_clock(
    round_: int, due: float, period: float, sync_every: int, before: RoundClock | None = None
) -> RoundClock | None:
    """The clock of the round after record ``round_`` (taken at ``due`` with step ``period``); None when the
    record carries no schedule (``period`` 0: written before the schedule existed, or by a node that had
    measured no learner's speed yet). ``before``: the clock the record's round had; every replica holds
    the record's period within ``PERIOD_STEP`` of it, as its writer should have."""
    if not period > 0 or not math.isfinite(due):
        return None
    p = bounded_period(clamp_period(period), before, sync_every)
    return RoundClock(round_ + 1, due + sync_every * p, sync_every * p)


def swarm_clocks(
    clocks: Sequence[RoundClock | None], rounds: Sequence[int], plan: FragmentPlan, now: float
) -> list[RoundClock | None]:
    """Every fragment's clock: its own (``clocks[p]``, from its records), or for a fragment with none, the
    slot of its round ``rounds[p] + 1`` that the stagger gives it after the last round of the clocked
    fragment just before it in the stagger (the fewest steps back, then the lowest index: the same on
    every node that holds the same records), at that fragment's period. Only a clock ``usable`` at
    ``now`` gives slots: one far ahead (a lie) does not drag the others along. None for all when no
    fragment has such a clock.

    The reference is fixed per fragment, so the slot it gives moves once per round of the reference, by
    about a repeat, and comes a fraction of a repeat after that reference's last round. (Taking the
    fragment whose clock is newest instead changed the reference at every record anywhere; while the
    fragments' phases still disagreed after the start-up, each change pushed the slot a little further
    ahead, and one fragment went 60-90 s without a slot in chaos runs.)"""
    if all(c is not None for c in clocks):
        return list(clocks)
    h = plan.sync_every
    known = [q for q, c in enumerate(clocks) if usable(c, now) is not None]
    if not known:
        return list(clocks)
    out: list[RoundClock | None] = []
    for p, c in enumerate(clocks):
        if c is None:
            off = plan.fragments[p].offset
            ref_q = min(known, key=lambda q: ((off - plan.fragments[q].offset) % h, q))
            ref = clocks[ref_q]
            d = (off - plan.fragments[ref_q].offset) % h
            c = RoundClock(rounds[p] + 1, ref.first - ref.every + d * (ref.every / h), ref.every)
        out.append(c)
    return out


STEER = 0.5  # a record's period moves at most this share of itself to bring its fragment back in the stagger
STEER_GAIN = 0.75  # ... three quarters of the way: the anchor moves on too, by its own measure of the pace


def steered_period(
    period: float, due: float, p: int, clocks: Sequence[RoundClock | None], plan: FragmentPlan
) -> float:
    """The period a synchroniser writes into the record of fragment p's round taken at ``due``: ``period``,
    moved (by at most ``STEER`` of it) so that the next round comes nearer fragment p's place in the
    stagger: its offset after a slot of the lowest fragment with a clock, the anchor (``clocks``: every
    fragment's, as ``swarm_clocks`` gives them), which itself is not steered. (Steering each fragment after
    the one before it instead has no fixed point from a bunch: the gaps, measured round the ring to the
    nearest cycle, sum to nothing, and the bunch travels on together.)

    Each fragment's rounds follow their own chain (the next due ``H * period`` after this one), so when the
    swarm's pace changes the chains drift apart unevenly: at 124M the first steps took 12 s and the later
    ones 5.5 s, rounds taken early were spaced by the slow period, the later ones caught up, and for the rest
    of the run seven fragments fell due within one step, together, instead of one a step (each learner
    snapshotting, and each node applying, seven fragments at once: the node's memory peaks). Every replica
    reads the steered period from the signed record; no one re-derives it."""
    h = plan.sync_every
    q = next((q for q, c in enumerate(clocks) if c is not None), p)
    if q == p or not period > 0 or not math.isfinite(due):
        return period
    ref = clocks[q]
    natural = due + h * period
    target = ref.first + (plan.fragments[p].offset - plan.fragments[q].offset) * ref.every / h
    target += round((natural - target) / ref.every) * ref.every  # the slot of the cycle nearest our own
    want = (natural + STEER_GAIN * (target - natural) - due) / h
    return min(period * (1 + STEER), max(period * (1 - STEER), want))


def round_due(clock: RoundClock | None, first_arrival: float) -> float:
    """The moment a synchroniser writes into the record of the round it merges: the slot of ``clock``
    nearest to the round's first contribution (learners send in the step before a slot), or that
    contribution's own time when no clock is known (the first round), or when the round came more than
    half a repeat before its first slot: then it was not taken on this clock (its learners had none yet
    and sent by their steps), and writing the slot ahead would put the fragment's next round a whole
    repeat later than the learners' work, and the one after that further still, each round it happens."""
    if clock is None or first_arrival < clock.first - clock.every / 2:
        return first_arrival
    if first_arrival <= clock.first:
        return clock.first
    k = round((first_arrival - clock.first) / clock.every)
    return clock.slot_time(int(k))


def swarm_period(step_times: Iterable[float], fallback: float) -> float:
    """The swarm's step period: the median of the live learners' step times (seconds per step). A median,
    so one learner that lies about its speed cannot move the schedule; ``fallback`` when none is known."""
    xs = [t for t in step_times if math.isfinite(t) and t > 0]
    return clamp_period(statistics.median(xs) if xs else fallback)


PERIOD_STEP = 2.0  # a record's period stays within this factor of the one before it
RATE_MIN_STEPS = 8  # a learner's step rate counts once this many of its step ends are measured
RATE_WINDOW = 64  # ... over its last this many
PHASE_EVERY = 4  # steps between two checks that a learner is in phase with the swarm's schedule


def measured_period(ends: Sequence[float]) -> float:
    """Seconds per step over a learner's last step ends (``RATE_WINDOW``, oldest first); 0 until
    ``RATE_MIN_STEPS`` are in: a learner's first steps (start-up, a join's download) are no measure of its
    pace, and a schedule made of them would put the next rounds minutes out."""
    ends = list(ends)[-RATE_WINDOW:]
    if len(ends) < RATE_MIN_STEPS or ends[-1] <= ends[0]:
        return 0.0
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def averaged_step_s(previous: float | None, step_s: float, restart: bool) -> float:
    """A learner's step time as its contributions report it: a moving average (0.9 / 0.1) of its steps,
    restarted (``restart``) at a life's second step, which replaces the first's warm-up (allocations,
    kernel selection) rather than averaging with it."""
    return step_s if previous is None or restart else 0.9 * previous + 0.1 * step_s


def record_period(
    step_times: Iterable[float], clock: RoundClock | None, sync_every: int, reported: Iterable[float]
) -> float:
    """The step period a synchroniser writes into the record of a round it merges: the median of the live
    learners' measured step times (``step_times``, 0 for one not measured yet), held within
    ``PERIOD_STEP`` of the fragment's clock and of the step times the round's contributors reported
    (``reported``). With none measured: the clock's period, or 0 with no clock (the record then carries no
    schedule, and the learners go by their own steps until a record that has one)."""
    xs = [t for t in step_times if math.isfinite(t) and t > 0]
    if not xs:
        return clock.every / sync_every if clock is not None else 0.0
    period = bounded_period(swarm_period(xs, fallback=0.0), clock, sync_every)
    # a first period (no clock to hold it to) taken from rates measured over a slow start cannot throw
    # the round minutes out
    return held_to_steps(period, reported)


def bounded_period(period: float, clock: RoundClock | None, sync_every: int) -> float:
    """``period`` held within ``PERIOD_STEP`` of the period the fragment's last record set (``clock``): the
    schedule follows the learners' speed but no single measure (a learner's warm-up, a glitch, a lie)
    can throw a fragment's next round minutes away."""
    if clock is None:
        return period
    prev = clamp_period(clock.every / sync_every)
    return min(prev * PERIOD_STEP, max(prev / PERIOD_STEP, period))


def held_to_steps(period: float, step_times: Iterable[float]) -> float:
    """``period`` within ``PERIOD_STEP`` of the median step time the round's contributors reported."""
    xs = [t for t in step_times if math.isfinite(t) and t > 0]
    if not xs:
        return period
    ref = statistics.median(xs)
    return min(ref * PERIOD_STEP, max(ref / PERIOD_STEP, period))


def record_timing(
    p: int,
    clocks: Sequence[RoundClock | None],
    taken_at: float,
    step_times: Iterable[float],
    reported: Iterable[float],
    sync_every: int,
    plan: FragmentPlan,
) -> tuple[float, float]:
    """The ``(due, period)`` a synchroniser writes into the record of fragment p's round, taken at
    ``taken_at`` (its quorum's moment, or its first contribution's): the slot of p's clock nearest to it
    (``round_due``), and the live learners' measured step period (``step_times``) held to the clock and to
    the contributors' ``reported`` step times (``record_period``), steered toward p's place in the stagger
    (``steered_period``). ``clocks``: every fragment's, as ``swarm_clocks`` gives them. The node and the
    in-process runner both write their records by this rule."""
    due = round_due(clocks[p], taken_at)
    period = record_period(step_times, clocks[p], sync_every, reported)
    return due, steered_period(period, due, p, clocks, plan)


def aligned_step(target: float | None, step_s: float | None) -> tuple[int, float] | None:
    """A learner's first alignment to the swarm's schedule, after its life's first step: the step number its
    peers start next (``target``: where they are, fractions included; None while none has stepped) and how
    long to wait, at most 2 s, until they start it."""
    if target is None:
        return None
    nxt = math.ceil(target)
    return nxt, min(2.0, (nxt - target) * (step_s or 0.0))


def in_phase_step(target: float | None, step: int) -> int | None:
    """Where a learner at ``step`` moves its schedule when half a step or more behind its peers'
    (``target``): forward to theirs, never back; None where it stays."""
    if target is None or target - step < 0.5:
        return None
    return step + round(target - step)


@dataclass
class SlotBook:
    """A learner's record of the slots it has contributed to, per fragment: a slot is taken once.

    A slot is known by its round and its *time*, not its index: before a fragment's first record its
    clock is the stagger's from another fragment (``swarm_clocks``), re-anchored at each new round of that
    fragment, so the same slot series restarts its indices at every record of the reference. Slots of one
    round less than half a repeat apart are the same slot (periods move a little from record to record)."""

    taken: dict[int, tuple[int, float]]

    def __init__(self) -> None:
        self.taken = {}

    def due(self, p: int, clock: RoundClock | None, now: float, lead: float) -> bool:
        """True (and marks it taken) when fragment p has a slot up at ``now + lead`` not yet contributed."""
        if clock is None:
            return False
        k = clock.slot_at(now, lead)
        if k is None:
            return False
        at = clock.slot_time(k)
        round_, last = self.taken.get(p, (-1, -math.inf))
        if clock.round < round_ or (clock.round == round_ and at <= last + clock.every / 2):
            return False
        self.taken[p] = (clock.round, at)
        return True

    def reset(self) -> None:
        self.taken.clear()

    def forget(self, p: int) -> None:
        """Fragment p's chain was replaced by another, whose round may be lower than the slots taken on the
        old one: those must not hold its slots back. (They did: three nodes that each yielded fragment 0 to
        an older head of the majority's chain, 21 rounds back, never contributed to it again, and it
        merged nothing for the rest of the run.)"""
        self.taken.pop(p, None)


def due_fragments(
    slots: SlotBook, clocks: Iterable[RoundClock | None], by_steps: Iterable[int], end: float, step_s: float
) -> list[int]:
    """The fragments a learner takes at a step ending at ``end`` (the next one expected to take ``step_s``):
    each whose clock has a slot before the next step's end that ``slots`` has not taken (and marks it),
    and, for a fragment with no clock (before its first record), the learner's own step count's
    (``by_steps``). One rule for the node and the runner."""
    by_steps = set(by_steps)
    return [
        p
        for p, clock in enumerate(clocks)
        if (p in by_steps if clock is None else slots.due(p, clock, end, step_s))
    ]
