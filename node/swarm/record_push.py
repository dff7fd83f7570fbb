"""Pushing a new merge record to the members that need it first (its contributors, the fragment's next
synchronisers); the rest learn its head from membership records and fetch it. ``RecordPush`` is a part the
node owns (``Node.record_push``, made with its transport when the node runs); the record logic
(``node.swarm.replication``) hands it each record this node makes."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from node.swarm.transport import TransportError
from node.swarm.wire import SignedRecord

if TYPE_CHECKING:
    from dht.records import Member
    from node.swarm.settings import NodeSettings
    from node.swarm.transport import Transport

logger = logging.getLogger(__name__)
# Members a new record is pushed to beyond its contributors (who adopt it) and the fragment's next
# synchronisers: the rest learn its head from the maker's membership record and fetch it by catch-up. Pushed
# to every member, a record cost O(members) streams: beside 2,000 records with no process behind them, the
# pushes took a third of a node's time and its status took 13-30 s to answer.
RECORD_FANOUT = 16


class RecordPush:
    """Whom each record goes to, and the pushes themselves, over the node's transport.

    What it reads of the swarm comes from the node's membership view: ``live_members`` (peer id -> record,
    this node's own among them), ``workers`` (of fragment p, those of the given members whose work was
    merged here: ``SwarmView.workers``), ``candidates`` (fragment p's synchroniser and its failovers, in
    order) and ``suspect`` (peer id -> until when it is under suspicion, on the monotonic clock), the node's
    own dict."""

    def __init__(
        self,
        transport: Transport,
        settings: NodeSettings,
        peer_id: str,
        suspect: dict[str, float],
        live_members: Callable[[], dict[str, Member]],
        workers: Callable[[int, dict[str, Member]], dict[str, Member]],
        candidates: Callable[[int], list[str]],
        loop_time: Callable[[], float],
    ) -> None:
        self.transport = transport
        self.settings = settings
        self.peer_id = peer_id
        self.suspect = suspect
        self.live_members = live_members
        self.workers = workers
        self.candidates = candidates
        self.loop_time = loop_time
        self._took_s: dict[int, float] = {}  # how long the last record push of each fragment took

    def targets(self, p: int, sr: SignedRecord) -> list[str]:
        """Whom a record of fragment p goes to: every reachable member (in a public swarm, every one whose work
        was merged here, once this node can tell) while they are at most ``RECORD_FANOUT``; past that its
        contributors and the next 4 candidates of p, and a random sample of the others not under suspicion,
        up to ``RECORD_FANOUT`` in all."""
        members = self.live_members()
        reach = {pid for pid, m in members.items() if pid != self.peer_id and not m.client_mode}
        if self.settings.elect_workers:
            # identities whose work was never merged here take no push (``SwarmView.workers``): beside 64
            # Sybils the sample of the rest was nearly all Sybils, so an honest node left out of a record
            # waited to pull it, sent its next contribution on a stale base, and merges took 3.7 learners of
            # 6 instead of 5.7 (bench/attacks.py --attacks sybil)
            reach = set(self.workers(p, {q: members[q] for q in reach}))
        if len(reach) <= RECORD_FANOUT:
            return sorted(reach)
        targets = {c[0] for c in sr.record.contributors} & reach
        targets |= set([c for c in self.candidates(p) if c != self.peer_id][:4]) & reach
        now = time.monotonic()
        rest = sorted(pid for pid in reach - targets if self.suspect.get(pid, 0.0) <= now)
        return sorted(targets) + random.sample(rest, min(len(rest), max(0, RECORD_FANOUT - len(targets))))

    async def broadcast(self, p: int, sr: SignedRecord) -> None:
        t0 = self.loop_time()
        await asyncio.gather(*(self.push(pid, sr.raw) for pid in self.targets(p, sr)))
        self._took_s[p] = self.loop_time() - t0

    def last_s(self, p: int) -> float:
        """How long the last push of a record of fragment p took (0 before the first)."""
        return self._took_s.get(p, 0.0)

    async def push(self, pid: str, raw: bytes) -> None:
        try:
            reply = await self.transport.call(pid, "record", raw, timeout_s=self.settings.rpc_timeout_s)
            if not reply.ok:
                logger.info("record refused by %s: %s %s", pid, reply.code, reply.message)
        except TransportError as e:
            logger.info("record push to %s failed: %s", pid, e)
