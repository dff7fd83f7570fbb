"""Whether a round that took one of our contributions merged it: a
synchroniser that answered ``ok`` must merge the round by its due moment plus ``STALL_PERIODS`` due periods
(``check_merged``: else it is suspected, and the contribution goes to the next candidate), and the record of
that round must name the contribution (``left_out``: else it goes again, to the next round's synchroniser).

A synchroniser that answers ``ok`` and merges a round without some contributions signs a faithful merge of a
subset, which no audit refutes: its senders' work was lost. An honest one can leave a contribution for its
next round too (it came in while the round was merging); sent again, it replaces itself there (pending
contributions are keyed by learner and base round), and the replay guard keeps a second copy out of any
chain that merged the first.

``MergeDeadlines`` is a part the node owns (``Node.deadlines``, made on its event loop when the node runs):
the sender (``node.swarm.sender``) hands it each contribution another member took, and the record
logic (``node.swarm.replication``) each record it applies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from node.swarm.trust.lateness import MergeLatency
from protocol.messages import ContributionHeader

if TYPE_CHECKING:
    from dht.records import Member
    from node.common.events import EventLog
    from node.swarm.clocks import SwarmClocks
    from node.swarm.settings import NodeSettings
    from node.swarm.trust.peer_scores import PeerScores
    from node.swarm.wire import SignedRecord
    from protocol.config import ProtocolConfig
    from protocol.replica import FragmentReplica

logger = logging.getLogger(__name__)
STALL_PERIODS = 2  # due periods a synchroniser that took a contribution has to merge the round
STALL_TTLS = 10  # how long (x ttl_s) a synchroniser that took a round and never merged it stays suspected


class TakenReceipt(Protocol):
    """What the deadlines read of a synchroniser's receipt for our contribution (``node.swarm.trust.receipts``)."""

    round: int


