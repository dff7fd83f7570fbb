"""RPC payloads of a private swarm, sealed with the swarm key (``dht.admission.Admission``).

``SealedTransport`` wraps ``node.swarm.transport.Transport``: a request body is sealed for (op, callee) and a reply
body for (op, caller), so a sealed message opens only where it was meant to go. A request that does not
open is refused with ``not_admitted`` before any handler sees it; a reply that does not open is a
``TransportError`` for the caller. Refusals carry no body and are not sealed.
"""

from __future__ import annotations

from dht.admission import AdmissionError
from node.swarm.transport import Reply, Transport, TransportError
from protocol.errors import ProtocolError, RejectCode


class SealedTransport:
    def __init__(self, inner: Transport, admission, peer_id: str) -> None:
        self.inner, self.admission, self.peer_id = inner, admission, peer_id

    def __getattr__(self, name: str):  # start, stop, p2p, refused, bytes_in/out, _count
        return getattr(self.inner, name)

    def register(self, op: str, handler) -> None:
        adm = self.admission

        async def opened(caller: str, payload: bytes) -> Reply:
            try:
                body = adm.open(payload, f"req|{op}|{self.peer_id}")
            except AdmissionError as e:
                raise ProtocolError(RejectCode.NOT_ADMITTED, f"{op} from {caller}: {e}") from None
            reply = await handler(caller, body)
            if not reply.ok:
                return reply
            return Reply(reply.ok, reply.code, reply.message, adm.seal(reply.body, f"rep|{op}|{caller}"))

        self.inner.register(op, opened)

    async def call(
        self,
        peer_id: str,
        op: str,
        payload: bytes = b"",
        timeout_s: float | None = None,
        share: int = 1,
        queue_s: float | None = None,
    ) -> Reply:
        sealed = self.admission.seal(payload, f"req|{op}|{peer_id}")
        reply = await self.inner.call(peer_id, op, sealed, timeout_s, share, queue_s)
        if not reply.ok:
            return reply
        try:
            body = self.admission.open(reply.body, f"rep|{op}|{self.peer_id}")
        except AdmissionError as e:
            raise TransportError(f"{op} to {peer_id}: reply not sealed for us ({e})") from None
        return Reply(reply.ok, reply.code, reply.message, body)
