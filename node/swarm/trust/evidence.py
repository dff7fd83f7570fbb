"""Bans that travel (docs/security.md). A merge record is signed by its synchroniser, so a
record that breaks a rule every node checks the same way proves its signer lied: contributors' weights that
do not follow their counters, no contributor, a merged gradient that is not finite or over twice ``max_rms``
(``FragmentReplica.check_record`` without the local ``refuse_factor`` bound, which depends on what each node
has seen). A node that receives such a record bans its signer at once and hands the signed record to the
other members (``evidence`` op); each checks it alone, bans the signer and passes it on once. A peer that
sends as evidence a record that proves nothing is scored (``malformed``). Honest merges of contributions
that passed the decoders cannot break these rules, whatever the model does.

The bounds those checks use; the node's audit part holds the checks and the ``evidence`` op
(``node.swarm.trust.audit.Auditor``: ``proven_lie``, ``convict``)."""

from __future__ import annotations

from dataclasses import replace

from protocol.config import ProtocolConfig

# A merge of contributions that each passed max_rms stays under it, but the record codec's rounding can
# lift it a little: an honest synchroniser that merged a hostile learner's contribution at the bound must
# not be convicted everywhere for it. Evidence needs twice the bound.
EVIDENCE_RMS_SLACK = 2.0


def proof_config(pcfg: ProtocolConfig) -> ProtocolConfig:
    """The bounds a record is a proven lie against, the same on every node: no refusal by this node's own
    robust reference (``refuse_factor``), and ``EVIDENCE_RMS_SLACK`` times the record RMS bound."""
    return replace(pcfg, refuse_factor=0.0, max_rms=pcfg.max_rms * EVIDENCE_RMS_SLACK)
