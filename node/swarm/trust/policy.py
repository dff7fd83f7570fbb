"""The trust policy: the one object the accepting, merging and applying paths of a node ask, at named points,
what they may believe of a peer and what to do about a lie. Read without it, ``node.swarm.intake`` and
``node.swarm.replication`` are the honest path: decode, check, merge, apply.

What it checks is wired from the swarm's kind (``TrustPolicy.checks``). Every swarm refuses what a certified
member may still get wrong: replays, a banned signer, a record on a chain this node undid, one whose signer or
contributors it never saw, and a signed lie any node can check (banned and handed on, ``Auditor.convict``).
A public or open-learners swarm adds what only an uncertified member would do (``docs/security.md``): audits
of every record, signed receipts, distrust of learners that pull the wrong way (a robust merge), and the
election fence with its holds. A private swarm (``swarm init``: every member certified, the merge plain) wires
none of those unless its flags ask for them (``--audit``, ``--elect``, ``--robust``)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from node.swarm.transport import Reply
from node.swarm.wire import SignedRecord
from protocol.agreement import merged_set
from protocol.audit import frozen_view
from protocol.errors import ProtocolError, RejectCode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrustChecks:
    """Which checks beyond the certified member's this swarm runs."""

    audits: (
        bool  # a drawn member recomputes records (``--audit``; every record where learners are not vouched)
    )
    receipts: bool  # every ``ok`` carries a signed receipt, and a merge keeps what it receipted
    distrust: bool  # learners whose outer gradients oppose the rest are left out (a robust merge)
    fence: bool  # only members credited by others' records are electable (``--elect`` workers)

    @classmethod
    def of(cls, settings, pcfg) -> TrustChecks:
        return cls(
            audits=settings.audit_share > 0,
            receipts=not settings.trusted,
            distrust=bool(pcfg.distrust) and pcfg.robust != "off",  # a plain merge measures nothing
            fence=settings.elect_workers,
        )


