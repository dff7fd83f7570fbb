"""Replicated global state of a node (DESIGN §4): applying signed merge records, merging as the
synchroniser, pushing records, catching up from records or snapshots, joining by download, and the server
side of the record, records and snapshot ops. A mixin of ``node.agent.Node``, which owns the state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace

from dht.swarm import get_dht_time
from node.swarm.settings import NodeSettings
from node.swarm.transport import Reply, TransportError
from node.swarm.wire import (
    FragmentState,
    SignedRecord,
    decode_record,
    decode_snapshot,
    encode_record,
    encode_snapshot,
    pack_list,
    parse_records_request,
    parse_snapshot_request,
    unpack_list,
)
from protocol.codecs import encoded_nbytes
from protocol.errors import ProtocolError, RejectCode
from protocol.schedule import bounded_period, held_to_steps, round_due, sane_clock, swarm_period, usable
from protocol.synchroniser import (
    Decision,
    Merge,
    SyncState,
    WakeAt,
    on_contribution,
    on_merged,
    on_tick,
)

logger = logging.getLogger(__name__)
SNAPSHOT_BYTES_PER_PARAM = 8.0  # a fragment's snapshot: fp32 parameters and fp32 outer momentum


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


class Replication:
    """Record, catch-up and snapshot logic; ``Node`` provides the state it works on."""

    # ---------------------------------------------------------------- join, catch-up, re-sync
    async def _join_if_behind(self) -> None:
        """A node with no state: when the swarm is past round 0, download it (several donors) before training."""
        deadline = self.loop.time() + 3 * self.settings.heartbeat_s
        while (
            not self.members
            and NodeSettings.split(self.settings.initial_peers)
            and self.loop.time() < deadline
        ):
            await asyncio.sleep(self.settings.heartbeat_s / 2)
            await self._heartbeat_once()
        plan: dict[str, list[int]] = {}
        donors_of: dict[int, list[str]] = {}
        for p in range(len(self.replicas)):
            _, holders = self.winning_heads(p, self.members)
            if holders:
                donors_of[p] = holders
        if not donors_of:
            return
        for i, (p, donors) in enumerate(sorted(donors_of.items())):
            plan.setdefault(donors[i % len(donors)], []).append(p)
        t0 = time.time()
        # Keep this node's membership record fresh while it downloads: a big model takes longer than the
        # record lives, and a donor refuses a caller it no longer sees as a member.
        beats = self._spawn(self._publish_while_joining())
        try:
            results = await asyncio.gather(
                *(self._fetch_each(pid, frags) for pid, frags in plan.items()), return_exceptions=True
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
                    await self._fetch_snapshot(pid, [p])
                    break
                except (TransportError, ProtocolError) as e:
                    logger.warning("snapshot of fragment %d from %s failed: %s", p, pid, e)
        rounds = [r.round for r in self.replicas]
        self.learner.join(rounds, [r.theta for r in self.replicas])
        self.joined_by = f"download from {len(plan)} donor(s)"
        self.events.emit(
            "download",
            t=time.time(),
            donors=sorted(plan),
            fragments=sorted(donors_of),
            seconds=time.time() - t0,
        )

    async def _publish_while_joining(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            await self._heartbeat_once()

    async def _fetch_each(self, pid: str, frags: list[int]) -> list[int]:
        """Fetch ``frags`` from one donor, one fragment per request (a whole model in one message can
        outlast the RPC deadline); returns the fragments that failed, for the other donors to try."""
        failed = []
        for p in frags:
            try:
                await self._fetch_snapshot(pid, [p])
            except (TransportError, ProtocolError) as e:
                logger.warning("snapshot of fragment %d from %s failed: %s", p, pid, e)
                failed.append(p)
        return failed

    def swarm_step(self) -> float | None:
        """Where the peers' fragment schedules are now, in steps (the furthest peer, fractions included), or
        None when no peer has stepped yet.

        Each peer's step is extrapolated from when its membership record was issued at its published step
        rate. Read from the learner thread: ``members`` is only ever replaced whole."""
        now = get_dht_time()
        steps = [
            m.step + max(0.0, now - m.issued_at) * m.steps_per_s for m in self.members.values() if m.step > 0
        ]
        return max(steps, default=None)

    async def _fetch_snapshot(self, pid: str, frags: list[int]) -> None:
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
            self._install_snapshot(st, pid)

    def _install_snapshot(self, st: FragmentState, pid: str) -> None:
        p = st.fragment
        if self._head_key(self.heads[p]) <= self._head_key((st.round, st.hash, st.n, st.weight)):
            return  # ours is as good or better by now
        rep = self.replicas[p]
        rep.load_state(st.round, st.theta, st.momentum, sane_clock(st.clock, self.pcfg.sync_every))
        self.heads[p] = (st.round, st.hash, st.n, st.weight)
        self.merged_tokens[p] = st.tokens
        self.logs[p].clear()
        self.counters["resyncs"] += 1
        self.events.emit("resync", t=time.time(), fragment=p, round=st.round, hash=st.hash, donor=pid)
        self._reset_sync(p)
        if self.learner_loop.is_alive():
            self.learner_loop.deliver(p, st.round, rep.theta, True)

    async def _catch_up(self, p: int, pid: str, head: list) -> None:
        if p in self._syncing:
            return
        self._syncing.add(p)
        try:
            rep = self.replicas[p]
            if records_bridge(int(head[0]) - rep.round, self.pcfg):
                req = {"fragment": p, "from": rep.round + 1}
                reply = await self.transport.call(pid, "records", json.dumps(req).encode())
                if reply.ok:
                    for raw in unpack_list(reply.body):
                        sr = decode_record(raw, self.settings.swarm, self.spec)
                        if sr.record.round != rep.round + 1 or sr.record.parent_hash != rep.hash:
                            break
                        self._apply(sr)
            if self._head_key(self.heads[p]) > self._head_key(head):
                await self._fetch_snapshot(pid, [p])
            self.lagging_since.pop(p, None)
        except (TransportError, ProtocolError) as e:
            logger.warning("catching up fragment %d from %s failed: %s", p, pid, e)
        finally:
            self._syncing.discard(p)

    # ---------------------------------------------------------------- records
    def _apply(self, sr: SignedRecord) -> None:
        """Apply a record that follows our head (raises ProtocolError otherwise); state and learner follow."""
        rec = sr.record
        p = rec.fragment
        rep = self.replicas[p]
        own = sr.signer == self.peer_id
        try:
            rep.apply_record(rec, self.pcfg)
        except ProtocolError as e:
            if "lands on" in str(e):
                self.counters["hash_mismatches"] += 1
                self.events.emit(
                    "hash_mismatch", t=time.time(), fragment=p, round=rec.round, signer=sr.signer
                )
            raise
        self.heads[p] = tuple(sr.head)
        self.merged_tokens[p] += sum(c[4] for c in rec.contributors)
        self.guard.merged(c[1] for c in rec.contributors)
        log = self.logs[p]
        log[rec.round] = sr
        while len(log) > self.pcfg.history:
            log.popitem(last=False)
        self.counters["records_applied"] += 1
        self.events.emit(
            "merge",
            t=time.time(),
            fragment=p,
            round=rec.round,
            hash=rec.new_hash,
            cids=[c[1] for c in rec.contributors],
            learners=[c[0] for c in rec.contributors],
            weights=[c[2] for c in rec.contributors],
            signer=sr.signer,
        )
        if not own:
            self._reset_sync(p, merged={c[1] for c in rec.contributors})
        if self.learner_loop.is_alive():
            mine = [(c[3], c[4]) for c in rec.contributors if c[0] == self.peer_id]
            self.learner_loop.deliver(p, rec.round, rep.theta, False, mine)

    def _reset_sync(self, p: int, merged: set[str] = frozenset()) -> None:
        """Our replica moved without our synchroniser: restart its state machine at the new round and carry
        over contributions that are still usable (not merged, base still anchored)."""
        old = self.syncs[p]
        rep = self.replicas[p]
        due = self._schedule_of(p)
        st = replace(
            SyncState(fragment=p, global_round=rep.round, live=old.live),
            due_at=None if due is None else due[0],
            due_every=0.0 if due is None else due[1],
            xi_step=old.xi_step,
            xi_quorum=old.xi_quorum,
            xi_sync=old.xi_sync,
        )
        self.syncs[p] = st
        self.leases.pop(p, None)
        now = self.loop.time()
        for c in list(old.pending.values()) + list(old.queued.values()):
            if c.cid in merged or c.base_round not in rep.history:
                continue
            with contextlib.suppress(ProtocolError):
                self._decide(p, on_contribution(self.pcfg, self.syncs[p], c, now))

    def _schedule_of(self, p: int) -> tuple[float, float] | None:
        """When fragment p's open round is due on the swarm's schedule, on this loop's clock (the state
        machines run on it; the schedule is on the wall clock every node shares), and its repeat period."""
        now = time.time()
        c = usable(self.replicas[p].clock, now)
        if c is None:
            return None
        return c.first - now + self.loop.time(), c.every

    def _decide(self, p: int, d: Decision) -> None:
        self.syncs[p] = d.state
        for a in d.actions:
            if isinstance(a, WakeAt):
                delay = max(0.0, a.at - self.loop.time())
                self.loop.call_later(delay, self._tick, p)
            elif isinstance(a, Merge):
                self._merge(p, a)

    def _tick(self, p: int) -> None:
        self._decide(p, on_tick(self.pcfg, self.syncs[p], self.loop.time()))

    def _merge(self, p: int, a: Merge) -> None:
        rep = self.replicas[p]
        t0 = self.loop.time()
        st = self.syncs[p]
        # The slot the round was taken at: nearest to its quorum (a straggler of an earlier slot may have
        # arrived first). The wall clock is the swarm's; the state machine runs on the loop's.
        at = st.quorum_at if st.quorum_at is not None else (st.first_at if st.first_at is not None else t0)
        due = round_due(rep.clock, time.time() - (t0 - at))
        # The members' measured step rates (each over its last steps, the warm-up left out); none measured
        # yet: no schedule in this record, and the learners go by their steps until a later one has one.
        rates = [1.0 / m.steps_per_s for m in self.live_members().values() if m.steps_per_s > 0]
        period = rep.clock.every / self.pcfg.sync_every if rep.clock is not None else 0.0
        if rates:
            period = bounded_period(swarm_period(rates, fallback=0.0), rep.clock, self.pcfg.sync_every)
            # and within a factor of the step time the round's own learners report: a first period (no clock
            # to hold it to) taken from rates measured over a slow start cannot throw the round minutes out
            period = held_to_steps(period, [c.step_time_s for c in a.contributions])
        try:
            rec = rep.make_record(
                a.round, a.contributions, self.pcfg, live=len(st.live), due=due, period=period
            )
        except ProtocolError as e:  # the replica moved under us (a record from elsewhere): start over
            logger.warning("merge of fragment %d round %d abandoned: %s", p, a.round, e)
            self._reset_sync(p)
            return
        sr = SignedRecord(rec, self.peer_id, encode_record(self.settings.swarm, rec, self.identity))
        self._apply(sr)
        self.counters["records_made"] += 1
        self.leases.pop(p, None)
        sync_s = self.loop.time() - t0 + self._push_s.get(p, 0.0)
        self._decide(p, on_merged(self.pcfg, self.syncs[p], self.loop.time(), sync_s, self._schedule_of(p)))
        self._spawn(self._broadcast(p, sr))

    async def _broadcast(self, p: int, sr: SignedRecord) -> None:
        t0 = self.loop.time()
        targets = [pid for pid, m in self.live_members().items() if pid != self.peer_id and not m.client_mode]
        await asyncio.gather(*(self._push(pid, sr.raw) for pid in targets))
        self._push_s[p] = self.loop.time() - t0

    async def _push(self, pid: str, raw: bytes) -> None:
        try:
            reply = await self.transport.call(pid, "record", raw, timeout_s=self.settings.rpc_timeout_s)
            if not reply.ok:
                logger.info("record refused by %s: %s %s", pid, reply.code, reply.message)
        except TransportError as e:
            logger.info("record push to %s failed: %s", pid, e)

    async def _h_record(self, caller: str, raw: bytes) -> Reply:
        try:
            if not await self._known(caller):
                raise ProtocolError(RejectCode.UNKNOWN_PEER, f"{caller} is not a live member")
            sr = decode_record(raw, self.settings.swarm, self.spec)
            if sr.signer != self.peer_id and sr.signer not in self.members:
                raise ProtocolError(RejectCode.UNKNOWN_PEER, f"record signed by {sr.signer}, not a member")
            return self._on_record(sr, caller)
        except ProtocolError as e:
            self.events.emit("reject", t=time.time(), peer=caller, code=e.code.value, why=str(e)[:300])
            self.penalise(caller, e.code)
            return Reply(False, e.code.value, str(e))

    def _on_record(self, sr: SignedRecord, caller: str) -> Reply:
        rec = sr.record
        p = rec.fragment
        rep = self.replicas[p]
        if rec.round == rep.round + 1 and rec.parent_hash == rep.hash:
            try:
                self._apply(sr)
            except ProtocolError:
                self._spawn(self._catch_up(p, caller, sr.head))
                raise
            return Reply(True)
        mine = self.logs[p].get(rec.round)
        if mine is not None and mine.record.new_hash == rec.new_hash:
            return Reply(True, message="duplicate")
        theirs = sr.head
        if rec.round > rep.round + 1:  # a gap: we missed records (just joined, paused, cut off)
            if p not in self._syncing:
                self._spawn(self._catch_up(p, caller, theirs))
            # Not the sender's fault: no refusal, no penalty.
            return Reply(True, message=f"behind: we are at round {rep.round}; catching up")
        if rec.round > rep.round:  # the next round on a chain that left ours: fetch from the sender
            self._spawn(self._catch_up(p, caller, theirs))
            raise ProtocolError(
                RejectCode.WRONG_PARENT,
                f"record round {rec.round} (parent {rec.parent_hash[:8]}) "
                f"does not follow our round {rep.round} ({rep.hash[:8]}); catching up",
            )
        if rec.round == rep.round:  # a split brain: same round, other record
            self.counters["forks"] += 1
            ours_wins = self._head_key(self.heads[p]) < self._head_key(theirs)
            self.events.emit(
                "fork",
                t=time.time(),
                fragment=p,
                round=rec.round,
                ours=rep.hash,
                theirs=rec.new_hash,
                winner="ours" if ours_wins else "theirs",
                peer=caller,
            )
            if not ours_wins:
                self._spawn(self._catch_up(p, caller, theirs))
            return Reply(True, message="fork: " + ("ours wins" if ours_wins else "yours wins; re-syncing"))
        return Reply(True, message=f"ignored: we are at round {rep.round}")

    async def _h_records(self, caller: str, raw: bytes) -> Reply:
        if not await self._known(caller):
            return Reply(False, RejectCode.UNKNOWN_PEER.value, f"{caller} is not a live member")
        try:
            p, start = parse_records_request(raw)
        except ProtocolError as e:
            return Reply(False, e.code.value, str(e))
        if p not in self.spec:
            return Reply(False, RejectCode.WRONG_FRAGMENT.value, f"fragment {p} does not exist")
        items = [sr.raw for r, sr in self.logs[p].items() if r >= start]
        return Reply(True, body=pack_list(items))

    async def _h_snapshot(self, caller: str, raw: bytes) -> Reply:
        if not await self._known(caller):
            return Reply(False, RejectCode.UNKNOWN_PEER.value, f"{caller} is not a live member")
        try:
            frags = parse_snapshot_request(raw)
        except ProtocolError as e:
            return Reply(False, e.code.value, str(e))
        if not frags or any(p not in self.spec for p in frags):
            return Reply(
                False,
                RejectCode.WRONG_FRAGMENT.value,
                f"fragments {frags} not all in 0..{len(self.spec) - 1}",
            )
        states = []
        for p in frags:
            rep = self.replicas[p]
            r, h, n, w = self.heads[p]
            states.append(
                FragmentState(p, r, h, n, w, rep.theta, rep.momentum, self.merged_tokens[p], rep.clock)
            )
        body = await asyncio.to_thread(encode_snapshot, states)
        return Reply(True, body=body)
