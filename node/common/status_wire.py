"""The status protocol over libp2p (``/ddiloco/status/1``): one request and one reply per stream, each a
frame of a 4-byte little-endian length and a JSON object.

The server is ``node.swarm.status_p2p`` on the node's own p2p daemon; the client is
``node.cli.remote_status``, which runs py-libp2p in a process of its own (no Go daemon, no HTTP port).
Request: ``{"cert": CERTIFICATE_JSON}``; the certificate matters only in a private swarm, where it must
admit the caller's peer id (authenticated by the libp2p handshake, never read from the message). Reply:
``{"ok": true, "status": {...}}`` (the document of ``GET /status``) or ``{"ok": false, "code", "message"}``.
This module is pure: both sides import it, and the client must not import hivemind.
"""

from __future__ import annotations

import json
import struct

from protocol.errors import DDiLoCoError

PROTOCOL = "/ddiloco/status/1"
MAX_REQUEST = 64 * 1024  # a certificate is a few hundred bytes
MAX_REPLY = 16 << 20  # a status document of a large swarm is well under this


class StatusWireError(DDiLoCoError):
    """A status frame is malformed or too large; the message says which."""


def encode_frame(doc: dict) -> bytes:
    raw = json.dumps(doc, separators=(",", ":"), default=str).encode()
    return struct.pack("<I", len(raw)) + raw


def frame_size(prefix: bytes, limit: int) -> int:
    """The body length a frame's 4-byte prefix declares, refused when over ``limit``."""
    if len(prefix) != 4:
        raise StatusWireError(f"frame prefix of {len(prefix)} bytes, expected 4")
    (n,) = struct.unpack("<I", prefix)
    if n > limit:
        raise StatusWireError(f"frame of {n} bytes exceeds {limit}")
    return n


def decode_body(raw: bytes) -> dict:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise StatusWireError(f"frame is not JSON: {type(e).__name__}: {str(e)[:200]}") from e
    if not isinstance(doc, dict):
        raise StatusWireError("frame is not a JSON object")
    return doc
