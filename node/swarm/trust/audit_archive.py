"""The signed contribution messages a node keeps for audits (``node.swarm.trust.audit``): those it sent or merged,
newest kept, served to any member by their sha256 (``kept`` op)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict

from node.swarm.signed_files import SignedFile, SignedFiles, in_memory
from protocol.errors import ProtocolError, RejectCode

logger = logging.getLogger(__name__)
FETCH_MAX = 64  # messages one ``kept`` request may ask for (an audit asks several times where it needs more)


class AuditArchive:
    """Signed contribution messages (message, signature) by sha256 of the message, newest kept, at most
    ``max_bytes`` of them. With ``signed_files`` (``node.swarm.signed_files``) each message is written to the
    node's state folder and read back when an audit asks for it: at 124M parameters the cap held 0.5x the fp32 weights in
    memory, most of it never read. ``bytes`` is what they weigh in all; ``resident``, what of it is in memory."""

    def __init__(self, max_bytes: int, signed_files: SignedFiles | None = None) -> None:
        self.max_bytes, self.bytes, self.resident = max_bytes, 0, 0
        self.signed_files = signed_files
        self.items: OrderedDict[str, tuple[bytes | SignedFile, bytes]] = OrderedDict()

    def put(self, raw: bytes, sig: bytes) -> str:
        digest = hashlib.sha256(raw).hexdigest()
        if digest not in self.items:
            kept = (
                self.signed_files.keep(bytes(raw), f"kept-{digest[:16]}") if self.signed_files else bytes(raw)
            )
            self.items[digest] = (kept, bytes(sig))
            self.bytes += len(raw) + len(sig)
            self.resident += in_memory(kept) + len(sig)
        while self.bytes > self.max_bytes and len(self.items) > 1:
            _, (r, s) = self.items.popitem(last=False)  # a spilled message's file goes with its last holder
            self.bytes -= len(r) + len(s)
            self.resident -= in_memory(r) + len(s)
        return digest

    def get(self, digest: str) -> tuple[bytes, bytes] | None:
        """The message and its signature; None where it is not kept (or its file can no longer be read)."""
        item = self.items.get(digest)
        if item is None:
            return None
        try:
            return bytes(item[0]), item[1]
        except OSError as e:
            logger.warning("kept message %s unreadable: %s", digest[:16], e)
            return None


def parse_kept_request(raw: bytes) -> list[str]:
    try:
        digests = json.loads(raw).get("digests")
    except (ValueError, AttributeError, RecursionError) as e:
        raise ProtocolError(RejectCode.MALFORMED, f"bad kept request: {type(e).__name__}") from e
    if not (
        isinstance(digests, list)
        and len(digests) <= FETCH_MAX
        and all(isinstance(d, str) and len(d) == 64 for d in digests)
    ):
        raise ProtocolError(RejectCode.MALFORMED, f"kept request: at most {FETCH_MAX} sha256 digests")
    return digests
