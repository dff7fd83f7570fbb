"""A synchroniser's intake: the checks a contribution passes before the pure core sees it (``Intake.accept``),
and the dead list a sender names, believed only for peers that are down here too (a ping, or this node's own
evidence of a stalled round)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable

from node.swarm.deadlines import STALL_PERIODS
from node.swarm.transport import Reply, TransportError
from node.swarm.wire import unpack_signed_contribution, verify_contribution
from protocol.audit import frozen_view
from protocol.errors import ProtocolError, RejectCode
from protocol.messages import ContributionHeader, decode_contribution, peek_fragment
from protocol.synchroniser import Contribution, on_contribution
from protocol.work import WorkMeasure, check_counters

WORK_KEEP_TTLS = 10  # how long (x ttl_s) the members' last rated medians bound counters when a view has fewer
PING_AT_MOST = 4  # peers a synchroniser asks whether they are up before it believes a sender's dead list


class Intake:
    """Takes contributions as fragment p's synchroniser. From the view (``node.swarm.view``): ``known(caller)``
    (a live member; raises ``banned``), ``members()`` and ``live_members()``, ``candidates(p)``,
    ``synchroniser_of(p, dead)``, and ``lease_seen()`` and ``swarm_steps()`` (when each lease was first seen,
    and the swarm's summed steps); from the replication: ``decide(p, decision)`` (a synchroniser's decision
    carried out); ``penalise(peer, code)``; ``clock()``: the event loop's time. ``trust``: the node's
    ``TrustPolicy`` (``node.swarm.trust.policy``), asked at named points: the learner admitted, a resend or a
    replay, a merge under way, the message's digest, the receipt given."""

    def __init__(
        self,
        settings,
        pcfg,
        peer_id: str,
        spec: dict,
        replicas: list,
        syncs: list,
        leases: dict[int, int],
        clocks,
        suspect: dict[str, float],
        trust,
        work,
        counters: dict[str, int],
        events,
        transport,
        *,
        known: Callable[[str], Awaitable[bool]],
        members: Callable[[], dict],
        live_members: Callable[[], dict],
        candidates: Callable[..., list[str]],
        synchroniser_of: Callable[..., str | None],
        lease_seen: Callable[[], dict],
        swarm_steps: Callable[[], int],
        decide: Callable,
        penalise: Callable,
        clock: Callable[[], float],
    ) -> None:
        self.settings, self.pcfg, self.peer_id, self.spec = settings, pcfg, peer_id, spec
        self.replicas, self.syncs, self.leases, self.clocks = replicas, syncs, leases, clocks
        self.suspect, self.trust, self.work = suspect, trust, work
        self.counters, self.events, self.transport = counters, events, transport
        self.known, self.members, self.live_members = known, members, live_members
        self.candidates, self.synchroniser_of = candidates, synchroniser_of
        self.lease_seen, self.swarm_steps = lease_seen, swarm_steps
        self.decide, self.penalise, self.clock = decide, penalise, clock
        self._pings: dict[str, object] = {}  # peer -> when it last answered a ping, or the ping under way
        # the swarm's work rates, a heartbeat late still counting (protocol.work.WorkMeasure)
        self.work_measure = WorkMeasure(WORK_KEEP_TTLS * settings.ttl_s)

    async def accept(self, caller: str, payload: bytes) -> Reply:
        try:
            dead, raw, sig = unpack_signed_contribution(payload)
            p = peek_fragment(raw)
            if p not in self.spec:
                raise ProtocolError(
                    RejectCode.WRONG_FRAGMENT, f"fragment {p} does not exist (0..{len(self.spec) - 1})"
                )
            if not await self.known(caller):
                raise ProtocolError(
                    RejectCode.UNKNOWN_PEER, f"{caller} is not a live member of swarm {self.settings.swarm}"
                )
            # kept in its wire form until the merge decodes it, one tensor at a time (a fragment of 38.6M
            # parameters held 154 MB per contribution decoded, from its receipt to the round's merge)
            h, delta = decode_contribution(raw, self.spec[p], decode=False)
            if h.learner != caller:
                raise ProtocolError(
                    RejectCode.UNKNOWN_PEER, f"contribution claims learner {h.learner}, sent by {caller}"
                )
            verify_contribution(self.settings.swarm, h.learner, raw, sig)
            who = None if self.settings.client_mode else self.synchroniser_of(p, dead)
            if who == self.peer_id and dead:  # the sender's dead list made us the one: check it first
                who = self.synchroniser_of(p, await self.checked_dead(p, dead))
            if who != self.peer_id:
                return self.refuse_role(caller, p, who)
            self.trust.admit_learner(h.learner)  # node.swarm.trust.policy
            if self.trust.resent(h.cid):
                self.events.emit("resent", t=time.time(), peer=caller, fragment=p, cid=h.cid)
                return Reply(True, RejectCode.REPLAYED.value, f"contribution {h.cid} was already merged")
            self.check_work(h)
            # decodes each tensor a range at a time, checks it, lets it go: off the loop (GPT-2's embedding
            # took the loop for a second a contribution); on a view whose norm book is a copy read here
            view = frozen_view(self.replicas[p], merge=True)
            try:
                n = await asyncio.to_thread(view.check_delta, delta, self.pcfg, h.learner)
            finally:  # a size refused as an outlier is still its learner's size now (``check_delta``)
                for learner, rms in view.norms.added:
                    self.replicas[p].norms.add(learner, rms)
            # after every check of the message: a bad one is refused for what it is, merging or not
            rep = self.replicas[p]
            if h.base_round < rep.round and not rep.keeps(h.base_round):
                # a snapshot installed here since (the history starts at it): the merge could not re-anchor
                # it, and a receipt for it is a promise this node cannot keep (``Receipts.renounce``)
                raise ProtocolError(
                    RejectCode.STALE_BASE,
                    f"fragment {p} no longer keeps round {h.base_round} here (now at {rep.round})",
                )
            if (busy := self.trust.busy(caller, p)) is not None:
                return busy
            digest = self.trust.digest(raw, sig)  # the record names it; audits fetch the message by it
            c = Contribution(
                h.learner, p, h.base_round, h.c_steps, h.c_tokens, h.step_time_s, delta, h.cid, n, digest
            )
            binding, receipt = self.trust.binds(caller), b""
            if binding:
                self.trust.check_taken(p, c.learner, c.cid, c.base_round)
            d = on_contribution(self.pcfg, self.syncs[p], c, self.clock())
            if binding:
                if d.state.pending.get((c.learner, c.base_round)) is not c:  # not taken: say so, no ok
                    raise ProtocolError(RejectCode.STALE_BASE, d.reason)
                receipt = self.trust.receipt(p, c.learner, c.cid)
        except ProtocolError as e:
            self.events.emit("reject", t=time.time(), peer=caller, code=e.code.value, why=str(e)[:300])
            if caller == self.peer_id:
                self.transport.count_refusal(e.code.value)
            else:
                self.penalise(caller, e.code)
            return Reply(False, e.code.value, str(e))
        self.trust.accepted(caller)
        self.leases[p] = self.replicas[p].round + 1
        self.counters["contributions_accepted"] += 1
        # when the synchroniser took it in: against the learner's 'contribute', what the link and the checks
        # cost it (``ddiloco replay`` replays each contribution with its own)
        self.events.emit("accept", t=time.time(), fragment=p, learner=h.learner, cid=h.cid, base=h.base_round)
        self.decide(p, d)
        return Reply(True, body=receipt)

    async def checked_dead(self, p: int, dead: set[str]) -> set[str]:
        """A sender's dead list is advice: a peer that stands before this node in fragment p's
        order in our own view is dead only if it does not answer a ping either (or is suspected here).
        Otherwise one contribution sent to every node, each copy naming the others dead, made every node
        the synchroniser of its own round: forks. At most ``PING_AT_MOST`` peers are asked, concurrently."""
        order = self.candidates(p)
        ahead = order[: order.index(self.peer_id)] if self.peer_id in order else order
        named = [q for q in ahead if q in dead and not self.stalled_here(p, q)][:PING_AT_MOST]
        answers = await asyncio.gather(*(self.answers(q) for q in named))
        return dead - {q for q, up in zip(named, answers) if up}

    def stalled_here(self, p: int, q: str) -> bool:
        """This node's own evidence that ``q`` took fragment p's open round and did not merge it: ``q``
        publishes the lease of that round, and ``STALL_PERIODS`` repeats have passed since the round's first
        slot or since this node first saw that lease, whichever is later. (A member that answers pings and
        never merges is passed over by a node whose learner sent it nothing, as by one whose own watch fired.
        Counted from the slot alone, a swarm at rest, whose open round's slot was long past, took the first
        contribution's synchroniser for stalled the moment its lease was read: two nodes took the round.
        And only if the swarm's learners worked two rounds' steps since that sighting (their published steps,
        summed): a round held open below its quorum while every learner was paused is starved, not stalled;
        taken for stalled, a member that held one at rest was passed over unpinged, and two nodes answered
        ``ok`` to one contribution, in CI.)"""
        m, sched = self.members().get(q), self.clocks.due(p)
        r = self.replicas[p].round + 1
        if m is None or sched is None or m.leases.get(str(p)) != r:
            return False
        seen, steps = self.lease_seen().get((q, str(p), r), (math.inf, 0))
        if self.swarm_steps() - steps < STALL_PERIODS * self.pcfg.sync_every:
            return False  # the learners did not work two rounds' steps since: starved (a swarm at rest)
        return self.clock() > max(sched[0], seen) + STALL_PERIODS * sched[1]

    async def answers(self, q: str) -> bool:
        """Whether ``q`` answers a ping (one call per peer at a time, a yes remembered for a heartbeat);
        a peer that does not is suspected for ``ttl_s``, as one that failed a contribution is."""
        mono = time.monotonic()
        if self.suspect.get(q, 0.0) > mono:
            return False
        book = self._pings
        seen = book.get(q)
        if isinstance(seen, float) and mono - seen < self.settings.heartbeat_s:
            return True
        if not isinstance(seen, asyncio.Future) or seen.done():
            seen = book[q] = asyncio.ensure_future(self.ping(q, book))
        return await asyncio.shield(seen)

    async def ping(self, q: str, book: dict) -> bool:
        """Any answer means up (a peer that does not know us yet answers ``unknown_peer``), except
        ``unknown_op`` and ``internal_error``: what a sender fails over on, a member that takes no
        contribution (or a node too old to answer pings, whose dead list was taken as it came)."""
        try:
            reply = await self.transport.call(q, "ping", b"", timeout_s=min(2.0, self.settings.rpc_timeout_s))
            up = reply.code not in (RejectCode.UNKNOWN_OP.value, RejectCode.INTERNAL.value)
        except TransportError:
            up = False
        book[q] = time.monotonic() if up else None
        if not up:
            self.suspect[q] = time.monotonic() + self.settings.ttl_s
        return up

    def check_work(self, h: ContributionHeader) -> None:
        """The counters against what the swarm sees its sender do (``protocol.work``; bad_counters)."""
        now, members = time.monotonic(), self.live_members()
        since = self.work.heard(h.learner, h.fragment, now)
        sender = members.get(h.learner)
        work = self.work_measure.measure(((m.tokens_per_s, m.steps_per_s) for m in members.values()), now)
        rate = sender.steps_per_s if sender is not None else 0.0
        own = (
            sender.tokens_per_s / rate if sender is not None and rate > 0 and sender.tokens_per_s > 0 else 0.0
        )
        f, every = self.pcfg.work_factor, self.pcfg.sync_every
        check_counters(h.c_steps, h.c_tokens, rate, now - since, work, f, every, own)

    def refuse_role(self, caller: str, p: int, who: str | None) -> Reply:
        """Not an error of the sender's: routing views differ for a moment. Not counted as a refusal."""
        msg = f"{self.peer_id} does not hold fragment {p}'s round {self.replicas[p].round + 1}; try {who}"
        return Reply(False, RejectCode.NOT_SYNCHRONISER.value, msg, json.dumps({"try": who}).encode())
