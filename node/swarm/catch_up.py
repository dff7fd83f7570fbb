"""Joining and catching up (docs/design.md, section 4): a node with no state downloads the swarm's
fragments from several donors before it trains; a node behind on a fragment fetches the records it missed,
or a snapshot when records cannot bridge the gap; and the server side of the snapshot op. ``CatchUp`` is a
component the node builds when it runs (after its transport and snapshot vetting), from the state it shares and
the view's and replication's calls it needs."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable

from node.swarm.limits import Backoff, TokenBucket
from node.swarm.memory import momentum_lent
from node.swarm.settings import NodeSettings
from node.swarm.transport import Reply, TransportError
from node.swarm.wire import (
    SNAPSHOT_IDS_MAX,
    FragmentState,
    decode_record,
    decode_snapshot,
    encode_snapshot,
    parse_snapshot_request,
    unpack_list,
)
from protocol.codecs import encoded_nbytes
from protocol.errors import ProtocolError, RejectCode
from protocol.schedule import sane_clock

logger = logging.getLogger(__name__)
SNAPSHOT_BYTES_PER_PARAM = 8.0  # a fragment's snapshot: fp32 parameters and fp32 outer momentum
# Snapshots a node fetches at once to catch forked or lagging fragments up. Each fragment's catch-up is its
# own task: at 1 Mbit/s a node behind on 20 fragments asked for 20 snapshots of 300 KB at once, 48 s of its
# link, and every one ran past its 10 s deadline and was asked for again: with the learners paused, three
# quarters of the link carried snapshots that never arrived, and the swarm never met on one model. One
# after another, each arrives in its bytes' time, and records, heads and the DHT find the link free between.
SNAPSHOTS_IN_FLIGHT = 2


def record_bytes_per_param(codec: str, block: int) -> float:
    """Wire bytes per parameter of a merge record's merged outer gradient in ``codec``."""
    return encoded_nbytes(block, codec, block) / block


def records_bridge(gap: int, pcfg) -> bool:
    """Catch up a fragment ``gap`` rounds behind by fetching records (True) rather than a snapshot (False):
    only while every record is still in a peer's log (``history`` rounds) and they weigh less than one
    snapshot. A node back from a pause or a restart is usually far behind: a records request would bring
    back the log's last rounds, which do not follow its own, and the snapshot would be fetched after all."""
    if gap <= 0 or gap > pcfg.history:
        return False
    return gap * record_bytes_per_param(pcfg.record_codec, pcfg.codec_block) < SNAPSHOT_BYTES_PER_PARAM


