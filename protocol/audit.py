"""Recomputing a merge record from the contributions it names (docs/security.md).

A merge record names, per contributor, the sha256 of the message its learner signed, the scale the merge gave
it and the round's share; its synchroniser signs all of it. Anyone who holds the replica at the record's
parent (or a later round whose history reaches back to it) and the signed messages can merge them again and
compare: ``audit_gap`` is the distance between the record's merged outer gradient and the recomputed one,
relative to the recomputed one's norm. The recompute runs on a shallow view of the replica and changes
nothing of it (nor of the norms it has seen).

A recompute is not bit-exact: a replica past the record's round walks its state back through the outer steps
(a few ulps), and the record codec then rounds a value on either side of a step now and then. That honest gap
sets ``AUDIT_TOLERANCE``: walked back through up to five rounds, on a fragment of 1M parameters, honest
records recompute within 1.6e-7 (fp32 and int4 records), 2.1e-5 (bf16) and 4.1e-5 (int8), robust merge or
plain; on the state before the record (how an audit runs as the record is applied) nothing is walked back.
``AUDIT_TOLERANCE`` is 5e-4: 12x the largest honest gap measured, and half the gap of a merge scaled by
1.001 (5.3e-4 to 1.5e-3). A synchroniser that negates its merge stands at 1 to 2, one that scales it by 1.1
at 0.1. (``bench/audit_gaps.py`` measures both sides; docs/security.md, "Audited merges".)
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Sequence

from protocol.codecs import range_align, ranges, read_range
from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError, RejectCode
from protocol.norms import NormBook, sq_norm
from protocol.record_checks import readable
from protocol.replica import FragmentReplica, MergeRecord
from protocol.synchroniser import Contribution

AUDIT_TOLERANCE = 5e-4


class NormsRead(NormBook):
    """A copy of a norm book, read off the thread that owns the original; what is added to it is kept apart
    (``added``), for that thread to add to the original."""

    def __init__(self, book: NormBook) -> None:
        super().__init__(book.keep)
        self.rms = {k: list(v) for k, v in book.rms.items()}
        self.added: list[tuple[str, float]] = []

    def add(self, learner: str, rms: float) -> None:
        super().add(learner, rms)
        self.added.append((learner, rms))


def frozen_view(rep: FragmentReplica, merge: bool = False) -> FragmentReplica:
    """A shallow copy of ``rep`` that records applied to ``rep`` later do not move (take it on the thread that
    applies them; its tensors are shared, so ``rep``'s momentum must not step in place while it is used:
    ``node.swarm.memory.momentum_lent``). It has norms of its own: empty (an audit's), or, for a merge made
    on it (``merge``), a copy of ``rep``'s whose additions are replayed on ``rep`` if the record is kept."""
    view = copy.copy(rep)
    view._past = OrderedDict(rep._past)
    view.norms = NormsRead(rep.norms) if merge else NormBook()
    view.lent = 1  # never step a tensor it shares with ``rep`` in place
    return view


def audit_gap(
    view: FragmentReplica,
    rec: MergeRecord,
    contributions: Sequence[Contribution],
    cfg: ProtocolConfig,
    agreement: list[float] | None = None,
) -> float:
    """||g_record - g_recomputed|| / ||g_recomputed||, recomputed on ``view`` (a ``frozen_view``, walked back to
    the record's parent here; raises ``stale_base`` where its history does not reach). ``contributions``: in
    the record's order, each already checked against the record's digest and its learner's signature.
    ``agreement``: where given, the recomputed merge's cosines (``protocol.robust.agreements``; none where the
    merge is plain) are added to it, in the record's order: the auditor's own measurement of each learner."""
    if [c.cid for c in contributions] != [c[1] for c in rec.contributors]:
        raise ProtocolError(RejectCode.MALFORMED, "the contributions are not the ones the record names")
    if rec.round - 1 > view.round:
        raise ProtocolError(RejectCode.FUTURE_BASE, f"round {rec.round} is ahead of ours ({view.round})")
    if rec.round - 1 < view.round:
        # the momentum is walked too only where a contribution's older base is rebuilt from it
        view.rewind(rec.round - 1, momentum=any(c.base_round < rec.round - 1 for c in contributions))
    mine = view.make_record(rec.round, contributions, cfg, given=rec)
    if agreement is not None:
        agreement.extend(mine.agreement)
    diff = ref = 0.0
    theirs = readable(rec.grad)
    for k, g in readable(mine.grad).items():  # a range at a time: whole, the comparison held 8x the tensor
        for a, b in ranges(view.theta[k].numel(), range_align(g, theirs[k])):
            x = read_range(g, a, b)
            diff += sq_norm(x - read_range(theirs[k], a, b))
            ref += sq_norm(x)
    return math.sqrt(diff) / max(math.sqrt(ref), 1e-30)
