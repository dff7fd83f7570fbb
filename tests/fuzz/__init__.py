"""Fuzzing of every decoder that takes bytes from the network or from disk (docs/design.md, section 5)."""

from tests.fuzz.disk_targets import CHECKPOINT, LATEST
from tests.fuzz.harness import Outcome, Target, outcome, refusal_label
from tests.fuzz.peer_targets import CERTIFICATE, CONTROL, LIVE, MEMBER, SEALED
from tests.fuzz.wire_targets import (
    CONTRIBUTION,
    ENVELOPE,
    FRAME,
    KEPT_REQUEST,
    LIST,
    PARTS,
    PEEK,
    RECORD,
    RECORDS_REQUEST,
    REDIRECT,
    SNAPSHOT,
    SNAPSHOT_REQUEST,
)

__all__ = ["TARGETS", "Outcome", "Target", "outcome", "refusal_label"]

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        CONTRIBUTION, PEEK, PARTS, RECORD, SNAPSHOT, LIST, ENVELOPE, RECORDS_REQUEST, SNAPSHOT_REQUEST,
        KEPT_REQUEST, REDIRECT, MEMBER, LIVE, CERTIFICATE, SEALED, FRAME, CONTROL, CHECKPOINT, LATEST,
    )
}  # fmt: skip
