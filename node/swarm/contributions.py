"""Contributions, both ends: a learner's outer gradient routed to its fragment's synchroniser with failover
(``_send``), and the synchroniser's acceptance checks before the pure core sees it (``_accept``).

A mixin of ``node.swarm.agent.Node`` (like ``Replication``): it uses the node's
transport, views, peer scores, replicas and synchroniser states, and runs on the node's event loop except for
``post_contribution`` and ``resend``, which the learner thread calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from collections import OrderedDict

from node.swarm.deadlines import STALL_PERIODS
from node.swarm.receipts import parse_retry
from node.swarm.transport import Reply, TransportError
from node.swarm.wire import (
    pack_list,
    parse_redirect,
    sign_contribution,
    unpack_signed_contribution,
    verify_contribution,
)
from protocol.audit import frozen_view
from protocol.errors import ProtocolError, RejectCode
from protocol.messages import (
    ContributionHeader,
    cid_moment,
    decode_contribution,
    encode_contribution,
    peek_fragment,
    sender_tag,
)
from protocol.synchroniser import Contribution, on_contribution
from protocol.work import WorkMeasure, check_counters

logger = logging.getLogger(__name__)
HOLD_BEHIND = 2  # with carry, contributions wait while our fragment is more rounds than this behind
WORK_KEEP_TTLS = 10  # how long (x ttl_s) the members' last rated medians bound counters when a view has fewer
PING_AT_MOST = 4  # peers a synchroniser asks whether they are up before it believes a sender's dead list


class OwnCids:
    """The contribution ids this node sent in this life, to refute a record that claims one it never sent.

    A cid ends with the moment its step ended (ms on the node's wall clock), which grows through the node's
    lives. (It ended with the step number, which a node restored from an older checkpoint steps through
    again: the node then called records naming its own contributions from before the restart forged, and
    its new contributions were refused as replays of old ones.) Ids from before the first one sent in this
    life (a restart) cannot be refuted, nor can ids older than the ``keep`` newest: ``refutes`` says True
    only when it knows."""

    def __init__(self, peer_id: str, keep: int = 65536) -> None:
        self.prefix = f"{sender_tag(peer_id)}:"
        self.keep = keep
        self.sent: OrderedDict[str, None] = OrderedDict()
        self.since: int | None = None  # the moment from which every id we sent is in ``sent``

    moment_of = staticmethod(cid_moment)

    def add(self, cid: str) -> None:
        moment = self.moment_of(cid)
        if moment is None:
            return
        if self.since is None:
            self.since = moment
        self.sent[cid] = None
        while len(self.sent) > self.keep:
            old, _ = self.sent.popitem(last=False)
            self.since = max(self.since, (self.moment_of(old) or 0) + 1)

    def refutes(self, cid: str) -> bool:
        """True when ``cid``, claimed as ours, is one this node knows it never sent."""
        moment = self.moment_of(cid)
        if not cid.startswith(self.prefix) or moment is None:
            return True  # not even of our form
        return self.since is not None and moment >= self.since and cid not in self.sent


class Contributions:
    def _init_contributions(self) -> None:
        """This part's own state (the node's constructor calls it, after ``settings``)."""
        self._pings: dict[str, object] = {}  # peer -> when it last answered a ping, or the ping under way
        # the swarm's work rates, a heartbeat late still counting (protocol.work.WorkMeasure)
        self.work_measure = WorkMeasure(WORK_KEEP_TTLS * self.settings.ttl_s)

    # ---------------------------------------------------------------- contributions (learner side)
    def post_contribution(self, header: ContributionHeader, enc) -> None:
        """Called from the learner thread; never blocks."""
        self.own_cids.add(header.cid)
        self.last_contribution[header.fragment] = (header, enc)
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, (header, enc))

    def resend(self, p: int) -> None:
        """Send fragment p's last contribution again, to whoever holds the open round now (learner thread).

        For the blocking baselines: two nodes can each take a round's lease for a moment and accept their
        own learner's contribution, and with every live learner as the quorum neither would merge. The one
        the views settle on gets both when the waiting learners re-send (same cid: at most one copy merges
        on a chain; the replay guard refuses it once a merge record names it)."""
        if p in self.last_contribution:
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, self.last_contribution[p])

    def _send_again(self, header: ContributionHeader) -> None:
        """Put our latest contribution to ``header``'s fragment back in the outbox, if ``header`` is still it
        (``MergeDeadlines``: its round stalled, or its record left it out)."""
        latest = self.last_contribution.get(header.fragment)
        if latest is not None and latest[0] is header:
            self.outbox.put_nowait(latest)

    async def _sender_loop(self) -> None:
        while True:
            header, enc = await self.outbox.get()
            self._spawn(self._send(header, enc))

    async def _send(self, header: ContributionHeader, enc) -> None:
        """Route one contribution to fragment p's synchroniser, failing over within ``failover_s``.

        The request carries the peers this sender found dead, so the next candidate knows it may take the
        round before their membership records expire. A peer that refuses the role names who it thinks
        should have it; we try that one next, else the next candidate.
        """
        p = header.fragment
        behind = self.rounds_behind(p)
        if self.pcfg.carry and behind > HOLD_BEHIND:
            # Catching up (say, restored from a checkpoint): a contribution measured against a fragment
            # this old would be anchored far back and pull the global toward it. With carry nothing is
            # lost by holding it: the progress goes out with the first contribution after the catch-up.
            self.counters["contributions_dropped"] += 1
            why = f"held: {behind} rounds behind the swarm on fragment {p}, catching up"
            self.events.emit("drop", t=time.time(), fragment=p, cid=header.cid, why=why)
            return
        raw = encode_contribution(header, enc)
        sig = sign_contribution(self.settings.swarm, self.identity, raw)
        self.auditor.keep_message(raw, sig)  # for the audit of the record that merges it
        deadline = self.loop.time() + self.settings.failover_s
        grace = self.settings.failover_s  # for a synchroniser merging its round (node.swarm.receipts)
        mono = time.monotonic()
        dead: set[str] = {q for q, until in self.suspect.items() if until > mono}  # named to the next one
        refused: set[str] = set()
        hint: str | None = None
        last = ""
        while self.loop.time() < deadline:
            if self.peer_scores.was_merged(header.cid):
                # A merge record we applied names it: an earlier attempt landed and only its reply was
                # lost (the synchroniser merged, then its stream broke), or a re-send of the blocking
                # baselines found it merged. Sending it again would only be refused as a replay.
                self.counters["contributions_sent"] += 1
                return
            order = [x for x in self.candidates(p, dead) if x not in refused]
            if hint is not None and hint not in dead and hint not in refused:
                order.insert(0, hint)
            hint = None
            if not order:
                await asyncio.sleep(0.2)
                refused.clear()
                continue
            target = order[0]
            payload = pack_list([json.dumps({"dead": sorted(dead)}).encode(), raw, sig])
            if target == self.peer_id:
                reply = await self._accept(self.peer_id, payload)
            else:
                try:
                    # A synchroniser that hangs (stopped, or cut off without a reset) would hold the whole
                    # budget: while another candidate is left, wait for one at most half of it. (A paused
                    # node's rounds dropped every contribution sent to them, 19 in one chaos run.)
                    left = max(0.5, deadline - self.loop.time())
                    wait = left / 2 if len(order) > 1 else left
                    reply = await self.transport.call(
                        target, "contribute", payload, timeout_s=min(wait, self.settings.rpc_timeout_s)
                    )
                except TransportError as e:
                    self._fail_over(target, header, str(e)[:200], dead)
                    logger.warning(
                        "synchroniser %s of fragment %d unreachable; trying the next candidate", target, p
                    )
                    continue
            if reply.ok or reply.code == RejectCode.REPLAYED.value:  # replayed: an earlier attempt landed
                replayed, rc = reply.code == RejectCode.REPLAYED.value, None
                if target != self.peer_id and self.receipts.receipts_on():  # node.swarm.receipts
                    if not replayed:
                        rc = self.receipts.check_receipt(target, header, reply.body)
                        if rc is None:  # took it and promised nothing: as good as dead for this round
                            dead.add(target)
                            continue
                    replayed = False  # its word that it merged it is watched like a receipt-less ok
                self.counters["contributions_sent"] += 1
                if target != self.peer_id and not replayed:
                    self.deadlines.watch(target, header, rc)  # node.swarm.deadlines
                return
            last = f"{target}: {reply.code} {reply.message}"
            if reply.code in (RejectCode.UNKNOWN_OP.value, RejectCode.INTERNAL.value):
                # A member elected for the round that does not take contributions at all (or fails on
                # every one): as good as dead for this round; the next candidate is told so.
                self._fail_over(target, header, last, dead)
                continue
            if reply.code == RejectCode.NOT_SYNCHRONISER.value:
                refused.add(target)
                with contextlib.suppress(ProtocolError):
                    hint = parse_redirect(reply.body)
                continue
            if reply.code == RejectCode.PEER_BUSY.value and reply.body:  # merging its round: again, after it
                # (each try sends the whole contribution again: at 85M, tens of MB a try)
                # the wait is added to the budget (up to another failover_s in all), not taken from the tries
                with contextlib.suppress(ProtocolError):
                    wait = min(parse_retry(reply.body), max(0.0, grace))
                    grace, deadline = grace - wait, deadline + wait
                    self.counters["busy_retries"] += 1
                    await asyncio.sleep(wait)
                    hint = target
                    continue
            if reply.code in (
                RejectCode.FUTURE_BASE.value,
                RejectCode.UNKNOWN_PEER.value,
                RejectCode.PEER_BUSY.value,  # our earlier contributions are still being read there
            ):
                refused.add(target)
                continue
            break  # stale or invalid: the learner moves on with its next contribution
        self.counters["contributions_dropped"] += 1
        self.events.emit(
            "drop", t=time.time(), fragment=p, cid=header.cid, why=last or "no synchroniser in time"
        )

    def _fail_over(self, target: str, header: ContributionHeader, why: str, dead: set[str]) -> None:
        """``target`` took no contribution: left out of this send (and named dead to the next candidate),
        suspected for ``ttl_s``."""
        dead.add(target)
        self.suspect[target] = time.monotonic() + self.settings.ttl_s
        self.counters["failovers"] += 1
        self.events.emit(
            "failover", t=time.time(), fragment=header.fragment, dead=target, cid=header.cid, why=why
        )

    # ---------------------------------------------------------------- ops (server side)
    async def _h_contribute(self, caller: str, raw: bytes) -> Reply:
        return await self._accept(caller, raw)

    async def _accept(self, caller: str, payload: bytes) -> Reply:
        try:
            dead, raw, sig = unpack_signed_contribution(payload)
            p = peek_fragment(raw)
            if p not in self.spec:
                raise ProtocolError(
                    RejectCode.WRONG_FRAGMENT, f"fragment {p} does not exist (0..{len(self.spec) - 1})"
                )
            if not await self._known(caller):
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
                who = self.synchroniser_of(p, await self._checked_dead(p, dead))
            if who != self.peer_id:
                return self._refuse_role(caller, p, who)
            if self.pcfg.distrust and self.agreement.refuse(h.learner):
                # protocol.agreement: counted toward no quorum, and not re-sent into the next round (left
                # out at the merge, such contributions came back as rounds of liars only)
                self.counters["distrusted_left_out"] += 1
                raise ProtocolError(
                    RejectCode.DISTRUSTED, f"{h.learner}'s outer gradients oppose the rest of the merges here"
                )
            if self.peer_scores.first_resend(h.cid):
                self.events.emit("resent", t=time.time(), peer=caller, fragment=p, cid=h.cid)
                return Reply(True, RejectCode.REPLAYED.value, f"contribution {h.cid} was already merged")
            self.peer_scores.check_replay(h.cid)
            self._check_work(h)
            # decodes each tensor a range at a time, checks it, lets it go: off the loop (GPT-2's embedding
            # took the loop for a second a contribution); on a view whose norm book is a copy read here
            view = frozen_view(self.replicas[p], merge=True)
            n = await asyncio.to_thread(view.check_delta, delta, self.pcfg)
            # after every check of the message: a bad one is refused for what it is, merging or not
            rep = self.replicas[p]
            if h.base_round < rep.round and not rep.keeps(h.base_round):
                # a snapshot installed here since (the history starts at it): the merge could not re-anchor
                # it, and a receipt for it is a promise this node cannot keep (``Receipts.renounce``)
                raise ProtocolError(
                    RejectCode.STALE_BASE,
                    f"fragment {p} no longer keeps round {h.base_round} here (now at {rep.round})",
                )
            if (busy := self.receipts.merging_here(caller, p)) is not None:
                return busy
            # the record names its digest; audits fetch it (node.swarm.audit)
            digest = self.auditor.keep_message(raw, sig) or hashlib.sha256(raw).hexdigest()
            c = Contribution(
                h.learner, p, h.base_round, h.c_steps, h.c_tokens, h.step_time_s, delta, h.cid, n, digest
            )
            binding, receipt = caller != self.peer_id and self.receipts.receipts_on(), b""
            if binding:
                self.receipts.check_taken(p, c.learner, c.cid, c.base_round)
            d = on_contribution(self.pcfg, self.syncs[p], c, self.loop.time())
            if binding:
                if d.state.pending.get((c.learner, c.base_round)) is not c:  # not taken: say so, no ok
                    raise ProtocolError(RejectCode.STALE_BASE, d.reason)
                receipt = self.receipts.give_receipt(p, c.learner, c.cid)
        except ProtocolError as e:
            self.events.emit("reject", t=time.time(), peer=caller, code=e.code.value, why=str(e)[:300])
            if caller == self.peer_id:
                self.transport.count_refusal(e.code.value)
            else:
                self.penalise(caller, e.code)
            return Reply(False, e.code.value, str(e))
        self.peer_scores.reward(caller)
        self.leases[p] = self.replicas[p].round + 1
        self.counters["contributions_accepted"] += 1
        self._decide(p, d)
        return Reply(True, body=receipt)

    async def _h_ping(self, caller: str, raw: bytes) -> Reply:
        """Whether this node is up and takes contributions, asked by a member that was told it is dead (the
        dispatcher has admitted the caller)."""
        return Reply(True)

    async def _checked_dead(self, p: int, dead: set[str]) -> set[str]:
        """A sender's dead list is advice: a peer that stands before this node in fragment p's
        order in our own view is dead only if it does not answer a ping either (or is suspected here).
        Otherwise one contribution sent to every node, each copy naming the others dead, made every node
        the synchroniser of its own round: forks. At most ``PING_AT_MOST`` peers are asked, concurrently."""
        order = self.candidates(p)
        ahead = order[: order.index(self.peer_id)] if self.peer_id in order else order
        named = [q for q in ahead if q in dead and not self._stalled_here(p, q)][:PING_AT_MOST]
        answers = await asyncio.gather(*(self._answers(q) for q in named))
        return dead - {q for q, up in zip(named, answers) if up}

    def _stalled_here(self, p: int, q: str) -> bool:
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
        m, sched = self.members.get(q), self.clocks.due(p)
        r = self.replicas[p].round + 1
        if m is None or sched is None or m.leases.get(str(p)) != r:
            return False
        seen, steps = self.lease_seen.get((q, str(p), r), (math.inf, 0))
        if self.swarm_steps - steps < STALL_PERIODS * self.pcfg.sync_every:
            return False  # the learners did not work two rounds' steps since: starved (a swarm at rest)
        return self.loop.time() > max(sched[0], seen) + STALL_PERIODS * sched[1]

    async def _answers(self, q: str) -> bool:
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
            seen = book[q] = asyncio.ensure_future(self._ping(q, book))
        return await asyncio.shield(seen)

    async def _ping(self, q: str, book: dict) -> bool:
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

    def _check_work(self, h: ContributionHeader) -> None:
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

    def penalise(self, peer: str, code: RejectCode, signed: bool = False) -> None:
        if self.peer_scores.penalise(peer, code, time.monotonic(), signed):
            self.events.emit("ban", t=time.time(), peer=peer, seconds=self.peer_scores.ban_s, last=code.value)

    def _refuse_role(self, caller: str, p: int, who: str | None) -> Reply:
        """Not an error of the sender's: routing views differ for a moment. Not counted as a refusal."""
        msg = f"{self.peer_id} does not hold fragment {p}'s round {self.replicas[p].round + 1}; try {who}"
        return Reply(False, RejectCode.NOT_SYNCHRONISER.value, msg, json.dumps({"try": who}).encode())
