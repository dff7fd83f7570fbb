"""Audits of merge records (docs/security.md, "Audited merges").

A merge record names, per contributor, the sha256 of the message its learner signed (``protocol.audit``). The
members that sent or merged a contribution keep its signed message for a while (``AuditArchive``) and serve
it to any member (``kept`` op). For a share of records (``--audit``), the member drawn by the record's own hash
among the electable members other than its signer (its contributors, where any is electable) fetches the messages (from their learners first, then the
signer), checks each against the record's digest and its learner's signature, and merges them again on its
replica walked back to the record's parent. A record that lands more than ``AUDIT_TOLERANCE`` from the
recompute, or that names counters its learners did not sign, is a lie anyone can check: the signed record and
the signed messages. The auditor bans the signer, undoes the record and every round on top of it
(``FragmentReplica.rewind``), and hands the proof on (``proof`` op); each member checks it alone, does the
same and hands it on once. A record on an undone chain is refused (``undone``) from then on.

A record that breaks a rule every node checks the same way needs no recompute: it bans its signer at once and
goes on as evidence (``proven_lie``, ``convict``, ``evidence`` op; the rules are ``node.swarm.trust.evidence``).

``Auditor`` owns the archive, the undone set and the proofs waiting; the node hands it its state and its
collaborators (the view's live members, the replication's reset of a fragment's synchroniser, the transport's
call) when it builds it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from node.swarm.memory import momentum_lent
from node.swarm.transport import Reply, TransportError
from node.swarm.trust.audit_archive import FETCH_MAX, AuditArchive, parse_kept_request
from node.swarm.trust.evidence import proof_config
from node.swarm.wire import SignedRecord, decode_record, pack_list, unpack_list, verify_contribution
from protocol.audit import AUDIT_TOLERANCE, audit_gap, frozen_view
from protocol.errors import ProtocolError, RejectCode
from protocol.messages import decode_contribution
from protocol.replica import FragmentReplica
from protocol.synchroniser import Contribution, round_share

logger = logging.getLogger(__name__)
AUDITORS = 1  # members drawn to recompute an audited record
PROOF_MESSAGES = 1024  # messages one proof may carry (one per contributor of its record)
FANOUT = 16  # members one node hands evidence or a proof to (each passes it on once)
WAITING_PROOFS = 64  # proofs of records this node has not reached yet, kept to check when it does
SUSPECT_S = 60.0  # how long a member accused by a proof this node cannot check yet is not elected here
CLEARED = 4096  # hashes of records an audit here found faithful (``_audit_held`` leaves them be)
SHARE_LIVE_SLACK, SHARE_LIVE_EXTRA = 2, 2  # live learners a signed share may claim: 2x this view's, plus 2


class MessagesUnserved(ProtocolError):
    """A record's messages, asked of its learners and then of its signer, were not served: the record is
    unproven (``Auditor.audit``)."""


class Auditor:
    """The audits this node makes and the convictions it hands on. ``call(peer, op, body)`` is the transport's
    call (the transport is made when the node runs); ``live_members()`` and ``learner_only()`` are the view's;
    ``agreed(record, cosines)`` takes a recomputed merge's cosines (``protocol.agreement``); ``reset_sync(p)``
    starts fragment p's synchroniser over on an undo; ``spawn(coro)`` runs a task of the node's."""

    def __init__(
        self,
        settings,
        pcfg,
        peer_id: str,
        spec: dict,
        total_numel: int,
        replicas: list[FragmentReplica],
        logs: list,
        heads: list,
        signed_files,
        peer_scores,
        suspect: dict[str, float],
        counters: dict[str, int],
        events,
        learner_loop,
        *,
        call: Callable[[str, str, bytes], Awaitable[Reply]],
        live_members: Callable[[], dict],
        learner_only: Callable[[], bool],
        agreed: Callable[[object, list], None],
        reset_sync: Callable[[int], None],
        spawn: Callable,
    ) -> None:
        self.settings, self.pcfg, self.peer_id, self.spec = settings, pcfg, peer_id, spec
        self.replicas, self.logs, self.heads = replicas, logs, heads
        self.peer_scores, self.suspect, self.counters, self.events = peer_scores, suspect, counters, events
        self.learner_loop = learner_loop
        self.call, self.live_members, self.learner_only = call, live_members, learner_only
        self.agreed, self.reset_sync, self.spawn = agreed, reset_sync, spawn
        # the signed messages this node sent or merged (empty where it audits nothing): twice the model's
        # parameters in bytes, about 3.5 rounds of every fragment's int4 contributions
        self.archive = AuditArchive(max(32 << 20, 2 * total_numel), signed_files)
        # hashes of records this node undid (convicted, or on top of one): a chain it no longer follows
        self.undone: set[str] = set()
        self._cleared: OrderedDict[str, None] = OrderedDict()  # records an audit here found faithful
        # one recompute at a time: each holds its fragment's state walked back and a merge of it (at 124M,
        # three audits and a merge at once took a node 1x its weights above its steady state)
        self._recomputing = asyncio.Semaphore(1)
        # (fragment, round, new hash) -> (record, messages, caller) of proofs this node cannot check yet
        self._waiting_proofs: OrderedDict[tuple[int, int, str], tuple] = OrderedDict()
        self._proof_cfg = proof_config(pcfg)  # the bounds a record is a proven lie against

    def keep_message(self, raw: bytes, sig: bytes) -> str | None:
        """Keep a signed contribution message for audits, where this swarm audits: its digest, else None."""
        return self.archive.put(raw, sig) if self.settings.audit_share > 0 else None

    # ---------------------------------------------------------------- who audits
    def audits(self, sr: SignedRecord) -> bool:
        """Whether this node audits ``sr``: a share of records chosen by their hash, and among the members that
        may synchronise (not its signer; those the record names as contributors, where any is) the
        ``AUDITORS`` first by sha256(record hash | peer id)."""
        rec, share = sr.record, self.settings.audit_share
        if share <= 0 or sr.signer == self.peer_id or not rec.digests or "" in rec.digests:
            return False
        if int(rec.new_hash[:8], 16) >= share * 0x100000000:
            return False
        if self.settings.client_mode or self.learner_only():
            return False
        pool = {q for q, m in self.live_members().items() if not m.client_mode and q != sr.signer}
        pool.add(self.peer_id)
        # its contributors first: each holds its own message already (a quarter less to fetch, of 4)
        pool = (pool & {c[0] for c in rec.contributors}) or pool

        def rank(q: str) -> str:
            return hashlib.sha256(f"{rec.new_hash}|{q}".encode()).hexdigest()

        return self.peer_id in sorted(pool, key=rank)[:AUDITORS]

    # ---------------------------------------------------------------- the audit
    async def audit(self, sr: SignedRecord, parent: FragmentReplica | None = None) -> float | None:
        """Recompute ``sr`` and convict its signer where it lied; the gap, or None where this node cannot tell.
        ``parent``: a frozen view of the replica taken just before ``sr`` was applied (``recompute``)."""
        rec = sr.record
        t0 = time.monotonic()
        try:
            msgs = await self.fetch_messages(sr)
        except (TransportError, ProtocolError) as e:
            self.counters["audits_unfetched"] += 1
            self.events.emit(
                "audit", t=time.time(), fragment=rec.fragment, round=rec.round, signer=sr.signer, gap=None
            )
            if isinstance(e, MessagesUnserved):
                # The signer keeps every message it merged (``keep_message``) and did not serve them: its
                # record is unproven, and its signer is passed over here as one accused (not banned: a
                # signer that died since cannot serve either, and that proves no lie)
                self.counters["audits_unproven"] += 1
                self.suspect[sr.signer] = max(self.suspect.get(sr.signer, 0.0), time.monotonic() + SUSPECT_S)
                self.events.emit(
                    "unproven", t=time.time(), fragment=rec.fragment, round=rec.round, signer=sr.signer
                )
            logger.info(
                "audit of fragment %d round %d: messages not fetched (%s)", rec.fragment, rec.round, e
            )
            return None
        cosines: list[float] = []
        try:
            gap = await self.recompute(sr, msgs, parent, cosines)
        except ProtocolError as e:  # a message that is not what the record names, or not its learner's
            logger.info("audit of fragment %d round %d: %s", rec.fragment, rec.round, e)
            gap = None
        if gap is None:
            return None
        self.counters["audits"] += 1
        self.events.emit(
            "audit",
            t=time.time(),
            fragment=rec.fragment,
            round=rec.round,
            signer=sr.signer,
            gap=gap,
            seconds=round(time.monotonic() - t0, 3),
        )
        if gap > AUDIT_TOLERANCE:
            self.convict_merge(sr, msgs, self.peer_id, gap)
        else:
            cleared = self._cleared
            cleared[rec.new_hash] = None
            while len(cleared) > CLEARED:
                cleared.popitem(last=False)
            if self.pcfg.distrust and cosines:
                # the merge recomputed here measured each learner as this node's own merges do: evidence for
                # its judgement (protocol.agreement), with each merge an auditor sees beside those it makes
                self.agreed(rec, cosines)
        return gap

    async def audit_held(self, peer: str) -> None:
        """On a new ban of ``peer`` for a signed lie: each record of it this node's logs hold that no audit here
        cleared is audited now, and walked back where no audit can tell (its messages gone, a swarm that
        audits nothing): the members that banned the signer first refuse it, so no chain of theirs passes
        through it. One member audits a record (``AUDITORS``); where that member had banned the signer
        already, it refused the record (``banned``) and never audited it, and a node that had applied it kept
        it: under load one node stayed a round ahead on a negated merge the others refused, and the swarm
        never settled on one hash."""
        for p, log in enumerate(self.logs):
            for r in sorted(r for r, x in log.items() if x.signer == peer):
                held = log.get(r)
                if held is None or held.signer != peer or held.record.new_hash in self.undone:
                    break  # walked back meanwhile (from this round or one below)
                if held.record.new_hash in self._cleared:
                    continue
                sr = decode_record(bytes(held.raw), self.settings.swarm, self.spec)
                auditable = (
                    self.settings.audit_share > 0 and sr.record.digests and "" not in sr.record.digests
                )
                gap = await self.audit(sr) if auditable else None
                if gap is None and sr.record.new_hash not in self.undone:
                    logger.warning(
                        "fragment %d round %d, signed by %s (banned): not audited here, walked back",
                        p,
                        r,
                        peer,
                    )
                    self.undo(sr)

    async def fetch_messages(self, sr: SignedRecord) -> list[tuple[bytes, bytes]]:
        """The signed messages ``sr`` names, in its order: ours, then each learner's own from it, then what is
        still missing from its signer (``FETCH_MAX`` to a request)."""
        rec = sr.record
        got = {d: self.archive.get(d) for d in rec.digests}
        own: dict[str, list[str]] = {}
        for c, d in zip(rec.contributors, rec.digests):
            own.setdefault(c[0], []).append(d)
        asks = [(q, ds) for q, ds in own.items() if q != self.peer_id]
        for q, ds in asks + [(sr.signer, None)]:
            want = [d for d in (ds if ds is not None else got) if got[d] is None]
            for i in range(0, len(want), FETCH_MAX):
                try:
                    body = json.dumps({"digests": want[i : i + FETCH_MAX]}).encode()
                    reply = await self.call(q, "kept", body)
                except TransportError:
                    break
                if not reply.ok:
                    break
                items = unpack_list(reply.body, max_items=2 * FETCH_MAX)
                for raw, sig in zip(items[::2], items[1::2]):
                    d = hashlib.sha256(raw).hexdigest()
                    if d in got and got[d] is None:
                        got[d] = (raw, sig)
        missing = [d for d, m in got.items() if m is None]
        if missing:
            # asked last, the signer did not serve them either (``audit``)
            raise MessagesUnserved(
                RejectCode.UNKNOWN_PEER, f"{len(missing)} of {len(got)} messages not found"
            )
        return [got[d] for d in rec.digests]

    def contributions_of(
        self, sr: SignedRecord, msgs: list[tuple[bytes, bytes]]
    ) -> tuple[list[Contribution], str]:
        """The messages as the record's contributions, each checked against the record's digest and its
        learner's signature (ProtocolError where not: they prove nothing), and what the record claims of
        them that their signed headers refute ("" where nothing)."""
        rec, p = sr.record, sr.record.fragment
        if len(msgs) != len(rec.contributors):
            raise ProtocolError(RejectCode.MALFORMED, f"{len(msgs)} messages for {len(rec.contributors)}")
        out, lie = [], ""
        for (learner, cid, _, steps, tokens), digest, (raw, sig) in zip(rec.contributors, rec.digests, msgs):
            if hashlib.sha256(raw).hexdigest() != digest:
                raise ProtocolError(RejectCode.MALFORMED, f"message of {cid} is not the one the record names")
            verify_contribution(self.settings.swarm, learner, raw, sig)
            h, delta = decode_contribution(raw, self.spec[p], decode=False)
            if (h.learner, h.fragment, h.cid) != (learner, p, cid):
                lie = lie or f"{cid}: the record names another learner, fragment or id than its message"
            if (h.c_steps, h.c_tokens) != (steps, tokens):
                lie = lie or f"{cid}: counters {steps}/{tokens}, signed {h.c_steps}/{h.c_tokens}"
            self.replicas[p].check_delta(delta)  # shapes and finiteness: an honest merge refused it
            c = Contribution(h.learner, p, h.base_round, h.c_steps, h.c_tokens, h.step_time_s, delta, cid)
            out.append(c)
        return out, lie

    async def recompute(
        self,
        sr: SignedRecord,
        msgs: list[tuple[bytes, bytes]],
        parent: FragmentReplica | None = None,
        agreement: list[float] | None = None,
    ) -> float | None:
        """How far ``sr`` lands from its contributions merged again here (inf: it names what they refute);
        None where this node cannot tell (its state does not reach the record's parent). On ``parent`` (the
        replica as it was before ``sr``; ``Replication.apply`` stepped the momentum of ``sr`` into new tensors,
        so the view's is the parent's still): nothing is walked back, which saved a copy of the fragment
        (147 MB for GPT-2's embedding), and the recompute is the synchroniser's own arithmetic on the same
        state, bit for bit, older bases included. Without it (a held record audited on a ban), the replica is
        walked back from a later round: within ulps, which the record codec rounds to a whole step now and
        then."""
        rec = sr.record
        rep = self.replicas[rec.fragment]
        cs, lie = self.contributions_of(sr, msgs)
        if lie or self.share_lie(rec, cs):
            return float("inf")
        async with self._recomputing:
            oldest = min([c.base_round for c in cs] + [rec.round - 1])
            at = parent is not None and parent.round == rec.round - 1 and parent.keeps(oldest)
            if not at and not (self._holds_parent(rec) and rep.keeps(oldest)):
                return None
            view = parent if at else frozen_view(rep)
            with momentum_lent([] if at else [rep]):
                try:
                    return await asyncio.to_thread(audit_gap, view, rec, cs, self.pcfg, agreement)
                except ProtocolError as e:
                    logger.info("audit of fragment %d round %d not possible: %s", rec.fragment, rec.round, e)
                    return None

    def share_lie(self, rec, cs: list[Contribution]) -> bool:
        """Whether the round's signed ``share`` is below what its own contributions justify. Without ``carry``
        every round is whole: share 1. With it the synchroniser scales a round by its steps over a full round
        of its live learners (``protocol.synchroniser.round_share``), so a share claims how many learners were
        live: a lie where it claims more than ``SHARE_LIVE_SLACK`` x (this node's live members) +
        ``SHARE_LIVE_EXTRA``. Views differ (a join, a member whose record just expired), not by that much; a
        share of 0.02 on a round of 3 learners' full work claims 150 live learners."""
        if rec.share >= 1.0:
            return False
        if not self.pcfg.carry:  # every round is whole: the synchroniser signs a share of 1
            logger.warning(
                "fragment %d round %d: share %.3g signed, 1 without carry", rec.fragment, rec.round, rec.share
            )
            return True
        most = SHARE_LIVE_SLACK * len(self.live_members()) + SHARE_LIVE_EXTRA
        justified = round_share(cs, self.pcfg, most)
        if rec.share < justified:
            logger.warning(
                "fragment %d round %d: share %.3g signed, its contributions justify at least %.3g",
                rec.fragment,
                rec.round,
                rec.share,
                justified,
            )
            return True
        return False

    def recheck(self, sr: SignedRecord) -> None:
        """A record just applied here that a proof we could not check yet names: check it now."""
        rec = sr.record
        got = self._waiting_proofs.pop((rec.fragment, rec.round, rec.new_hash), None)
        if got is not None:
            self.spawn(self.on_proof(got[2], pack_list([bytes(got[0].raw), *(x for m in got[1] for x in m)])))

    def _holds_parent(self, rec) -> bool:
        """Whether this node's chain of the fragment passes through the record's parent."""
        rep, log = self.replicas[rec.fragment], self.logs[rec.fragment]
        if rep.round == rec.round - 1:
            return rep.hash == rec.parent_hash
        here, before = log.get(rec.round), log.get(rec.round - 1)
        return (here is not None and here.record.parent_hash == rec.parent_hash) or (
            before is not None and before.record.new_hash == rec.parent_hash
        )

    # ---------------------------------------------------------------- evidence: lies every node checks alike
    def proven_lie(self, sr: SignedRecord) -> ProtocolError | None:
        """What ``sr`` proves its signer did wrong, by the checks every node makes alike; None: nothing."""
        if sr.signer == self.peer_id:
            return None
        try:
            self.replicas[sr.record.fragment].check_record(sr.record, self._proof_cfg)
        except ProtocolError as e:
            return e
        return None

    def convict(self, sr: SignedRecord, lie: ProtocolError, source: str) -> bool:
        """Ban ``sr``'s signer for the lie it signed and pass the record on; True if the ban is new."""
        if self.peer_scores.banned(sr.signer, time.monotonic()):
            return False
        return self.ban_and_hand_on(sr, lie.code.value, source, "evidence", bytes(sr.raw))

    # ---------------------------------------------------------------- conviction and undo
    def convict_merge(
        self, sr: SignedRecord, msgs: list[tuple[bytes, bytes]], source: str, gap: float
    ) -> None:
        rec = sr.record
        if rec.new_hash in self.undone:
            return
        self.undone.add(rec.new_hash)
        body = pack_list([bytes(sr.raw), *(x for m in msgs for x in m)])
        fields = {"fragment": rec.fragment, "round": rec.round, "gap": gap}
        self.undo(sr)
        self.ban_and_hand_on(sr, "unfaithful_merge", source, "proof", body, **fields)

    def ban_and_hand_on(
        self, sr: SignedRecord, why: str, source: str, op: str, body: bytes, **fields
    ) -> bool:
        """Ban ``sr``'s signer for what it signed, say so (a ``ban`` event), and hand ``body``, what proves it,
        to up to ``FANOUT`` members over ``op`` (each checks it alone and passes it on once). True: a new ban."""
        new = self.peer_scores.ban(sr.signer, time.monotonic(), why)
        if new:
            self.counters["convictions"] += 1
            self.spawn(self.audit_held(sr.signer))
        self.events.emit(
            "ban",
            t=time.time(),
            peer=sr.signer,
            seconds=self.peer_scores.ban_s,
            last=why,
            evidence=source,
            **fields,
        )
        members = self.live_members()
        targets = [
            q for q, m in members.items() if q not in (self.peer_id, sr.signer, source) and not m.client_mode
        ]
        self.spawn(self._hand_on(op, body, random.sample(targets, min(len(targets), FANOUT))))
        return new

    def undo(self, sr: SignedRecord) -> None:
        """Walk fragment p back to the convicted record's parent round, if this node applied the record."""
        rec, p = sr.record, sr.record.fragment
        rep, log = self.replicas[p], self.logs[p]
        mine = log.get(rec.round)
        if mine is None or mine.record.new_hash != rec.new_hash or not rep.keeps(rec.round - 1):
            return
        self.undone.update(log[r].record.new_hash for r in log if r >= rec.round)
        rep.rewind(rec.round - 1)
        for r in [r for r in log if r >= rec.round]:
            del log[r]
        prev = log.get(rec.round - 1)
        n, w = (len(prev.record.contributors), prev.total_weight) if prev is not None else (0, 0.0)
        self.heads[p] = (rep.round, rep.hash, n, w)
        self.counters["rounds_undone"] += 1
        self.events.emit("undo", t=time.time(), fragment=p, round=rec.round, signer=sr.signer, hash=rep.hash)
        self.reset_sync(p)
        if self.learner_loop.is_alive():
            self.learner_loop.deliver(p, rep.round, rep.theta, True)

    async def _hand_on(self, op: str, body: bytes, targets: list[str]) -> None:
        async def one(q: str) -> None:
            try:
                await self.call(q, op, body)
            except TransportError:
                pass  # it learns of the lie from another member, or when the liar sends it something

        await asyncio.gather(*(one(q) for q in targets))

    # ---------------------------------------------------------------- ops (server side)
    async def on_kept(self, caller: str, raw: bytes) -> Reply:
        digests = parse_kept_request(raw)
        found = [m for m in (self.archive.get(d) for d in digests) if m is not None]
        return Reply(True, body=pack_list([x for m in found for x in m]))

    async def on_evidence(self, caller: str, raw: bytes) -> Reply:
        sr = decode_record(raw, self.settings.swarm, self.spec)
        lie = self.proven_lie(sr)
        if lie is None:
            raise ProtocolError(RejectCode.MALFORMED, f"evidence against {sr.signer} proves no lie")
        self.convict(sr, lie, caller)
        return Reply(True)

    async def on_proof(self, caller: str, body: bytes) -> Reply:
        items = unpack_list(body, max_items=1 + 2 * PROOF_MESSAGES)
        if not items or len(items) % 2 != 1:
            raise ProtocolError(RejectCode.MALFORMED, "a proof is [record, message, signature, ...]")
        sr = decode_record(items[0], self.settings.swarm, self.spec)
        if sr.record.new_hash in self.undone or sr.signer == self.peer_id:
            return Reply(True, message="known")
        msgs = list(zip(items[1::2], items[2::2]))
        gap = await self.recompute(sr, msgs)
        if gap is None:  # checked again if we apply that record later (``recheck``)
            # meanwhile its signer, accused with a well-formed proof, is not elected here (not banned: a
            # suspicion this node cannot check ends by itself, as a stall's does)
            until = time.monotonic() + SUSPECT_S
            self.suspect[sr.signer] = max(self.suspect.get(sr.signer, 0.0), until)
            self.peer_scores.accuse(sr.signer, until)
            waiting = self._waiting_proofs
            waiting[(sr.record.fragment, sr.record.round, sr.record.new_hash)] = (sr, msgs, caller)
            while len(waiting) > WAITING_PROOFS:
                waiting.popitem(last=False)
            return Reply(True, message="cannot check yet: our state does not reach the record's parent")
        if gap <= AUDIT_TOLERANCE:
            raise ProtocolError(RejectCode.MALFORMED, f"proof against {sr.signer} proves no lie ({gap:.2g})")
        self.convict_merge(sr, msgs, caller, gap)
        return Reply(True)
