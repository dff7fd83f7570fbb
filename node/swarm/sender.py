"""A learner's contribution routed to its fragment's synchroniser, failing over within ``failover_s``
(``Sender.send``), and the ids this node sent (``OwnCids``), which refute a record that claims one it never
sent, and the ``Outbox`` between the learner thread and the sender."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from node.swarm.transport import LinkBusy, Reply, TransportError
from node.swarm.trust.receipts import parse_retry
from node.swarm.wire import pack_list, parse_redirect, sign_contribution
from protocol.errors import ProtocolError, RejectCode
from protocol.messages import ContributionHeader, cid_moment, encode_contribution, sender_tag

logger = logging.getLogger(__name__)
HOLD_BEHIND = 2  # with carry, contributions wait while our fragment is more rounds than this behind


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


class Outbox:
    """This node's contributions, from the learner thread to the sender on the node's loop. ``post`` and
    ``resend`` are called from the learner thread and never block; the queue is made on the loop (``start``)."""

    def __init__(self, own_cids: OwnCids, last: dict[int, tuple]) -> None:
        self.own_cids = own_cids
        self.last = last  # fragment -> (header, encoded) last posted
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queue: asyncio.Queue | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue = loop, asyncio.Queue()

    def qsize(self) -> int:
        return self.queue.qsize() if self.queue is not None else 0

    def post(self, header: ContributionHeader, enc) -> None:
        """A new contribution (learner thread)."""
        self.own_cids.add(header.cid)
        self.last[header.fragment] = (header, enc)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (header, enc))

    def resend(self, p: int) -> None:
        """Send fragment p's last contribution again, to whoever holds the open round now (learner thread).

        For the blocking baselines: two nodes can each take a round's lease for a moment and accept their
        own learner's contribution, and with every live learner as the quorum neither would merge. The one
        the views settle on gets both when the waiting learners re-send (same cid: at most one copy merges
        on a chain; the replay guard refuses it once a merge record names it). Where this node's own
        synchroniser already holds it, the re-send goes to the next candidate (``Sender.send``)."""
        if p in self.last:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (*self.last[p], True))

    def send_again(self, header: ContributionHeader) -> None:
        """Put our latest contribution to ``header``'s fragment back in the queue, if ``header`` is still it
        (``MergeDeadlines``: its round stalled, or its record left it out)."""
        latest = self.last.get(header.fragment)
        if latest is not None and latest[0] is header:
            self.queue.put_nowait(latest)

    async def drain(
        self, send: Callable[[ContributionHeader, object], Awaitable[None]], spawn: Callable
    ) -> None:
        """Hand each contribution to ``send``, each in a task of its own."""
        while True:
            spawn(send(*await self.queue.get()))  # (header, encoded), and True for a blocked learner's resend


class Sender:
    """Sends this node's contributions. ``candidates(p, dead)``: fragment p's synchroniser order in this
    node's view, and ``rounds_behind(p)`` how far it is behind the swarm (``node.swarm.view``);
    ``accept(caller, payload)``: this node's own intake, where it is the synchroniser
    (``node.swarm.intake``); ``watch(target, header, receipt)``: the deadline of a round that took one
    (``node.swarm.deadlines``); ``clock()``: the event loop's time."""

    def __init__(
        self,
        settings,
        pcfg,
        peer_id: str,
        identity,
        suspect: dict[str, float],
        peer_scores,
        counters: dict[str, int],
        events,
        auditor,
        transport,
        receipts,
        *,
        candidates: Callable[..., list[str]],
        rounds_behind: Callable[[int], int],
        accept: Callable[[str, bytes], Awaitable[Reply]],
        watch: Callable,
        clock: Callable[[], float],
    ) -> None:
        self.settings, self.pcfg, self.peer_id, self.identity = settings, pcfg, peer_id, identity
        self.suspect, self.peer_scores, self.counters, self.events = suspect, peer_scores, counters, events
        self.auditor, self.transport, self.receipts = auditor, transport, receipts
        self.candidates, self.rounds_behind, self.accept = candidates, rounds_behind, accept
        self.watch, self.clock = watch, clock
        self.held_here: dict[int, str] = {}  # fragment -> the last contribution this node's own role took
        self.sending: set[str] = set()  # ids of the contributions being sent now

    async def send(self, header: ContributionHeader, enc, resent: bool = False) -> None:
        """Route one contribution (``route``), unless it is a re-send of one still on its way: at 1 Mbit/s a
        blocked learner of synchronous DiLoCo re-sent its 3.5 MB model every two heartbeats while the
        first copy took 28 s on the link, and each copy queued behind it."""
        if resent and header.cid in self.sending:
            return
        self.sending.add(header.cid)
        try:
            await self.route(header, enc, resent)
        finally:
            self.sending.discard(header.cid)

    async def route(self, header: ContributionHeader, enc, resent: bool = False) -> None:
        """Route one contribution to fragment p's synchroniser, failing over within ``failover_s``.

        The request carries the peers this sender found dead, so the next candidate knows it may take the
        round before their membership records expire. A peer that refuses the role names who it thinks
        should have it; we try that one next, else the next candidate.

        ``resent``: a blocked learner's re-send (``Outbox.resend``). Where this node is its own first
        candidate and already holds the contribution, the next candidate gets it: two views that each
        elected their own node held one learner's contribution each, and with every learner as the quorum
        neither merged again (the sync-diloco system test, about 1 run in 10). The other node takes the
        round in its own view, holds both, and merges; where it does not (views agree on us), it names us
        and the try ends as a replay here.
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
        deadline = self.clock() + self.settings.failover_s
        grace = self.settings.failover_s  # for a synchroniser merging its round (node.swarm.trust.receipts)
        mono = time.monotonic()
        dead: set[str] = {q for q, until in self.suspect.items() if until > mono}  # named to the next one
        refused: set[str] = set()
        hint: str | None = None
        last = ""
        while self.clock() < deadline:
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
            if (
                resent
                and order[:1] == [self.peer_id]
                and len(order) > 1
                and self.held_here.get(p) == header.cid
            ):
                order = order[1:] + order[:1]
            resent = False  # once: a redirect or a fail-over from there on is the usual path
            if not order:
                await asyncio.sleep(0.2)
                refused.clear()
                continue
            target = order[0]
            payload = pack_list([json.dumps({"dead": sorted(dead)}).encode(), raw, sig])
            if target == self.peer_id:
                reply = await self.accept(self.peer_id, payload)
            else:
                try:
                    # A synchroniser that hangs (stopped, or cut off without a reset) would hold the whole
                    # budget: while another candidate is left, wait for one at most half of it. (A paused
                    # node's rounds dropped every contribution sent to them, 19 in one chaos run.)
                    left = max(0.5, deadline - self.clock())
                    wait = left / 2 if len(order) > 1 else left
                    # every other learner of the round may be sending the synchroniser theirs at once: at 1
                    # Mbit/s, three fp32 models of synchronous DiLoCo into one node each ran past the time one
                    # alone takes, and every round failed over (counted from every candidate, not those left
                    # after fail-overs: the learners behind the dead ones still send)
                    reply = await self.transport.call(
                        target,
                        "contribute",
                        payload,
                        timeout_s=min(wait, self.settings.rpc_timeout_s),
                        share=max(1, len(self.candidates(p)) - 1),
                        queue_s=left,  # its turn on our own link, from what is left of the budget
                    )
                except LinkBusy as e:  # our own link is full: no fault of the synchroniser's
                    last = str(e)[:200]
                    break
                except TransportError as e:
                    self.fail_over(target, header, str(e)[:200], dead)
                    logger.warning(
                        "synchroniser %s of fragment %d unreachable; trying the next candidate", target, p
                    )
                    continue
            if reply.ok or reply.code == RejectCode.REPLAYED.value:  # replayed: an earlier attempt landed
                replayed, rc = reply.code == RejectCode.REPLAYED.value, None
                if target == self.peer_id:
                    self.held_here[p] = header.cid
                if target != self.peer_id and self.receipts.receipts_on():  # node.swarm.trust.receipts
                    if not replayed:
                        rc = self.receipts.check_receipt(target, header, reply.body)
                        if rc is None:  # took it and promised nothing: as good as dead for this round
                            dead.add(target)
                            continue
                    replayed = False  # its word that it merged it is watched like a receipt-less ok
                self.counters["contributions_sent"] += 1
                if target != self.peer_id and not replayed:
                    self.watch(target, header, rc)  # node.swarm.deadlines
                return
            last = f"{target}: {reply.code} {reply.message}"
            if reply.code in (RejectCode.UNKNOWN_OP.value, RejectCode.INTERNAL.value):
                # A member elected for the round that does not take contributions at all (or fails on
                # every one): as good as dead for this round; the next candidate is told so.
                self.fail_over(target, header, last, dead)
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

    def fail_over(self, target: str, header: ContributionHeader, why: str, dead: set[str]) -> None:
        """``target`` took no contribution: left out of this send (and named dead to the next candidate),
        suspected for ``ttl_s``."""
        dead.add(target)
        self.suspect[target] = time.monotonic() + self.settings.ttl_s
        self.counters["failovers"] += 1
        self.events.emit(
            "failover", t=time.time(), fragment=header.fragment, dead=target, cid=header.cid, why=why
        )