class MergeDeadlines:
    """The deadline and the record of each round a synchroniser took one of our contributions for, and how
    late each synchroniser merges them (``latency``: ``node.swarm.trust.lateness``).

    Its collaborators: the node's settings, protocol configuration, replicas and clocks; the loop it runs on;
    the peer scores (``was_merged``); the node's ``suspect`` dict (peer id -> until when, on the monotonic clock),
    ``counters`` and ``events``, which it writes to; ``live_members`` and ``rounds_behind`` of the node's
    membership view; ``watched_round`` and ``check_omission`` of its receipts (``node.swarm.trust.receipts``); and
    ``send_again``, which puts our latest contribution to a fragment back in the outbox if it is still the
    given one."""

    def __init__(
        self,
        settings: NodeSettings,
        pcfg: ProtocolConfig,
        replicas: Sequence[FragmentReplica],
        clocks: SwarmClocks,
        loop: asyncio.AbstractEventLoop,
        peer_scores: PeerScores,
        suspect: dict[str, float],
        counters: dict[str, int],
        events: EventLog,
        live_members: Callable[[], dict[str, Member]],
        rounds_behind: Callable[[int], int],
        watched_round: Callable[[TakenReceipt, int], int],
        check_omission: Callable[[SignedRecord, TakenReceipt], bool],
        send_again: Callable[[ContributionHeader], None],
        link_s: Callable[[str, int], float] | None = None,
    ) -> None:
        self.settings = settings
        self.pcfg = pcfg
        self.replicas = replicas
        self.clocks = clocks
        self.loop = loop
        self.peer_scores = peer_scores
        self.suspect = suspect
        self.counters = counters
        self.events = events
        self.live_members = live_members
        self.rounds_behind = rounds_behind
        self.watched_round = watched_round
        self.check_omission = check_omission
        self.send_again = send_again
        # seconds the link from a peer allows a body of n bytes at its measured rate (``Transport.link_s``)
        self.link_s = link_s
        self._record_bytes: dict[int, int] = {}  # per fragment: a merge record's outer gradient, on the wire
        # per fragment, our latest contribution another member took: (header, that member, the round whose
        # record must name it, its receipt or None: ``node.swarm.trust.receipts``, when it was taken on the loop)
        self.taken: dict[int, tuple[ContributionHeader, str, int, TakenReceipt | None, float]] = {}
        self.latency = (
            MergeLatency()
        )  # how late each synchroniser merges our rounds (node.swarm.trust.lateness)

    def watch(self, target: str, header: ContributionHeader, receipt: TakenReceipt | None = None) -> None:
        """``target`` took our contribution to fragment p's open round: it must merge that round by its due
        moment plus ``STALL_PERIODS`` due periods (at least two heartbeats). One that answers ``ok`` and
        never merges (hung past its transport, or hostile) would otherwise hold the fragment for as long as
        its membership record lives: the rendezvous winner of a round stays its winner."""
        p = header.fragment
        open_round = self.replicas[p].round + 1
        now = self.loop.time()
        if receipt is not None:  # the synchroniser's own word of the round it took it into
            self.taken[p] = (header, target, self.watched_round(receipt, open_round), receipt, now)
        elif self.rounds_behind(p) == 0:  # behind, the round it went into is not ours + 1: nothing to watch
            self.taken[p] = (header, target, open_round, None, now)
        self.loop.call_later(self.deadline(header, target), self.check_merged, target, header, open_round)

    def record_bytes(self, p: int) -> int:
        """The wire bytes of a record of fragment p's merged outer gradient (``record_codec``)."""
        n = self._record_bytes.get(p)
        if n is None:
            from protocol.codecs import encoded_nbytes

            numel = sum(t.numel() for t in self.replicas[p].theta.values())
            n = self._record_bytes[p] = encoded_nbytes(numel, self.pcfg.record_codec, self.pcfg.codec_block)
        return n

    def deadline(self, header: ContributionHeader, target: str | None = None) -> float:
        """Seconds from now until a round that took ``header`` must have merged: its due moment plus
        ``STALL_PERIODS`` due periods; before the swarm has a schedule (its first rounds, which merge on
        arrival), ``STALL_PERIODS`` times the longest wait an honest synchroniser may take, ``failover_s``,
        or the grace window, which is at most ``overlap`` of the learners' steps (``protocol.synchroniser``):
        at 124M parameters a step took 8-10 s, the grace window 10 s, and every synchroniser of a first
        round was taken for stalled (8 s) a moment before it merged, 2 to 4 times per node in a run.

        With the ``target`` named, the record's own time on the link from it comes on top (``link_s``: its
        bytes at the rate measured on that link, none before one is): two nodes of synchronous DiLoCo
        on a 10 Mbit/s link took each other for stalled while the whole model's fp32 record, 3 s on the link,
        was on its way, and failed their contributions over."""
        now = self.loop.time()
        sched = self.clocks.due(header.fragment)
        if sched is not None:
            due, every = sched
        else:
            due, every = (
                now,
                max(self.settings.failover_s / STALL_PERIODS, self.pcfg.overlap * header.step_time_s),
            )
        wait = max(due, now) - now + max(STALL_PERIODS * every, 2 * self.settings.heartbeat_s)
        if target is not None and self.link_s is not None:
            wait += self.link_s(target, self.record_bytes(header.fragment))
        return wait

    def check_merged(self, target: str, header: ContributionHeader, open_round: int) -> None:
        """The deadline of a round ``target`` took: merged (here, or a head another member publishes), or
        ``target`` is suspected for ``STALL_TTLS`` x ``ttl_s`` (left out of elections, so the round goes to
        the next candidate, and named dead to it) and this contribution, if still our latest to the
        fragment, goes again."""
        p = header.fragment
        if self.peer_scores.was_merged(header.cid) or self.replicas[p].round >= open_round:
            return
        if any(m.head_round(p) >= open_round for q, m in self.live_members().items() if q != target):
            return  # merged elsewhere; our replica is catching up
        self.suspect[target] = time.monotonic() + STALL_TTLS * self.settings.ttl_s
        self.counters["stalls"] += 1
        self.events.emit("stall", t=time.time(), fragment=p, round=open_round, peer=target, cid=header.cid)
        logger.warning(
            "synchroniser %s took fragment %d's round %d and did not merge it; electing the next",
            target,
            p,
            open_round,
        )
        self.send_again(header)  # the watch of an older one leaves it to this one's

    def merged_after(self, signer: str, p: int, round_: int, seconds: float) -> None:
        """``signer`` merged the round that took our contribution ``seconds`` after its ``ok``: a sample of its
        merge latency (``node.swarm.trust.lateness``), in fragment p's round periods. One judged slow against the
        other signers is passed over as a stalled one is (``slow_rounds``): a synchroniser that holds each
        round to just before its stall deadline costs the swarm rounds and is never found stalled."""
        sched = self.clocks.due(p)
        if sched is None or sched[1] <= 0:  # no schedule yet: no period to measure against
            return
        if (
            not self.latency.add(signer, seconds / sched[1])
            or self.suspect.get(signer, 0.0) > time.monotonic()
        ):
            return
        self.suspect[signer] = time.monotonic() + STALL_TTLS * self.settings.ttl_s
        self.counters["slow_rounds"] += 1
        medians = self.latency.medians()
        self.events.emit(
            "slow", t=time.time(), fragment=p, round=round_, peer=signer, periods=medians.get(signer)
        )
        logger.warning(
            "synchroniser %s merges the rounds it takes late (median %.2f round periods; the others %s): "
            "electing the next",
            signer,
            medians.get(signer, 0.0),
            {q[-6:]: m for q, m in medians.items() if q != signer},
        )

    def left_out(self, sr: SignedRecord) -> None:
        """A record of fragment p was applied here (``Replication.apply``): where it is the round (or a later
        one) that took our latest contribution and no record applied names it, it was left out. Counted
        (``left_out``), and sent again if it is still our latest to that fragment."""
        rec = sr.record
        taken = self.taken.get(rec.fragment)
        if taken is None or rec.round < taken[2]:
            return
        header, target, _, receipt, taken_at = self.taken.pop(rec.fragment)
        if self.peer_scores.was_merged(header.cid):
            if sr.signer == target:
                self.merged_after(target, rec.fragment, rec.round, self.loop.time() - taken_at)
            return
        if receipt is not None and rec.round == receipt.round:
            self.check_omission(sr, receipt)  # node.swarm.trust.receipts: its signer's own receipt, left out
        self.counters["left_out"] += 1
        self.events.emit(
            "left_out",
            t=time.time(),
            fragment=rec.fragment,
            round=rec.round,
            peer=target,
            signer=sr.signer,
            cid=header.cid,
        )
        self.send_again(header)
