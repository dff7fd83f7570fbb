"""What a merge record signs for its audit (``protocol.audit``), as JSON in the record's metadata: per
contributor the sha256 of the message its learner signed and the scale the merge gave it, and the round's
share. A record from before these fields decodes with none (digests and scales empty, share 1); such a
record cannot be audited."""

from __future__ import annotations

import math

from protocol.errors import ProtocolError, RejectCode
from protocol.replica import MergeRecord


def audit_doc(rec: MergeRecord) -> dict:
    return {"digests": list(rec.digests), "scales": list(rec.scales), "share": rec.share}


def _is_digest(d: object) -> bool:
    return isinstance(d, str) and (d == "" or (len(d) == 64 and all(c in "0123456789abcdef" for c in d)))


def audit_fields(doc: dict, contributors: int) -> dict:
    """``digests``, ``scales`` and ``share`` of a record's JSON, checked for type and count."""
    digests, scales, share = doc.get("digests", []), doc.get("scales", []), doc.get("share", 1.0)
    ok = (
        isinstance(digests, list)
        and isinstance(scales, list)
        and len(digests) in (0, contributors)
        and len(scales) in (0, contributors)
        and all(_is_digest(d) for d in digests)
        and all(type(s) in (int, float) and math.isfinite(s) for s in scales)
        and type(share) in (int, float)
        and math.isfinite(share)
    )
    if not ok:
        raise ProtocolError(
            RejectCode.MALFORMED,
            f"bad audit fields for {contributors} contributors: digests, scales or share of the wrong form",
        )
    return {"digests": tuple(digests), "scales": tuple(float(s) for s in scales), "share": float(share)}
