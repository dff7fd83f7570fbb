"""The one way a request reaches its op handler. The transport has read the frame and the body within the
per-peer budget; the dispatcher admits the caller (a live member, else ``unknown_peer``: a banned one is
refused ``banned`` by the view), runs the handler, and turns a ``ProtocolError`` the handler raises into a
refusal, scored against the caller where the op says a refused request is the caller's own doing. A handler
holds only its op.

Two ops admit their callers themselves, where the order of the checks matters: ``contribute`` (a wrong
fragment is refused before the caller is looked up in the DHT, and every refusal is an event and a counter)
and ``record`` (a refused record is scored only where its caller signed it, and relayed ones are not)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from node.swarm.transport import Reply
from protocol.errors import ProtocolError, RejectCode

Handler = Callable[[str, bytes], Awaitable[Reply]]


@dataclass(frozen=True)
class OpRule:
    admit: bool  # the dispatcher checks that the caller is a live member
    scored: bool  # a refused request is scored against its caller (``PeerScores``)


OPS: dict[str, OpRule] = {
    "contribute": OpRule(admit=False, scored=False),  # ``Intake.accept`` admits and scores
    "record": OpRule(admit=False, scored=False),  # ``Replication.on_record`` admits and scores
    "records": OpRule(admit=True, scored=False),  # a read: a bad request costs its caller nothing but a reply
    "snapshot": OpRule(admit=True, scored=False),
    "ping": OpRule(admit=True, scored=False),
    "evidence": OpRule(admit=True, scored=True),  # false evidence, a proof that proves nothing: the caller's
    "kept": OpRule(admit=True, scored=True),
    "proof": OpRule(admit=True, scored=True),
    "omission": OpRule(admit=True, scored=True),
}


class Dispatcher:
    """``known(caller)``: whether the caller is a live member (raises ``banned``); ``penalise(caller, code)``:
    score a refused request; ``handlers``: op -> handler, for ops of ``OPS`` (a node gives one for each)."""

    def __init__(
        self,
        known: Callable[[str], Awaitable[bool]],
        penalise: Callable[[str, RejectCode], None],
        handlers: Mapping[str, Handler],
    ) -> None:
        if set(handlers) - set(OPS):
            raise ValueError(f"no rule for ops {sorted(set(handlers) - set(OPS))}: the ops are {sorted(OPS)}")
        self._known, self._penalise, self._handlers = known, penalise, dict(handlers)

    async def __call__(self, op: str, caller: str, body: bytes) -> Reply:
        rule, handler = OPS[op], self._handlers[op]
        if rule.admit and not await self._known(caller):
            return Reply(False, RejectCode.UNKNOWN_PEER.value, f"{caller} is not a live member")
        try:
            return await handler(caller, body)
        except ProtocolError as e:
            if rule.scored:
                self._penalise(caller, e.code)
            return Reply(False, e.code.value, str(e))

    def register(self, transport) -> None:
        """Have ``transport`` call the dispatcher for each op it has a handler for."""
        for op in self._handlers:
            transport.register(op, self._for(op))

    def _for(self, op: str) -> Handler:
        async def run(caller: str, body: bytes) -> Reply:
            return await self(op, caller, body)

        return run
