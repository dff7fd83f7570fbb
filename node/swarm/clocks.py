"""The swarm's schedule as this node reads it (``protocol.schedule``): each fragment's round clock, and when
its open round is due on this node's event loop. ``SwarmClocks`` is a part the node owns (``Node.clocks``):
the record logic (``node.swarm.replication``, ``node.swarm.catch_up``), the contribution checks
(``node.swarm.sender``), the merge deadlines and the learner's loop read it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from protocol.schedule import RoundClock, swarm_clocks, usable
from protocol.synchroniser import SyncState, scheduled

if TYPE_CHECKING:
    from protocol.fragments import FragmentPlan
    from protocol.replica import FragmentReplica


class SwarmClocks:
    """Reads the round clocks of the node's replicas (their own, or the stagger's slot before their first
    record), and moves the idle rounds of unclocked fragments onto the schedule a record gave.

    ``replicas`` and ``syncs`` are the node's own lists (one entry per fragment, replaced in place);
    ``loop_time`` is the clock of the loop the state machines run on."""

    def __init__(
        self,
        replicas: Sequence[FragmentReplica],
        plan: FragmentPlan,
        syncs: list[SyncState],
        loop_time: Callable[[], float],
    ) -> None:
        self.replicas = replicas
        self.plan = plan
        self.syncs = syncs
        self.loop_time = loop_time

    def current(self) -> list[RoundClock | None]:
        """Each fragment's round clock on the swarm's schedule: its own, or before its first record the
        stagger's slot (``protocol.schedule.swarm_clocks``). Unchecked against now (``usable``)."""
        reps = self.replicas
        return swarm_clocks([r.clock for r in reps], [r.round for r in reps], self.plan, time.time())

    def schedule_unclocked(self) -> None:
        """A record gave the swarm a newer clock: the idle rounds of fragments with none of their own take
        the stagger's slot from it."""
        if all(rep.clock is not None for rep in self.replicas):
            return  # past start-up: every fragment has its own
        clocks = self.current()
        for p, rep in enumerate(self.replicas):
            if rep.clock is None:
                self.syncs[p] = scheduled(self.syncs[p], self.due(p, clocks[p]))

    def due(self, p: int, clock: RoundClock | None = None) -> tuple[float, float] | None:
        """When fragment p's open round is due on the swarm's schedule (``clock``, or its own or the
        stagger's), on the loop's clock (the state machines run on it; the schedule is on the wall clock
        every node shares), and its repeat period."""
        now = time.time()
        c = usable(clock if clock is not None else self.current()[p], now)
        if c is None:
            return None
        return c.first - now + self.loop_time(), c.every
