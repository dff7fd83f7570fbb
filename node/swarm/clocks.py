"""The swarm's schedule as this node reads it (``protocol.schedule``): each fragment's round clock, and when
its open round is due on this node's event loop. A mixin of ``node.swarm.agent.Node``
(``node.swarm.replication``, ``node.swarm.contributions`` and ``node.swarm.watch`` read it)."""

from __future__ import annotations

import time

from protocol.schedule import RoundClock, swarm_clocks, usable
from protocol.synchroniser import scheduled


class Clocks:
    def clocks(self) -> list[RoundClock | None]:
        """Each fragment's round clock on the swarm's schedule: its own, or before its first record the
        stagger's slot (``protocol.schedule.swarm_clocks``). Unchecked against now (``usable``)."""
        reps = self.replicas
        return swarm_clocks([r.clock for r in reps], [r.round for r in reps], self.plan, time.time())

    def _schedule_unclocked(self) -> None:
        """A record gave the swarm a newer clock: the idle rounds of fragments with none of their own take
        the stagger's slot from it."""
        if all(rep.clock is not None for rep in self.replicas):
            return  # past start-up: every fragment has its own
        clocks = self.clocks()
        for p, rep in enumerate(self.replicas):
            if rep.clock is None:
                self.syncs[p] = scheduled(self.syncs[p], self._schedule_of(p, clocks[p]))

    def _schedule_of(self, p: int, clock: RoundClock | None = None) -> tuple[float, float] | None:
        """When fragment p's open round is due on the swarm's schedule (``clock``, or its own or the
        stagger's), on this loop's clock (the state machines run on it; the schedule is on the wall clock
        every node shares), and its repeat period."""
        now = time.time()
        c = usable(clock if clock is not None else self.clocks()[p], now)
        if c is None:
            return None
        return c.first - now + self.loop.time(), c.every
