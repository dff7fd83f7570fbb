"""Pushing a new merge record to the members that need it first (its contributors, the fragment's next
synchronisers); the rest learn its head from membership records and fetch it. A mixin of
``node.swarm.agent.Node``, through ``node.swarm.replication.Replication``."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from node.swarm.transport import TransportError
from node.swarm.wire import SignedRecord

logger = logging.getLogger(__name__)
# Members a new record is pushed to beyond its contributors (who adopt it) and the fragment's next
# synchronisers: the rest learn its head from the maker's membership record and fetch it by catch-up. Pushed
# to every member, a record cost O(members) streams: beside 2,000 records with no process behind them, the
# pushes took a third of a node's time and its status took 13-30 s to answer.
RECORD_FANOUT = 16


class RecordPush:
    def _record_targets(self, p: int, sr: SignedRecord) -> list[str]:
        """Whom a record of fragment p goes to: every reachable member (in a public swarm, every one whose work
        was merged here, once this node can tell) while they are at most ``RECORD_FANOUT``; past that its
        contributors and the next 4 candidates of p, and a random sample of the others not under suspicion,
        up to ``RECORD_FANOUT`` in all."""
        members = self.live_members()
        reach = {pid for pid, m in members.items() if pid != self.peer_id and not m.client_mode}
        if self.settings.elect_workers:
            # identities whose work was never merged here take no push (``SwarmView._workers``): beside 64
            # Sybils the sample of the rest was nearly all Sybils, so an honest node left out of a record
            # waited to pull it, sent its next contribution on a stale base, and merges took 3.7 learners of
            # 6 instead of 5.7 (bench/attacks.py --attacks sybil)
            reach = set(self._workers(p, {q: members[q] for q in reach}))
        if len(reach) <= RECORD_FANOUT:
            return sorted(reach)
        targets = {c[0] for c in sr.record.contributors} & reach
        targets |= set([c for c in self.candidates(p) if c != self.peer_id][:4]) & reach
        now = time.monotonic()
        rest = sorted(pid for pid in reach - targets if self.suspect.get(pid, 0.0) <= now)
        return sorted(targets) + random.sample(rest, min(len(rest), max(0, RECORD_FANOUT - len(targets))))

    async def _broadcast(self, p: int, sr: SignedRecord) -> None:
        t0 = self.loop.time()
        await asyncio.gather(*(self._push(pid, sr.raw) for pid in self._record_targets(p, sr)))
        self._push_s[p] = self.loop.time() - t0

    async def _push(self, pid: str, raw: bytes) -> None:
        try:
            reply = await self.transport.call(pid, "record", raw, timeout_s=self.settings.rpc_timeout_s)
            if not reply.ok:
                logger.info("record refused by %s: %s %s", pid, reply.code, reply.message)
        except TransportError as e:
            logger.info("record push to %s failed: %s", pid, e)
