"""Whether a round that took one of our contributions merged it: a
synchroniser that answered ``ok`` must merge the round by its due moment plus ``STALL_PERIODS`` due periods
(``_check_merged``: else it is suspected, and the contribution goes to the next candidate), and the record of
that round must name the contribution (``left_out``: else it goes again, to the next round's synchroniser).

A synchroniser that answers ``ok`` and merges a round without some contributions signs a faithful merge of a
subset, which no audit refutes: its senders' work was lost. An honest one can leave a contribution for its
next round too (it came in while the round was merging); sent again, it replaces itself there (pending
contributions are keyed by learner and base round), and the replay guard keeps a second copy out of any
chain that merged the first.

A mixin of ``node.swarm.agent.Node``, like ``node.swarm.contributions``, on the node's event loop."""

from __future__ import annotations

import logging
import time

from protocol.messages import ContributionHeader

logger = logging.getLogger(__name__)
STALL_PERIODS = 2  # due periods a synchroniser that took a contribution has to merge the round
STALL_TTLS = 10  # how long (x ttl_s) a synchroniser that took a round and never merged it stays suspected


class MergeWatch:
    """The deadline and the record of each round a synchroniser took one of our contributions for."""

    def _init_merge_watch(self) -> None:
        # per fragment, our latest contribution another member took: (header, that member, open round, its
        # receipt or None: ``node.swarm.receipts``)
        self._taken_by: dict[int, tuple[ContributionHeader, str, int, object]] = {}

    def _taken(self) -> dict[int, tuple[ContributionHeader, str, int, object]]:
        """Per fragment, our latest contribution another member took (``_taken_by``)."""
        return self._taken_by

    def _watch_merge(self, target: str, header: ContributionHeader, receipt=None) -> None:
        """``target`` took our contribution to fragment p's open round: it must merge that round by its due
        moment plus ``STALL_PERIODS`` due periods (at least two heartbeats). One that answers ``ok`` and
        never merges (hung past its transport, or hostile) would otherwise hold the fragment for as long as
        its membership record lives: the rendezvous winner of a round stays its winner."""
        p = header.fragment
        open_round = self.replicas[p].round + 1
        now = self.loop.time()
        if receipt is not None:  # the synchroniser's own word of the round it took it into
            self._taken()[p] = (header, target, self.watched_round(receipt, open_round), receipt, now)
        elif self.rounds_behind(p) == 0:  # behind, the round it went into is not ours + 1: nothing to watch
            self._taken()[p] = (header, target, open_round, None, now)
        self.loop.call_later(self._merge_deadline(header), self._check_merged, target, header, open_round)

    def _merge_deadline(self, header: ContributionHeader) -> float:
        """Seconds from now until a round that took ``header`` must have merged: its due moment plus
        ``STALL_PERIODS`` due periods; before the swarm has a schedule (its first rounds, which merge on
        arrival), ``STALL_PERIODS`` times the longest wait an honest synchroniser may take, ``failover_s``,
        or the grace window, which is at most ``overlap`` of the learners' steps (``protocol.synchroniser``):
        at 124M parameters a step took 8-10 s, the grace window 10 s, and every synchroniser of a first
        round was taken for stalled (8 s) a moment before it merged, 2 to 4 times per node in a run."""
        now = self.loop.time()
        sched = self.clocks.due(header.fragment)
        if sched is not None:
            due, every = sched
        else:
            due, every = (
                now,
                max(self.settings.failover_s / STALL_PERIODS, self.pcfg.overlap * header.step_time_s),
            )
        return max(due, now) - now + max(STALL_PERIODS * every, 2 * self.settings.heartbeat_s)

    def _check_merged(self, target: str, header: ContributionHeader, open_round: int) -> None:
        """The deadline of a round ``target`` took: merged (here, or a head another member publishes), or
        ``target`` is suspected for ``STALL_TTLS`` x ``ttl_s`` (left out of elections, so the round goes to
        the next candidate, and named dead to it) and this contribution, if still our latest to the
        fragment, goes again."""
        p = header.fragment
        if self.guard.was_merged(header.cid) or self.replicas[p].round >= open_round:
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
        latest = self.last_contribution.get(p)
        if latest is not None and latest[0] is header:  # the watch of an older one leaves it to this one's
            self.outbox.put_nowait(latest)

    def _merged_after(self, signer: str, p: int, round_: int, seconds: float) -> None:
        """``signer`` merged the round that took our contribution ``seconds`` after its ``ok``: a sample of its
        merge latency (``node.swarm.lateness``), in fragment p's round periods. One judged slow against the
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

    def left_out(self, sr) -> None:
        """A record of fragment p was applied here (``Replication._apply``): where it is the round (or a later
        one) that took our latest contribution and no record applied names it, it was left out. Counted
        (``left_out``), and sent again if it is still our latest to that fragment."""
        rec = sr.record
        taken = self._taken().get(rec.fragment)
        if taken is None or rec.round < taken[2]:
            return
        header, target, _, receipt, taken_at = self._taken().pop(rec.fragment)
        if self.guard.was_merged(header.cid):
            if sr.signer == target:
                self._merged_after(target, rec.fragment, rec.round, self.loop.time() - taken_at)
            return
        if receipt is not None and rec.round == receipt.round:
            self.check_omission(sr, receipt)  # node.swarm.receipts: its signer's own receipt, left out
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
        latest = self.last_contribution.get(rec.fragment)
        if latest is not None and latest[0] is header:
            self.outbox.put_nowait(latest)
