"""A transport stream's frames (docs/design.md, section 4, "Transport"): a header (u32 length + JSON with the
body's ``nbytes``), then the body in pieces of ``CHUNK`` bytes; GO or STOP after a request's header. What
reads and writes them on one stream, each piece of a body moving its deadline on as it moves
(``node.swarm.transport`` sets the deadlines), and the size caps a peer's frames are held to."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Awaitable

from protocol.errors import ProtocolError, RejectCode

GO, STOP = b"\x01", b"\x00"  # after the request header: send the body / a refusal follows
CHUNK = 256 << 10  # a piece of a body: the unit of its progress (``idle_s``)
MAX_HEADER = 64 * 1024


def write_header(writer: asyncio.StreamWriter, header: dict, body: bytes) -> int:
    """Writes the frame's header; returns its bytes on the stream."""
    raw = json.dumps({**header, "nbytes": len(body)}).encode()
    writer.write(struct.pack("<I", len(raw)) + raw)
    return 4 + len(raw)


async def _moved(step: Awaitable, idle_s: float | None):
    """``step`` (one piece of a body), failing with TimeoutError if it takes longer than ``idle_s``."""
    return await (step if idle_s is None else asyncio.wait_for(step, idle_s))


def _moved_on(deadline: asyncio.Timeout | None, idle_s: float | None, ceiling: float) -> None:
    """A piece of a body moved: its ``deadline`` is at least ``idle_s`` from now, and at most ``ceiling``."""
    if deadline is not None and idle_s is not None and (when := deadline.when()) is not None:
        deadline.reschedule(min(ceiling, max(when, asyncio.get_running_loop().time() + idle_s)))


async def write_body(
    writer: asyncio.StreamWriter,
    body: bytes,
    idle_s: float | None = None,
    deadline: asyncio.Timeout | None = None,
    ceiling: float = float("inf"),
) -> None:
    """``idle_s``: the longest one piece may wait for the link (a peer that stopped mid-body). With a
    ``deadline``, each piece the link took puts it ``idle_s`` past now if it was sooner, up to ``ceiling``,
    as ``read_body`` does: the reader's link may be shared with senders this node cannot see."""
    view = memoryview(body)  # slices of a view: no copy of each chunk
    for i in range(0, len(body), CHUNK):
        writer.write(view[i : i + CHUNK])
        await _moved(writer.drain(), idle_s)
        _moved_on(deadline, idle_s, ceiling)
    await _moved(writer.drain(), idle_s)


async def stream_closed(reader: asyncio.StreamReader, deadline: asyncio.Timeout) -> bool:
    """Whether the caller closed the stream (it does once it has read our reply) before ``deadline``."""
    when = deadline.when()
    left = (when - asyncio.get_running_loop().time()) if when is not None else 30.0
    try:
        return await asyncio.wait_for(reader.read(1), max(0.0, left - 0.05)) == b""
    except (TimeoutError, ConnectionError):
        return False


def header_size(prefix: bytes) -> int:
    """The length of the JSON header that a frame's 4-byte prefix declares; refuses one over MAX_HEADER."""
    if len(prefix) != 4:
        raise ProtocolError(RejectCode.MALFORMED, f"frame prefix of {len(prefix)} bytes, expected 4")
    (n,) = struct.unpack("<I", prefix)
    if n > MAX_HEADER:
        raise ProtocolError(RejectCode.TOO_LARGE, f"frame header of {n} bytes exceeds {MAX_HEADER}")
    return n


def parse_header(raw: bytes, max_bytes: int) -> tuple[dict, int]:
    """A frame's JSON header and the body length it announces (an int in 0..max_bytes)."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise ProtocolError(
            RejectCode.MALFORMED, f"bad frame header: {type(e).__name__}: {str(e)[:200]}"
        ) from e
    if not isinstance(header, dict) or "nbytes" not in header:
        raise ProtocolError(RejectCode.MALFORMED, "bad frame header: not a JSON object with nbytes")
    nbytes = header["nbytes"]
    if type(nbytes) is not int or nbytes < 0:
        raise ProtocolError(
            RejectCode.MALFORMED, f"bad frame header: nbytes={repr(nbytes)[:80]} is not a byte count"
        )
    if nbytes > max_bytes:
        raise ProtocolError(RejectCode.TOO_LARGE, f"payload of {nbytes} bytes exceeds {max_bytes}")
    return header, nbytes


def op_named(raw: bytes) -> str:
    """The op a request header names, for counting alone: "?" where it names none that reads."""
    try:
        op = json.loads(raw).get("op")
    except (ValueError, RecursionError, AttributeError):
        return "?"
    return op[:40] if isinstance(op, str) else "?"


def header_bytes(header: dict) -> int:
    """A header's bytes on the stream, as ``write_header`` wrote it (a peer's own spacing aside)."""
    return 4 + len(json.dumps(header).encode())


async def read_header(reader: asyncio.StreamReader, max_bytes: int) -> tuple[dict, int]:
    n = header_size(await reader.readexactly(4))
    return parse_header(await reader.readexactly(n), max_bytes)


async def read_body(
    reader: asyncio.StreamReader,
    nbytes: int,
    progress: dict | None = None,
    idle_s: float | None = None,
    deadline: asyncio.Timeout | None = None,
    ceiling: float = float("inf"),
) -> bytes:
    """``nbytes`` of a body, as they come. ``idle_s``: the longest the link may be silent (a peer that stopped
    mid-body). With a ``deadline``, every piece that arrives puts it ``idle_s`` past now if it was sooner, up
    to ``ceiling`` (loop time): a body that keeps arriving is not cut for sharing the sender's link with
    bodies the reader cannot see (``links.SHARED``)."""
    chunks, left = [], nbytes
    while left:
        c = await _moved(reader.read(min(CHUNK, left)), idle_s)
        if not c:
            raise asyncio.IncompleteReadError(b"".join(chunks), nbytes)
        chunks.append(c)
        left -= len(c)
        if progress is not None:  # a call in flight (``Transport.transfers``): bytes so far, last byte when
            progress["bytes"] += len(c)
            progress["last"] = time.time()
        _moved_on(deadline, idle_s, ceiling)
    return b"".join(chunks)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[dict, bytes]:
    header, nbytes = await read_header(reader, max_bytes)
    return header, await read_body(reader, nbytes)


MAX_FRAME = (
    256 << 20
)  # the largest body a peer may send in one frame, for models up to 32M parameters a fragment


def max_frame_bytes(plan) -> int:
    """The largest body a node accepts in one frame: 256 MiB, or more where one fragment's snapshot (fp32
    parameters and outer momentum, 8 bytes a parameter, one fragment a request) is larger. GPT-2's token
    embedding (38.6M parameters) is 309 MB; under a fixed 256 MiB no node could ever catch that fragment
    up, and a swarm that forked on it never agreed again."""
    largest = max((f.numel for f in plan.fragments), default=0)
    return max(MAX_FRAME, 8 * largest + (4 << 20))
