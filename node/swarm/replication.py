"""Replicated global state of a node (docs/design.md, section 4): applying signed merge records, merging
as the synchroniser, and the server side of the record and records ops. The base of
``node.swarm.agent.Node``, which owns the state and builds the components this reaches through it: the
view (``self.view``), the trust policy (``self.trust``, ``node.swarm.trust.policy``: asked at named points,
so that read without its calls this is the honest path), joining and catching up (``self.catch_up``), the
push of the records made here ``node.swarm.record_push``, the deadlines of the rounds that took our
contributions ``node.swarm.deadlines``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

from node.swarm.memory import momentum_lent
from node.swarm.transport import Reply
from node.swarm.view import credits
from node.swarm.wire import (
    SignedRecord,
    decode_record,
    encode_record,
    pack_list,
    parse_records_request,
)
from protocol.audit import frozen_view
from protocol.errors import HashMismatch, ProtocolError, RejectCode, UnprovenRefusal
from protocol.schedule import record_timing
from protocol.synchroniser import (
    Decision,
    Merge,
    Phase,
    SyncState,
    WakeAt,
    carried,
    on_contribution,
    on_merged,
    on_tick,
    quorum_basis,
    taken_at,
)

logger = logging.getLogger(__name__)


class Replication:
    """Record logic; ``Node`` provides the state it works on."""

    # ---------------------------------------------------------------- records
    def apply(self, sr: SignedRecord, made_here: bool = False, turn_waited: bool = False) -> None:
        """Apply a record that follows our head (raises ProtocolError otherwise); state and learner follow.

        ``made_here``: this node's synchroniser just made it, and its state machine moves on by itself. A
        record signed with our key that comes from a peer was made by an earlier life of this node (killed
        after it merged the round, before it checkpointed): it is checked, and our synchroniser's state is
        reset to it, as for anyone else's. (It was taken as made here: the state stayed a round behind the
        replica, and the node refused every contribution to that fragment as ``future_base``, 800 of them
        and an 88 s stall of two fragments in one chaos run.)

        ``turn_waited``: it was held out of turn while the election fence stood aside (``node.swarm.trust.held``),
        and is judged as the fence stood when it came: the fence may have closed meanwhile on a signer whose
        rounds had all been its own (an honest one was refused so in a suite run)."""
        rec = sr.record
        p = rec.fragment
        rep = self.replicas[p]
        if not made_here:
            self.trust.vet(sr, rep, self.pcfg, turn_waited)  # node.swarm.trust.policy
        raw = self.signed_files.keep(sr.raw, f"{p}-{rec.round}")  # on disk, where it can be
        # an audit recomputes the record at its parent: this state, which needs no walking back (node.swarm.trust.audit).
        # The momentum steps into new tensors for this record, so the parent's stays the parent's for as long
        # as the audit holds it: a contribution on an older base is rebuilt from it, and one rebuilt from a
        # replica walked back from later rounds differs by ulps, which the record codec's rounding now and then
        # turns into a whole step (honest records of the test swarm audited at gaps of 1e-3 to 7e-3).
        parent = None if made_here else self.trust.audit_parent(sr, rep)
        try:
            with momentum_lent([rep] if parent is not None else []):
                rep.apply_record(rec, self.pcfg, source=self._grad_source(raw))
        except HashMismatch:
            self.counters["hash_mismatches"] += 1
            self.events.emit("hash_mismatch", t=time.time(), fragment=p, round=rec.round, signer=sr.signer)
            raise
        self.heads[p] = tuple(sr.head)
        self.merged_tokens[p] += sum(c[4] for c in rec.contributors)
        self.trust.applied(sr)  # its ids merged, its learners' work credited
        log = self.logs[p]
        # the log keeps the signed bytes (what catch-up serves), not the decoded gradient: that was a whole
        # fp32 copy of the fragment per round kept
        log[rec.round] = replace(sr, raw=raw, record=replace(rec, grad={}, wire=None))
        while len(log) > self.pcfg.history:
            _, old = log.popitem(last=False)  # past a fork's reach: its learners settle as credited
            self.work.settle(c[0] for c in old.record.contributors if credits(old.signer, c[0], self.peer_id))
        self.deadlines.left_out(sr)  # a round that took our contribution and merged without it
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
            due=rec.due,
            period=rec.period,
            agreement=[round(a, 4) for a in rec.agreement],  # made here, robust: protocol.agreement
        )
        if not made_here:
            self.reset_sync(p, merged={c[1] for c in rec.contributors})
            self.trust.audit(sr, parent)
        self.clocks.schedule_unclocked()
        if self.learner_loop.is_alive():
            mine = [(c[3], c[4]) for c in rec.contributors if c[0] == self.peer_id]
            self.learner_loop.deliver(p, rec.round, rep.theta, False, mine)

    def _grad_source(self, raw):
        """How the replica gets a record's merged gradient again, to re-anchor a contribution taken on an
        older round: decoded from the signed bytes the log keeps (nothing else is held for it)."""
        return lambda: decode_record(bytes(raw), self.settings.swarm, self.spec).record.grad

    def reset_sync(
        self, p: int, merged: set[str] = frozenset(), promised: frozenset[str] = frozenset()
    ) -> None:
        """Our replica moved without our synchroniser: restart its state machine at the new round and carry
        over contributions that are still usable (not merged, base still anchored). ``promised``: the learners
        the new round waits for (``SyncState.promised``)."""
        old = self.syncs[p]
        rep = self.replicas[p]
        due = self.clocks.due(p)
        st = replace(
            SyncState(fragment=p, global_round=rep.round, live=old.live, working=old.working),
            due_at=None if due is None else due[0],
            due_every=0.0 if due is None else due[1],
            xi_step=old.xi_step,
            xi_quorum=old.xi_quorum,
            xi_sync=old.xi_sync,
            promised=promised,
        )
        self.syncs[p] = st
        self.leases.pop(p, None)
        now = self.loop.time()
        for c in list(old.pending.values()) + list(old.queued.values()):
            if c.cid in merged or not rep.keeps(c.base_round) or not carried(c, st):
                continue
            with contextlib.suppress(ProtocolError):
                self.decide(p, on_contribution(self.pcfg, self.syncs[p], c, now))

    def decide(self, p: int, d: Decision) -> None:
        self.syncs[p] = d.state
        for a in d.actions:
            if isinstance(a, WakeAt):
                delay = max(0.0, a.at - self.loop.time())
                self.loop.call_later(delay, self._tick, p)
            elif isinstance(a, Merge):
                self._merge(p, a)

    def _tick(self, p: int) -> None:
        self.decide(p, on_tick(self.pcfg, self.syncs[p], self.loop.time()))

    def _merge(self, p: int, a: Merge) -> None:
        if self.stopping():
            # Stopping: a round merged now lands after the members that stop with us wrote their final
            # state (`ddiloco up` ended on two hashes at 124M, whose slots come minutes apart). The
            # senders' watches find the round unmerged and send their contributions again.
            logger.info("fragment %d round %d not merged: this node is stopping", p, a.round)
            return
        kept = self.trust.merged_set(p, a.round, a.contributions)  # the distrusted left out
        if len(kept) < len(a.contributions):
            out = [c for c in a.contributions if c not in kept]
            self.counters["distrusted_left_out"] += len(out)
            self.events.emit(
                "distrusted", t=time.time(), fragment=p, round=a.round, learners=[c.learner for c in out]
            )
            if not kept:  # nothing to merge: the round starts over without them
                logger.info(
                    "fragment %d round %d: every contribution is from a distrusted learner", p, a.round
                )
                self.reset_sync(p, merged={c.cid for c in out})
                return
            a = replace(a, contributions=kept)
        t0 = self.loop.time()
        st = self.syncs[p]
        # The wall clock is the swarm's; the state machine runs on the loop's. The members' measured step
        # rates (each over its last steps, the warm-up left out); none measured yet: no schedule in this
        # record, and the learners go by their steps until a later one has one.
        rates = [1.0 / m.steps_per_s for m in self.view.live_members().values() if m.steps_per_s > 0]
        reported = [c.step_time_s for c in a.contributions]
        at = time.time() - (t0 - taken_at(st, t0))
        due, period = record_timing(
            p, self.clocks.current(), at, rates, reported, self.pcfg.sync_every, self.plan
        )
        self.spawn(self._merge_off_loop(p, a, len(quorum_basis(self.pcfg, st)), due, period, t0))

    async def _merge_off_loop(
        self, p: int, a: Merge, live: int, due: float, period: float, t0: float
    ) -> None:
        """Merge round ``a.round`` of fragment p on a worker thread, on a frozen view of the replica, then
        apply it here if the replica is still where the merge began. On the loop, a robust merge of GPT-2's
        embedding (38.6M parameters, three learners) held every request for seconds: contributions to the
        node went unanswered past their deadline, their learners failed the round over to the next
        synchroniser, and two records of one round forked the fragment."""
        rep = self.replicas[p]
        view = frozen_view(rep, merge=True)
        try:
            with momentum_lent([rep]):  # a record applied meanwhile steps new tensors, not the view's
                rec = await asyncio.to_thread(
                    view.make_record, a.round, a.contributions, self.pcfg, live=live, due=due, period=period
                )
        except ProtocolError as e:
            self._merge_abandoned(p, a, str(e))
            return
        if self.replicas[p] is not rep or (rep.round, rep.hash) != (view.round, view.hash):
            self._merge_abandoned(p, a, f"the replica moved to round {rep.round} meanwhile")
            return
        st = self.syncs[p]
        if st.phase is not Phase.MERGING or st.global_round != a.round - 1 or self.stopping():
            logger.info(
                "merge of fragment %d round %d dropped: its round was reset or the node stops", p, a.round
            )
            return
        left = list(st.pending.values()) + list(st.queued.values()) + list(a.contributions)
        if not self.trust.may_sign(p, a.round, rec, left):  # it would break a receipt: renounced
            return
        for learner, rms in view.norms.added:
            rep.norms.add(learner, rms)
        self.trust.agreed(rec, rec.agreement)  # protocol.agreement (robust merges only)
        rep.take_made(view)
        sr = SignedRecord(rec, self.peer_id, encode_record(self.settings.swarm, rec, self.identity))
        self.apply(sr, made_here=True)
        self.counters["records_made"] += 1
        self.leases.pop(p, None)
        sync_s = self.loop.time() - t0 + self.record_push.last_s(p)
        self.decide(p, on_merged(self.pcfg, self.syncs[p], self.loop.time(), sync_s, self.clocks.due(p)))
        self.spawn(self.record_push.broadcast(p, sr))

    def stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _merge_abandoned(self, p: int, a: Merge, why: str) -> None:
        """The replica moved under a merge (a record from elsewhere, a snapshot, an undo): start over at its
        round, unless that already happened."""
        logger.warning("merge of fragment %d round %d abandoned: %s", p, a.round, why)
        st = self.syncs[p]
        if st.phase is Phase.MERGING and st.global_round == a.round - 1:
            self.reset_sync(p)

    async def on_record(self, caller: str, raw: bytes) -> Reply:
        sr = None
        try:
            if not await self.view.known(caller):
                raise ProtocolError(RejectCode.UNKNOWN_PEER, f"{caller} is not a live member")
            sr = decode_record(raw, self.settings.swarm, self.spec)
            if sr.signer != self.peer_id and not self.view.recent(sr.signer):
                raise ProtocolError(RejectCode.UNKNOWN_PEER, f"record signed by {sr.signer}, not a member")
            # node.swarm.trust.evidence: a lie every node can check bans its signer. A record that follows our head
            # is checked once, as it is applied (``take_record``); one that does not is checked here
            rep = self.replicas[sr.record.fragment]
            follows = sr.record.round == rep.round + 1 and sr.record.parent_hash == rep.hash
            if not follows and (lie := self.trust.refute(sr, caller)) is not None:
                raise lie
            # A contributor we have never seen may have joined since our last read of the view (start-up:
            # the first rounds hold every node): look before ``ElectionFence.vouch`` calls the record forged.
            unseen = {c[0] for c in sr.record.contributors} - (
                self.view.members.keys() | self.view.peer_book.keys()
            )
            if unseen - {self.peer_id}:
                await self.view.look_up(min(unseen - {self.peer_id}))  # one read of the view covers them all
            return self.take_record(sr, caller)
        except ProtocolError as e:
            self.events.emit("reject", t=time.time(), peer=caller, code=e.code.value, why=str(e)[:300])
            # a forged or oversized record costs the peer that signed and pushed it
            proof = sr is not None and sr.signer == caller and not isinstance(e, UnprovenRefusal)
            self.penalise(caller, e.code, signed=proof)
            return Reply(False, e.code.value, str(e))

    def take_record(self, sr: SignedRecord, caller: str, waited: bool = False) -> Reply:
        rec = sr.record
        p = rec.fragment
        rep = self.replicas[p]
        if rec.round == rep.round + 1 and rec.parent_hash == rep.hash:
            if not waited and self.trust.held_out_of_turn(sr, caller):
                return Reply(True, message="held: out of turn while nobody is credited yet")
            try:
                self.apply(sr, turn_waited=waited)
            except ProtocolError as e:
                if not self.trust.refused(
                    sr, caller, e
                ):  # not trust's refusal: our state may be the odd one out
                    self.spawn(self.catch_up.catch_up(p, caller, sr.head))
                raise
            return Reply(True)
        mine = self.logs[p].get(rec.round)
        if mine is not None and mine.record.new_hash == rec.new_hash:
            return Reply(True, message="duplicate")
        theirs = sr.head
        if rec.round > rep.round + 1:  # a gap: we missed records (just joined, paused, cut off)
            if p not in self.syncing:
                self.spawn(self.catch_up.catch_up(p, caller, theirs))
            # Not the sender's fault: no refusal, no penalty.
            return Reply(True, message=f"behind: we are at round {rep.round}; catching up")
        if rec.round > rep.round:  # the next round on a chain that left ours: fetch from the sender
            self.spawn(self.catch_up.catch_up(p, caller, theirs))
            raise ProtocolError(
                RejectCode.WRONG_PARENT,
                f"record round {rec.round} (parent {rec.parent_hash[:8]}) "
                f"does not follow our round {rep.round} ({rep.hash[:8]}); catching up",
            )
        if rec.round == rep.round:  # a split brain: same round, other record
            self.counters["forks"] += 1
            ours_wins = self.view.head_key(self.heads[p]) < self.view.head_key(theirs)
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
                self.spawn(self.catch_up.catch_up(p, caller, theirs))
            return Reply(True, message="fork: " + ("ours wins" if ours_wins else "yours wins; re-syncing"))
        return Reply(True, message=f"ignored: we are at round {rep.round}")

    async def on_records(self, caller: str, raw: bytes) -> Reply:
        p, start = parse_records_request(raw)
        if p not in self.spec:
            return Reply(False, RejectCode.WRONG_FRAGMENT.value, f"fragment {p} does not exist")
        items = [bytes(sr.raw) for r, sr in self.logs[p].items() if r >= start]
        return Reply(True, body=pack_list(items))
