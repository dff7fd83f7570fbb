"""One hierarchy of errors for the whole project, and the one list of wire refusal codes.

``DDiLoCoError`` is the root. ``ConfigError`` means a user asked for something impossible before anything
ran; ``ProtocolError`` means a message or state broke a rule of the protocol (and carries a ``RejectCode``).
"""

from __future__ import annotations

import enum


class DDiLoCoError(Exception):
    """Root of every error this project raises on purpose."""


class ConfigError(DDiLoCoError, ValueError):
    """A configuration value is invalid; the message names the value and says what would be valid."""


class DataError(DDiLoCoError):
    """Training data could not be read or is unusable."""


class RejectCode(enum.Enum):
    """Why a message was refused. Sent back to the sender and counted in status."""

    MALFORMED = "malformed"  # could not be decoded at all
    WRONG_FRAGMENT = "wrong_fragment"  # names a fragment this run does not have
    WRONG_SHAPE = "wrong_shape"  # a tensor's name, shape or dtype differs from the fragment's
    NOT_FINITE = "not_finite"  # NaN or inf in a tensor
    STALE_BASE = "stale_base"  # based on a global round we no longer keep
    FUTURE_BASE = "future_base"  # based on a round that has not happened yet
    BAD_COUNTERS = "bad_counters"  # c_steps/c_tokens not positive
    TOO_LARGE = "too_large"  # payload or norm over the configured bound
    UNKNOWN_PEER = "unknown_peer"  # sender is not a member of the swarm
    UNKNOWN_CODEC = "unknown_codec"  # codec name we cannot decode
    UNKNOWN_OP = "unknown_op"  # request for an operation this node does not serve
    NOT_SYNCHRONISER = "not_synchroniser"  # this node cannot take the fragment's round (behind, client mode)
    WRONG_PARENT = "wrong_parent"  # a merge record whose parent hash is not the receiver's fragment state
    BAD_SIGNATURE = "bad_signature"  # signature missing or not made by the peer it names
    NOT_ADMITTED = "not_admitted"  # private swarm: payload not sealed with the swarm's key, or no admission
    REPLAYED = "replayed"  # a contribution already merged (same learner and contribution id)
    BANNED = "banned"  # the sender's score fell below the ban threshold; refused until the ban ends
    FORGED_RECORD = "forged_record"  # a merge record naming contributions or a signer the receiver can refute
    UNELECTED = (
        "unelected"  # a merge record whose signer this node's view could not have elected (public swarm)
    )
    RECORD_TOO_LARGE = "record_too_large"  # a merge record's merged outer gradient out of all proportion
    PEER_BUSY = "peer_busy"  # the sender already has its budget of request bytes being read; retry later
    RATE_LIMITED = "rate_limited"  # the sender asked for more snapshots than its rate allows; retry later
    UNDONE = "undone"  # a merge record on a chain the receiver undid (an audit convicted a record of it)
    FORGED_SNAPSHOT = "forged_snapshot"  # a snapshot that is not the state its donor's own records reach
    DISTRUSTED = "distrusted"  # --distrust: its learner opposes the rest of the merges here
    INTERNAL = "internal_error"  # the receiver failed on a valid-looking request (a bug on its side)


class ProtocolError(DDiLoCoError):
    """A message broke a protocol rule. ``code`` says which; state is unchanged."""

    def __init__(self, code: RejectCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code


class HashMismatch(ProtocolError):
    """A record applied to its parent does not land on the hash it names (``malformed`` on the wire)."""

    def __init__(self, message: str) -> None:
        super().__init__(RejectCode.MALFORMED, message)


class UnprovenRefusal(ProtocolError):
    """Refused on what this node knows, which is no proof of a lie: the record names someone this node has
    not seen, or a signer no view on its chain elects (views differ). Not scored against the sender."""