class CatchUp:
    """Join and catch-up. The view's part: ``members()`` and ``live_members()`` (the members seen, and those
    live), ``winning_heads``, ``outvoted``, ``credible``, ``within_records``, ``head_key``, ``workers`` and
    ``logged_learners`` (``node.swarm.view``), ``credit_snapshot(state)`` (the work a snapshot credits) and
    ``heartbeat()`` (publish this node's record now). The replication's: ``apply(record)`` and
    ``reset_sync(p, merged)``. ``syncing``: the fragments being caught up or merged (shared with the
    replication); ``lagging_since``: since when each fragment has been behind a live head."""

    def __init__(
        self,
        settings,
        pcfg,
        peer_id: str,
        spec: dict,
        replicas: list,
        heads: list,
        logs: list,
        merged_tokens: list,
        syncing: set[int],
        lagging_since: dict[int, float],
        counters: dict[str, int],
        events,
        peer_scores,
        work,
        clocks,
        learner,
        learner_loop,
        transport,
        vetting,
        auditor,
        *,
        members: Callable[[], dict],
        live_members: Callable[[], dict],
        winning_heads: Callable,
        outvoted: Callable,
        credible: Callable,
        within_records: Callable[[int, int], bool],
        head_key: Callable,
        workers: Callable,
        logged_learners: Callable[[], set],
        credit_snapshot: Callable,
        heartbeat: Callable[[], Awaitable[None]],
        apply: Callable,
        reset_sync: Callable,
        spawn: Callable,
        clock: Callable[[], float],
    ) -> None:
        self.settings, self.pcfg, self.peer_id, self.spec = settings, pcfg, peer_id, spec
        self.replicas, self.heads, self.logs, self.merged_tokens = replicas, heads, logs, merged_tokens
        self.syncing, self.lagging_since = syncing, lagging_since
        self.counters, self.events, self.peer_scores, self.work = counters, events, peer_scores, work
        self.clocks, self.learner, self.learner_loop = clocks, learner, learner_loop
        self.transport, self.vetting, self.auditor = transport, vetting, auditor
        self.members, self.live_members, self.winning_heads = members, live_members, winning_heads
        self.outvoted, self.credible, self.within_records = outvoted, credible, within_records
        self.head_key, self.workers, self.logged_learners = head_key, workers, logged_learners
        self.credit_snapshot, self.heartbeat = credit_snapshot, heartbeat
        self.apply, self.reset_sync, self.spawn, self.clock = apply, reset_sync, spawn, clock
        frags = len(spec)
        # retries of a catch-up toward a peer that fails (killed, cut off, refusing) back off per peer
        self.backoff = Backoff(base_s=0.25, cap_s=max(5.0, 4 * settings.heartbeat_s))
        # fragment snapshots each peer may fetch from us: a burst of ``snapshot_burst`` (default 4 x the
        # fragments: a joiner fetches each once), refilled at ``snapshots_per_min``
        self.snapshots = TokenBucket(
            burst=settings.snapshot_burst or 4 * frags, per_s=(settings.snapshots_per_min or 4 * frags) / 60.0
        )
        self.inherited: dict[int, tuple[str, ...]] = {}  # per fragment: the ids its last snapshot named
        self.fetching = asyncio.Semaphore(SNAPSHOTS_IN_FLIGHT)  # catch-ups' snapshot fetches under way

    # ---------------------------------------------------------------- join, catch-up, re-sync
    async def join(self) -> str | None:
        """A node with no state: when the swarm is past round 0, download it (several donors) before training;
        how it joined ("download from n donor(s)"), or None where the swarm was at round 0 (nothing to take)."""
        await self.await_members()
        plan: dict[str, list[int]] = {}
        donors_of: dict[int, list[str]] = {}
        for p in range(len(self.replicas)):
            holders = await self.vetting.join_donors(p, self.members())
            if holders:
                donors_of[p] = holders
        if not donors_of:
            return None
        for i, (p, donors) in enumerate(sorted(donors_of.items())):
            plan.setdefault(donors[i % len(donors)], []).append(p)
        t0 = time.time()
        # Keep this node's membership record fresh while it downloads: a big model takes longer than the
        # record lives, and a donor refuses a caller it no longer sees as a member.
        beats = self.spawn(self.publish_while_joining())
        try:
            results = await asyncio.gather(
                *(self.fetch_each(pid, frags) for pid, frags in plan.items()), return_exceptions=True
            )
        finally:
            beats.cancel()
        missing = sorted(p for res in results if not isinstance(res, BaseException) for p in res)
        missing += [
            p
            for (pid, frags), res in zip(plan.items(), results)
            if isinstance(res, BaseException)
            for p in frags
        ]
        for p in missing:  # a donor failed: try the others, one fragment at a time
            for pid in donors_of[p]:
                try:
                    await self.fetch_snapshot(pid, [p])
                    break
                except (TransportError, ProtocolError) as e:
                    logger.warning("snapshot of fragment %d from %s failed: %s", p, pid, e)
        rounds = [r.round for r in self.replicas]
        self.learner.join(rounds, [r.theta for r in self.replicas])
        self.events.emit(
            "download",
            t=time.time(),
            donors=sorted(plan),
            fragments=sorted(donors_of),
            seconds=time.time() - t0,
        )
        return f"download from {len(plan)} donor(s)"

    async def await_members(self) -> None:
        """A node given initial peers that sees no other member yet reads the view again, for up to three
        heartbeats: on a loaded machine its first read can come back empty (its DHT not yet linked), and a
        restarted node that saw nobody trained a first stretch on its checkpoint's stale fragments."""
        deadline = self.clock() + 3 * self.settings.heartbeat_s
        while (
            not self.members() and NodeSettings.split(self.settings.initial_peers) and self.clock() < deadline
        ):
            await asyncio.sleep(self.settings.heartbeat_s / 2)
            await self.heartbeat()

    async def catch_up_restored(self) -> None:
        """A node restored from its checkpoint (a restart) is behind by the rounds merged since it was saved.
        Fetch every fragment the swarm is ahead on at once, each from one of its holders, before the learner
        takes a step: a step from the checkpoint's fragments yields a contribution the synchronisers leave
        out (its base is rounds old) and progress the catch-up then overwrites. Waiting for the usual
        reconcile (a heartbeat and a half, then one fragment at a time) cost the restarted node its first
        4-5 s of steps in a chaos run. A fragment whose fetch failed is tried again (the per-peer backoff
        spaces the tries) until two tries in a row and two heartbeats move nothing, or the RPC deadline;
        what is still behind then, the heartbeat's reconcile finishes while the learner trains. Two quick
        tries alone were too few: a donor that has not yet read this node's fresh record refuses it
        (``unknown_peer``) and reads the view again only once a heartbeat, so both tries met the same
        refusal and the node trained its first stretch on stale fragments."""
        await self.await_members()
        before = [r.round for r in self.replicas]
        t0, behind, idle = time.time(), None, 0
        deadline = self.clock() + self.settings.rpc_timeout_s
        moved_at = self.clock()
        beats = self.spawn(self.publish_while_joining())  # a donor serves members only
        try:
            while self.clock() < deadline and not (
                idle >= 2 and self.clock() - moved_at >= 2 * self.settings.heartbeat_s
            ):
                members = self.live_members()
                heads = [(p, *self.winning_heads(p, members)) for p in range(len(self.replicas))]
                heads = [(p, head, holders) for p, head, holders in heads if holders]
                if not heads:
                    break
                if behind is None:
                    behind = len(heads)
                else:
                    await asyncio.sleep(0.3)  # a donor that refused is tried again after its backoff (0.25 s)
                rounds = [r.round for r in self.replicas]
                jobs = [asyncio.ensure_future(self.catch_up(p, hs[p % len(hs)], h)) for p, h, hs in heads]
                _, pending = await asyncio.wait(jobs, timeout=max(0.0, deadline - self.clock()))
                for t in pending:
                    t.cancel()
                if [r.round for r in self.replicas] != rounds:
                    idle, moved_at = 0, self.clock()
                else:
                    idle += 1
        finally:
            beats.cancel()
        moved = [p for p, (r, b) in enumerate(zip(self.replicas, before)) if r.round > b]
        for p in moved:  # the learner is not running yet: it takes these before its first step
            self.learner_loop.deliver(p, self.replicas[p].round, self.replicas[p].theta, True)
        if behind:
            self.events.emit(
                "catch_up", t=time.time(), fragments=moved, behind=behind, seconds=round(time.time() - t0, 3)
            )

    async def publish_while_joining(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            await self.heartbeat()

    async def fetch_each(self, pid: str, frags: list[int]) -> list[int]:
        """Fetch ``frags`` from one donor, one fragment per request (a whole model in one message can
        outlast the RPC deadline); returns the fragments that failed, for the other donors to try."""
        failed = []
        for p in frags:
            try:
                await self.fetch_snapshot(pid, [p])
            except (TransportError, ProtocolError) as e:
                logger.warning("snapshot of fragment %d from %s failed: %s", p, pid, e)
                failed.append(p)
        return failed

    async def fetch_snapshot(
        self, pid: str, frags: list[int], replace_ours: bool = False, vetted: list | None = None
    ) -> None:
        reply = await self.transport.call(pid, "snapshot", json.dumps({"fragments": frags}).encode())
        if not reply.ok:
            raise TransportError(
                f"snapshot of fragments {frags} refused by {pid}: {reply.code} {reply.message}"
            )
        states = decode_snapshot(reply.body, self.spec)
        if sorted(s.fragment for s in states) != sorted(frags):
            raise ProtocolError(
                RejectCode.MALFORMED, f"asked {pid} for fragments {frags}, got {[s.fragment for s in states]}"
            )
        for st in states:
            if replace_ours or self.improves(st):
                if vetted is not None and [st.round, st.hash] != [int(vetted[0]), str(vetted[1])]:
                    # the donor served another head than the one vetted before the fetch (a liar served
                    # its all-zero state for a head of its own that a fork made us follow)
                    await self.vetting.vouch_head(pid, st.fragment, (st.round, st.hash))
                await self.vetting.check_snapshot(pid, st)  # raises where it may not come in
                self.install_snapshot(st, pid, replace_ours)

    def untrusted(self, p: int, pid: str, round_: int) -> None:
        self.transport.count_refusal("untrusted_head")
        self.events.emit("untrusted_head", t=time.time(), fragment=p, peer=pid, round=round_)
        logger.warning(
            "fragment %d: %s claims round %d, which no majority of the swarm backs; not following it",
            p,
            pid,
            round_,
        )

    def merged_ids(self, p: int) -> tuple[str, ...]:
        """The ids of the contributions merged into fragment p's last ``history`` rounds (a contribution on an
        older base is refused as stale, so older ids cannot be replayed): from the records the log holds,
        and while the log holds fewer rounds than that, from the snapshot this node took."""
        ids = [c[1] for sr in self.logs[p].values() for c in sr.record.contributors]
        if len(self.logs[p]) < self.pcfg.history:
            ids = list(self.inherited.get(p, ())) + ids
        return tuple(dict.fromkeys(ids))[-SNAPSHOT_IDS_MAX:]

    def improves(self, st: FragmentState) -> bool:
        return self.head_key(self.heads[st.fragment]) > self.head_key((st.round, st.hash, st.n, st.weight))

    def install_snapshot(self, st: FragmentState, pid: str, replace_ours: bool = False) -> None:
        p = st.fragment
        if not replace_ours and not self.improves(st):
            return  # ours is as good or better by now
        rep = self.replicas[p]
        clock = sane_clock(st.clock, self.pcfg.sync_every)  # the tensors were decoded for this alone: no copy
        rep.load_state(st.round, st.theta, st.momentum, clock, copy=False)
        self.heads[p] = (st.round, st.hash, st.n, st.weight)
        self.merged_tokens[p] = st.tokens
        self.credit_snapshot(st)  # before the log goes
        self.logs[p].clear()
        # The records of the rounds this state skips are never applied here: their contribution ids come
        # with it, so a copy of one is refused as a replay and a queued one is not merged a second time.
        self.peer_scores.merged(st.merged)
        self.inherited[p] = st.merged
        self.counters["resyncs"] += 1
        self.events.emit("resync", t=time.time(), fragment=p, round=st.round, hash=st.hash, donor=pid)
        self.vetting.took_from(p, pid, st.round)  # our head's witness until a record comes
        self.reset_sync(p, merged=set(st.merged))
        self.clocks.schedule_unclocked()
        if self.learner_loop.is_alive():
            self.learner_loop.deliver(p, st.round, rep.theta, True)

    def reconcile(self) -> None:
        """Where a live peer holds a head that beats ours, fetch it (records, else a snapshot); where this node
        is a lone outlier on another chain than the majority's, take the majority's (``outvoted``); where no
        member takes our head and members we merged agree on another of our round, take theirs (``unfollowed``)."""
        now = time.monotonic()
        members = self.live_members()
        for p in range(len(self.replicas)):
            head, holders = self.winning_heads(p, members, refused=self.vetting.refused_heads(p))
            yielding = False
            if not holders:  # a lone outlier, or a head of ours no member takes (node.swarm.trust.vetting)
                head, holders = self.outvoted(p, members)
                if not holders:
                    head, holders = self.vetting.unfollowed(p, members)
                yielding = bool(holders)
            if not holders:
                self.lagging_since.pop(p, None)
                continue
            if self.settings.elect_workers:
                # from a worker where one holds it: 32 Sybils echoing a member's head took nearly every pull
                # (no route), and learners fell behind (61 stale contributions in a 60 s run, none unattacked)
                holders = list(self.workers(p, dict.fromkeys(holders)))
            since = self.lagging_since.setdefault(p, now)
            # A pushed record is usually on its way; pull only when the gap outlives a heartbeat.
            if now - since >= 1.5 * self.settings.heartbeat_s and p not in self.syncing:
                # any holder will do: spread the pulls over them, the ones not backing off first (always the
                # first holder by peer id spent that donor's snapshot allowance, and a node fell behind)
                backoff = self.backoff
                ready = [q for q in holders if backoff.ready(q, now)] or holders
                self.spawn(self.catch_up(p, random.choice(ready), head, yielding))

    async def catch_up(self, p: int, pid: str, head: list, yielding: bool = False) -> None:
        """Follow ``pid``'s head of fragment p: by records where they bridge the gap (each one checked), else
        by a snapshot, which needs a ``credible`` head. ``yielding``: the head is the majority's, on another
        chain than ours (``outvoted``), and replaces ours even if ours ranks higher."""
        backoff = self.backoff
        if p in self.syncing or not backoff.ready(pid, time.monotonic()):
            return
        trusted = self.credible(p, pid, int(head[0]), self.live_members())
        if not trusted and not self.within_records(p, int(head[0])):
            self.untrusted(p, pid, int(head[0]))
            return
        self.syncing.add(p)
        try:
            rep = self.replicas[p]
            if not yielding and records_bridge(int(head[0]) - rep.round, self.pcfg):
                req = {"fragment": p, "from": rep.round + 1}
                reply = await self.transport.call(pid, "records", json.dumps(req).encode())
                if reply.ok:
                    try:
                        for raw in unpack_list(reply.body):
                            sr = decode_record(raw, self.settings.swarm, self.spec)
                            if sr.record.round != rep.round + 1 or sr.record.parent_hash != rep.hash:
                                break
                            self.apply(sr)
                    except ProtocolError as e:
                        if e.code not in (
                            RejectCode.FORGED_RECORD,
                            RejectCode.RECORD_TOO_LARGE,
                            RejectCode.UNELECTED,
                        ):
                            raise
                        if e.code is RejectCode.UNELECTED:
                            self.counters["unelected_refused"] += 1
                        lie = self.auditor.proven_lie(
                            sr
                        )  # a lie any node can check: its signer is banned everywhere
                        if lie is not None:
                            self.auditor.convict(sr, lie, self.peer_id)
                        # A record this node's own checks doubt: a snapshot of a head the swarm's majority
                        # holds (hash-checked) wins over the local heuristic; of any other, nothing is taken.
                        logger.warning("fragment %d: a record from %s failed our checks (%s)", p, pid, e)
            if yielding or self.head_key(self.heads[p]) > self.head_key(head):
                if not trusted:
                    self.untrusted(p, pid, int(head[0]))
                else:
                    # node.swarm.trust.vetting: raises where no chain checks a head the swarm does not hold (the
                    # majority's head, when yielding, needs no other witness)
                    if not yielding:
                        await self.vetting.vouch_head(pid, p, head)
                    async with self.fetching:  # SNAPSHOTS_IN_FLIGHT; a record may have come meanwhile
                        if yielding or self.head_key(self.heads[p]) > self.head_key(head):
                            await self.fetch_snapshot(pid, [p], yielding, None if yielding else head)
            self.lagging_since.pop(p, None)
            backoff.succeeded(pid)
        except (TransportError, ProtocolError) as e:
            now = time.monotonic()
            wait = backoff.failed(pid, now)
            log = logger.warning if backoff.should_log(pid, now) else logger.debug
            log(
                "catching up fragment %d from %s failed (%d in a row; next try in %.2g s): %s",
                p,
                pid,
                backoff.failures.get(pid, 0),
                wait,
                e,
            )
        finally:
            self.syncing.discard(p)

    async def on_snapshot(self, caller: str, raw: bytes) -> Reply:
        frags = parse_snapshot_request(raw)
        if not frags or any(p not in self.spec for p in frags):
            return Reply(
                False,
                RejectCode.WRONG_FRAGMENT.value,
                f"fragments {frags} not all in 0..{len(self.spec) - 1}",
            )
        bucket = self.snapshots
        wait = bucket.take(caller, len(frags), time.monotonic())
        if wait > 0:
            return Reply(
                False,
                RejectCode.RATE_LIMITED.value,
                f"{caller} fetched its {bucket.burst:g} fragment snapshots; "
                f"{bucket.per_s * 60:g} a minute more (retry in {min(wait, 1e9):.0f} s)",
            )
        states, lent = [], [self.replicas[p] for p in frags]
        credited = self.work.credited(self.logged_learners(), SNAPSHOT_IDS_MAX)
        for p in frags:
            rep, (r, h, n, w), tok = self.replicas[p], self.heads[p], self.merged_tokens[p]
            args = (rep.theta, rep.momentum, tok, rep.clock, self.merged_ids(p), credited)
            states.append(FragmentState(p, r, h, n, w, *args))
        with momentum_lent(lent):
            body = await asyncio.to_thread(encode_snapshot, states)
        return Reply(True, body=body)
