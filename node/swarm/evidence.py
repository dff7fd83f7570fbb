"""Bans that travel (docs/security.md). A merge record is signed by its synchroniser, so a
record that breaks a rule every node checks the same way proves its signer lied: contributors' weights that
do not follow their counters, no contributor, a merged gradient that is not finite or over twice ``max_rms``
(``FragmentReplica.check_record`` without the local ``refuse_factor`` bound, which depends on what each node
has seen). A node that receives such a record bans its signer at once and hands the signed record to the
other members (``evidence`` op); each checks it alone, bans the signer and passes it on once. A peer that
sends as evidence a record that proves nothing is scored (``malformed``). Honest merges of contributions
that passed the decoders cannot break these rules, whatever the model does.

A mixin of ``node.swarm.agent.Node``, like ``node.swarm.replication``."""

from __future__ import annotations

import time
from dataclasses import replace

from node.swarm.audit import Audit
from node.swarm.transport import Reply
from node.swarm.wire import SignedRecord, decode_record
from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError, RejectCode

# A merge of contributions that each passed max_rms stays under it, but the record codec's rounding can
# lift it a little: an honest synchroniser that merged a hostile learner's contribution at the bound must
# not be convicted everywhere for it. Evidence needs twice the bound.
EVIDENCE_RMS_SLACK = 2.0


def proof_config(pcfg: ProtocolConfig) -> ProtocolConfig:
    """The bounds a record is a proven lie against, the same on every node: no refusal by this node's own
    robust reference (``refuse_factor``), and ``EVIDENCE_RMS_SLACK`` times the record RMS bound."""
    return replace(pcfg, refuse_factor=0.0, max_rms=pcfg.max_rms * EVIDENCE_RMS_SLACK)


class Evidence(Audit):
    def _init_evidence(self) -> None:
        """This part's own state (the node's constructor calls it, after ``pcfg``, ``plan`` and ``spool``)."""
        self._init_audit()
        self._proof_cfg = proof_config(self.pcfg)

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
        if self.guard.banned(sr.signer, time.monotonic()):
            return False
        return self.ban_and_hand_on(sr, lie.code.value, source, "evidence", bytes(sr.raw))

    async def _h_evidence(self, caller: str, raw: bytes) -> Reply:
        sr = decode_record(raw, self.settings.swarm, self.spec)
        lie = self.proven_lie(sr)
        if lie is None:
            raise ProtocolError(RejectCode.MALFORMED, f"evidence against {sr.signer} proves no lie")
        self.convict(sr, lie, caller)
        return Reply(True)