class TrustPolicy:
    """Built by the node from its trust parts (``node.swarm.trust``): ``peer_scores``, ``work`` (the
    ``WorkBook``), ``agreement`` (``protocol.agreement.AgreementBook``), ``fence`` (``ElectionFence``),
    ``auditor`` (``Auditor``), ``receipts`` (``Receipts``); ``suspect`` (the fail-over's suspects, cleared for
    a signer that merges again), ``counters`` and ``events`` (the node's); ``step_rate(learner)``: a member's
    published steps a second (0 where unknown); ``hold_out_of_turn(sr, caller)`` and
    ``hold_unelected(sr, caller)``: the two ``HeldRecords`` the node makes when it runs; ``spawn``: a task of
    the node's group."""

    def __init__(
        self,
        checks: TrustChecks,
        peer_id: str,
        peer_scores,
        work,
        agreement,
        fence,
        auditor,
        receipts,
        suspect: dict[str, float],
        counters: dict[str, int],
        events,
        *,
        step_rate: Callable[[str], float],
        hold_out_of_turn: Callable[[SignedRecord, str], None],
        hold_unelected: Callable[[SignedRecord, str], None],
        spawn: Callable,
    ) -> None:
        self.checks, self.peer_id = checks, peer_id
        self.peer_scores, self.work, self.agreement = peer_scores, work, agreement
        self.fence, self.auditor, self.receipts = fence, auditor, receipts
        self.suspect, self.counters, self.events = suspect, counters, events
        self.step_rate, self.spawn = step_rate, spawn
        self.hold_out_of_turn, self.hold_unelected = hold_out_of_turn, hold_unelected

    # ------------------------------------------------------------ accepting a contribution (Intake.accept)
    def admit_learner(self, learner: str) -> None:
        """Raises ``DISTRUSTED`` for a learner whose outer gradients oppose the rest of the merges here:
        counted toward no quorum and not re-sent into the next round (left out at the merge, such
        contributions came back as rounds of liars only)."""
        if self.checks.distrust and self.agreement.refuse(learner):
            self.counters["distrusted_left_out"] += 1
            raise ProtocolError(
                RejectCode.DISTRUSTED, f"{learner}'s outer gradients oppose the rest of the merges here"
            )

    def resent(self, cid: str) -> bool:
        """Whether ``cid`` was merged and this is its first copy since (an honest resend, answered as
        landed); raises ``REPLAYED`` for a later copy."""
        if self.peer_scores.first_resend(cid):
            return True
        self.peer_scores.check_replay(cid)
        return False

    def busy(self, caller: str, p: int) -> Reply | None:
        """Where receipts bind, the answer to a contribution that comes while fragment p's round merges."""
        return self.receipts.merging_here(caller, p) if self.checks.receipts else None

    def digest(self, raw: bytes, sig: bytes) -> str:
        """The digest a record names for this signed message; kept for the audits that fetch it."""
        kept = self.auditor.keep_message(raw, sig) if self.checks.audits else None
        return kept or hashlib.sha256(raw).hexdigest()

    def binds(self, caller: str) -> bool:
        """Whether taking this caller's contribution is a promise: a signed receipt with the ``ok``."""
        return self.checks.receipts and caller != self.peer_id

    def check_taken(self, p: int, learner: str, cid: str, base: int) -> None:
        self.receipts.check_taken(p, learner, cid, base)

    def receipt(self, p: int, learner: str, cid: str) -> bytes:
        return self.receipts.give_receipt(p, learner, cid)

    def accepted(self, caller: str) -> None:
        self.peer_scores.reward(caller)

    # ------------------------------------------------------------ merging as the synchroniser (Replication._merge)
    def merged_set(self, p: int, round_: int, contributions: tuple) -> tuple:
        """The contributions a merge takes: the distrusted left out, but never one this node receipted (a
        robust merge bounds its learner's say, and leaving it out would prove this node a liar)."""

        def promised() -> set[str]:
            return self.receipts.receipted(p, round_) if self.checks.receipts else set()

        return merged_set(self.agreement, contributions, self.checks.distrust, promised)

    def may_sign(self, p: int, round_: int, rec, left: list) -> bool:
        """Whether a record just merged may be signed: not where it would break a receipt given for a
        contribution it leaves out; then the round is renounced, the ``left`` contributions handed on."""
        if self.checks.receipts and self.receipts.holds_receipts(rec):
            self.receipts.renounce(p, round_, {c.cid for c in left})
            return False
        return True

    def agreed(self, rec, cosines) -> None:
        """Take one robust merge's cosines, made here or recomputed by an audit here (``protocol.agreement``)."""
        if not self.checks.distrust:
            return
        for learner in self.agreement.add([c[0] for c in rec.contributors], cosines):
            logger.warning(
                "fragment %d round %d: %s distrusted (its outer gradients oppose the rest)",
                rec.fragment,
                rec.round,
                learner,
            )

    # ------------------------------------------------------------ applying a record (Replication.apply)
    def vet(self, sr: SignedRecord, rep, pcfg, turn_waited: bool) -> None:
        """Raises for a record of another's this node must not apply: a banned signer (relayed, or fetched
        by catch-up), a chain this node undid, a lie any node can check (first, so it is refused for what it
        is), and what ``ElectionFence.vouch`` refutes; ``turn_waited``: held out of turn while the fence
        stood aside, judged as the fence stood when it came."""
        rec = sr.record
        if self.peer_scores.banned(sr.signer, time.monotonic()):
            raise ProtocolError(RejectCode.BANNED, f"round {rec.round} signed by {sr.signer}, banned here")
        if rec.parent_hash in self.auditor.undone or rec.new_hash in self.auditor.undone:
            self.auditor.undone.add(rec.new_hash)
            raise ProtocolError(RejectCode.UNDONE, f"round {rec.round} is on a chain we undid")
        rep.check_record(rec, pcfg)
        self.fence.vouch(sr, fenced=self.checks.fence and not turn_waited)

    def audit_parent(self, sr: SignedRecord, rep):
        """The state an audit of ``sr`` recomputes it at (its parent, this replica frozen before the apply),
        or None where this node does not audit it."""
        return frozen_view(rep) if self.checks.audits and self.auditor.audits(sr) else None

    def applied(self, sr: SignedRecord) -> None:
        """A record was applied: its signer merges (electable again unless accused), its contributors'
        ids are merged (replays of them refused), and their work is credited."""
        rec, now = sr.record, time.monotonic()
        if not self.peer_scores.accused(sr.signer, now):  # a late round, or it came back
            self.suspect.pop(sr.signer, None)
        self.peer_scores.merged(c[1] for c in rec.contributors)
        # each contributor's work spans its steps at its record's rate: the counters' bound (``WorkBook.merged``)
        for c in rec.contributors:
            rate = self.step_rate(c[0])
            self.work.merged(c[0], rec.fragment, now, c[3] / rate if rate > 0 else 0.0)

    def audit(self, sr: SignedRecord, parent) -> None:
        """Another's record was applied: audited where ``parent`` was frozen for it, and checked against a
        proof that named it before it came."""
        if parent is not None:
            self.spawn(self.auditor.audit(sr, parent))
        self.auditor.recheck(sr)

    # ------------------------------------------------------------ receiving a record (Replication.on_record)
    def refute(self, sr: SignedRecord, caller: str) -> ProtocolError | None:
        """The lie every node can check in ``sr``, if any: its signer is banned and the record handed on as
        evidence (``Auditor.convict``, the one way a signer is banned for what it signed)."""
        lie = self.auditor.proven_lie(sr)
        if lie is not None:
            self.auditor.convict(sr, lie, caller)
        return lie

    def held_out_of_turn(self, sr: SignedRecord, caller: str) -> bool:
        """Whether ``sr`` is held a ``failover_s`` rather than applied: pushed out of turn while the
        election fence stands aside (``ElectionFence.out_of_turn``)."""
        if self.checks.fence and self.fence.out_of_turn(sr):
            self.hold_out_of_turn(sr, caller)
            return True
        return False

    def refused(self, sr: SignedRecord, caller: str, e: ProtocolError) -> bool:
        """``sr`` was refused as it was applied: held for one more try where the fence refused it, handed
        on as evidence where the refusal proves a lie. Whether the refusal was trust's (a signer or chain
        this node refuses, or the fence): not a sign that this node's own state is the odd one out."""
        if e.code is RejectCode.UNELECTED:
            self.hold_unelected(sr, caller)
            return True
        if e.code in (RejectCode.FORGED_RECORD, RejectCode.RECORD_TOO_LARGE):
            self.refute(sr, caller)  # only on a refusal: no second pass otherwise
            return True
        return e.code in (RejectCode.UNDONE, RejectCode.BANNED)
