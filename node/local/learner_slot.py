"""One learner of the in-process runner (``node.local.runner``) as a node sees it: its plan, its inbox and
blocking state, what a node measures of its pace, and the node's rules that keep its fragment schedule in
phase with its peers, the node's (``node.learner.loop``) by the same functions
(``protocol.schedule.aligned_step``, ``in_phase_step``)."""

from __future__ import annotations

import random
from collections import deque

from node.common.events import EventLog
from node.learner.learner import Learner
from node.local.run_config import LearnerPlan
from protocol.schedule import (
    RATE_WINDOW,
    SlotBook,
    aligned_step,
    averaged_step_s,
    in_phase_step,
    measured_period,
)


class LearnerSlot:
    def __init__(self, learner: Learner, plan: LearnerPlan, seed: int) -> None:
        self.learner = learner
        self.plan = plan
        self.rng = random.Random(seed)
        self.down = False
        self.blocked_since: float | None = None
        self.awaiting: dict[int, tuple[str, int]] = {}  # fragment -> (cid, step by which it must be back)
        # Fragments whose rounds count on this learner. A learner back after a failure is waited for on
        # fragment p only from its first contribution of p: rounds already under way must not stall for it.
        self.members_of: set[int] = set()
        self.inbox: list[tuple[int, int, dict, list]] = []  # (fragment, round, theta, merged of its own)
        self.slots = SlotBook()  # the schedule's slots it has contributed to
        self.fresh_process()

    def fresh_process(self) -> None:
        """What a node measures of its learner's pace, as a new process does: its step ends (the rate its
        membership record publishes) and its step time's moving average (what its contributions report),
        the first step of a life replaced by the second (warm-up)."""
        self.ends: deque = deque(maxlen=RATE_WINDOW)
        self.step_s: float | None = None
        self.first_step = self.learner.steps

    def measure(self, start: float, end: float) -> None:
        self.ends.append(end)
        self.step_s = averaged_step_s(self.step_s, end - start, self.learner.steps == self.first_step + 2)


def live_set(slots: list[LearnerSlot], p: int) -> frozenset[str]:
    """Learners that fragment p's synchroniser waits for: up, and (after a rejoin) back in p's rhythm."""
    return frozenset(s.learner.name for s in slots if not s.down and p in s.members_of)


def swarm_step(slots: list[LearnerSlot], me: LearnerSlot, t: float) -> float | None:
    """Where the fragment schedules of ``me``'s peers are at ``t``, in steps: the furthest one's steps done,
    extrapolated at its measured rate (none until it has one), as a node reads its peers' membership
    records (there a heartbeat old). None while no peer has finished a step."""
    out = []
    for x in slots:
        if x is me or x.down or not x.ends:
            continue
        done, last = x.learner.book.step, x.ends[-1]
        if t < last:  # its step in progress is counted in book.step already
            done, last = done - 1, x.ends[-2] if len(x.ends) > 1 else last
        period = measured_period(x.ends)
        if done > 0:
            out.append(done + (max(0.0, t - last) / period if period > 0 else 0.0))
    return max(out, default=None)


def align(slots: list[LearnerSlot], me: LearnerSlot, t: float, events: EventLog) -> float:
    """After a life's first step: take the step number the peers start next, and wait (at most 2 s, once)
    until they start it. Returns the wait."""
    aligned = aligned_step(swarm_step(slots, me, t), me.step_s)
    if aligned is None:
        return 0.0
    nxt, wait = aligned
    before, me.learner.book.step = me.learner.book.step, nxt
    events.emit("align", t=t, learner=me.learner.name, before=before, after=nxt, wait_s=wait)
    return wait


def keep_in_phase(slots: list[LearnerSlot], me: LearnerSlot, t: float, events: EventLog) -> None:
    """A learner half a step or more behind its peers' schedule moves its own forward to it."""
    book = me.learner.book
    after = in_phase_step(swarm_step(slots, me, t), book.step)
    if after is None:
        return
    before, book.step = book.step, after
    events.emit("align", t=t, learner=me.learner.name, before=before, after=book.step, wait_s=0.0)
