"""The node's status over libp2p: ``/ddiloco/status/1`` on its p2p daemon (frames: ``node.common.status_wire``).

``ddiloco status --peer MADDR`` reads it with py-libp2p, so an operator needs neither a Go daemon nor the
node's HTTP port. In a private swarm the request must carry a certificate of the swarm's authority that
admits the caller's peer id (authenticated by the stream's Noise handshake); a caller without one is
refused with ``not_admitted`` and counted in ``refused``. Any role may read, including ``observer``, the
role for tools that are never members. The reply is not sealed with the swarm secret: the stream is
already encrypted end to end, and an observer holds no secret. The document is the one ``GET /status``
serves, from the same cache (``node.swarm.server``), so streams opened in a loop cost no more than requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from dht.admission import AdmissionError
from node.common.status_wire import (
    MAX_REQUEST,
    PROTOCOL,
    StatusWireError,
    decode_body,
    encode_frame,
    frame_size,
)
from node.swarm.status import status_doc

logger = logging.getLogger(__name__)
LINGER_S = 5.0  # how long a served stream waits for the caller to close it
SERVE_TIMEOUT_S = 10.0


def answer(node: Any, caller: str, request: dict, now: float) -> dict:
    """The reply to one status request from ``caller``: the status document, or a refusal that says why."""
    adm = node.admission
    if adm is not None:
        cert = request.get("cert", "")
        try:
            adm.check(caller, cert if isinstance(cert, str) else "", now)
        except AdmissionError as e:
            return {"ok": False, "code": "not_admitted", "message": f"status for {caller}: {e}"}
    # the HTTP side's cached document (rebuilt at most every CACHE_S, or when an event made it stale): a
    # stranger opening status streams in a loop was served 473 fresh documents a second and slowed the
    # learner by 43%; before the HTTP server is up, a document built for this request
    server = getattr(node, "status_server", None)
    return {"ok": True, "status": server.document() if server is not None else status_doc(node)}


class StatusProtocol:
    def __init__(self, node: Any, p2p: Any) -> None:
        self.node, self.p2p = node, p2p

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(PROTOCOL, self._serve)

    async def stop(self) -> None:
        await self.p2p.remove_binary_stream_handler(PROTOCOL)

    async def _serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = info.peer_id.to_base58()
        try:
            async with asyncio.timeout(SERVE_TIMEOUT_S):
                try:
                    n = frame_size(await reader.readexactly(4), MAX_REQUEST)
                    reply = answer(self.node, caller, decode_body(await reader.readexactly(n)), time.time())
                except StatusWireError as e:
                    reply = {"ok": False, "code": "malformed", "message": str(e)}
                if not reply["ok"]:
                    t = self.node.transport
                    if t is not None:
                        t.count_refusal(reply["code"])
                    logger.warning("refused status %s from %s: %s", reply["code"], caller, reply["message"])
                writer.write(encode_frame(reply))
                await writer.drain()
            # Let the caller close first: closing at once can cut a short reply (a refusal) in flight.
            with contextlib.suppress(TimeoutError, ConnectionError, asyncio.IncompleteReadError):
                async with asyncio.timeout(LINGER_S):
                    await reader.read()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, RuntimeError) as e:
            logger.info("status stream from %s dropped: %s", caller, type(e).__name__)
        finally:
            writer.close()
