"""The checks a replica makes of another node's merge record before applying it (``FragmentReplica.check_record``),
and of what a record names of its contributions (their digests and the scales the merge gave them)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from protocol.codecs import Decoded, Encoded
from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError, RejectCode
from protocol.merge import contribution_weight


def readable(grad: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor | Encoded]:
    """A record's gradient as the ranged readers take it: its wire form where it is kept in one (``Decoded``:
    not decoded whole), else its tensors."""
    return grad.encoded if isinstance(grad, Decoded) else grad


def check_record(rep, rec, cfg: ProtocolConfig) -> None:
    """What a replica ``rep`` (a ``FragmentReplica``) checks of another node's merge record ``rec`` before
    applying it, beyond the parent and the new hash (which only show the signer did its arithmetic): the contributors' weights follow from
    their counters, and the merged outer gradient is finite, of the fragment's shapes, and bounded as a
    merge of bounded contributions is: under ``max_rms``, and under ``refuse_factor`` times the learners'
    typical outer gradient. (Not against the fragment's recent records: honest rounds differ from their
    predecessors by 300x and more, and such a bound refused them in a parity run.)
    A forged record that would throw the model far fails here; one inside these bounds moves it no
    further than an honest merge can (docs/security.md)."""
    if not rec.contributors:
        raise ProtocolError(RejectCode.FORGED_RECORD, f"round {rec.round} names no contribution")
    for learner, cid, w, steps, tokens in rec.contributors:
        if steps <= 0 or tokens <= 0 or not math.isfinite(w):
            raise ProtocolError(RejectCode.FORGED_RECORD, f"contribution {cid} has counters {steps}/{tokens}")
        if not math.isclose(w, contribution_weight(tokens, steps), rel_tol=1e-6):
            raise ProtocolError(
                RejectCode.FORGED_RECORD,
                f"contribution {cid} of {learner}: weight {w:.6g} does not follow from its counters",
            )
    n_c = len(rec.contributors)
    if len(rec.digests) not in (0, n_c) or len(rec.scales) not in (0, n_c):
        raise ProtocolError(
            RejectCode.FORGED_RECORD,
            f"round {rec.round} names {n_c} contributions, {len(rec.digests)} digests, {len(rec.scales)} scales",
        )
    # a merge only scales a contribution down (clip_factor), and a round's share is at most a full round
    if not all(0.0 < s <= 1.0 for s in rec.scales) or not 0.0 < rec.share <= 1.0:
        raise ProtocolError(
            RejectCode.FORGED_RECORD,
            f"round {rec.round}: scales {rec.scales} or share {rec.share} out of (0, 1]",
        )
    try:
        n = rep.check_delta(readable(rec.grad))
    except ProtocolError as e:
        raise ProtocolError(
            RejectCode.RECORD_TOO_LARGE if e.code is RejectCode.NOT_FINITE else e.code, str(e)
        ) from None
    rms = n / math.sqrt(max(1, rep.numel))
    if cfg.max_rms > 0 and rms > cfg.max_rms:
        raise ProtocolError(
            RejectCode.RECORD_TOO_LARGE, f"merged gradient RMS {rms:.3g} exceeds max_rms {cfg.max_rms:g}"
        )
    ref = rep.norm_reference() if cfg.refuse_factor > 0 else None
    if ref is not None and n > cfg.refuse_factor * ref:
        raise ProtocolError(
            RejectCode.RECORD_TOO_LARGE,
            f"merged gradient norm {n:.3g} is {n / ref:.0f}x a learner's typical {ref:.3g}",
        )
