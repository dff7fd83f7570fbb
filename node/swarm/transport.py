"""Request/response over hivemind P2P streams, for payloads of any size
(docs/design.md, section 4, "Transport").

One stream per request, framed by ``node.swarm.frames``. The caller writes a frame header (u32 length + JSON
{"op", "nbytes"}) and then the payload in chunks of ``CHUNK`` bytes; the server reads it under a size cap
and a deadline, calls the handler registered for the op, and writes back a header (JSON {"ok", "code",
"message", "nbytes"}) and the reply body the same way. Unary protobuf messages in hivemind are capped at 4 MiB; raw streams are not, so tensors
travel here. The caller's peer id comes from the libp2p stream (authenticated by the Noise handshake), never
from the message.

Admission before the body: the server calls ``admit(caller, op)`` (set by the node: is the caller a live,
unbanned member?) after the header and before it answers GO, so a stranger's body is never read; and it
keeps at most ``peer_budget`` bytes of request bodies in flight per peer (declared sizes, held from GO until
the handler is done), refusing a request over that with ``peer_busy``.

Deadlines: a request's deadline (``timeout_s``) covers its round trips and the handler; a body, once the
other side has said GO (or announced a reply body), is allowed its time at the rate measured on that peer's
link on top (``node.swarm.links``), with the bodies already on this node's link to every peer ahead of it
(``queued``), so a large body on a thin link arrives, and a dead peer still costs the deadline alone.

Errors: every refusal is a ``Reply(ok=False, code, message)`` with a code from ``protocol.errors.RejectCode``
; transport failures raise ``TransportError`` saying which peer and op.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID

from node.swarm.frames import (
    CHUNK,
    GO,
    MAX_FRAME,
    STOP,
    header_bytes,
    header_size,
    op_named,
    parse_header,
    read_body,
    read_header,
    stream_closed,
    write_body,
    write_header,
)
from node.swarm.links import SHARED, LinkRates
from node.swarm.uplink import URGENT, Ticket, Uplink, class_of
from protocol.errors import DDiLoCoError, ProtocolError, RejectCode

logger = logging.getLogger(__name__)

PROTOCOL_NAME = "ddiloco/rpc/1"


class TransportError(DDiLoCoError):
    """A request could not be carried out over the network (peer unreachable, deadline, broken stream)."""


class LinkBusy(TransportError):
    """This node's own link had no room for a body within the caller's patience (``node.swarm.uplink``): the
    peer is not at fault, and nothing was sent."""


@dataclass(frozen=True)
class Reply:
    ok: bool
    code: str = "ok"
    message: str = ""
    body: bytes = b""


Handler = Callable[[str, bytes], Awaitable[Reply]]  # (caller peer id, payload) -> reply
Admit = Callable[[str, str], Awaitable[None]]  # (caller, op): returns, or raises ProtocolError to refuse


class Transport:
    """Serves registered ops and calls other peers' ops over one P2P instance."""

    def __init__(
        self,
        p2p: P2P,
        max_bytes: int = MAX_FRAME,
        timeout_s: float = 30.0,
        admit: Admit | None = None,
        peer_budget: int = 512 << 20,
        links: LinkRates | None = None,
    ) -> None:
        self.p2p = p2p
        self.links = LinkRates() if links is None else links
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.admit = admit
        self.peer_budget = peer_budget
        self.in_flight: dict[str, int] = {}  # peer -> declared body bytes admitted and not yet handled
        self.handlers: dict[str, Handler] = {}
        self.refused: dict[str, int] = {}  # code -> count, for status
        self.bytes_in = 0
        self.bytes_out = 0
        # op -> [calls, bytes sent, bytes received]: bodies, headers and GO/STOP, of this node's calls and of
        # the calls it served, refused and broken ones too; where a node's link bytes go (``transfers``)
        self.by_op: dict[str, list[int]] = {}
        self._ids = itertools.count()
        # a body on this node's link (of a call, or of a request served) -> (its bytes, its peer, its deadline)
        self._moving: dict[int, tuple[int, str, asyncio.Timeout]] = {}
        self._calls: dict[int, dict] = {}  # calls in flight: peer, op, since, last byte, bytes received
        self._done: deque[dict] = deque(maxlen=32)  # the last calls finished, for status and ddiloco doctor
        # the bodies this node writes, in flight and waiting, in the order they take its link
        self.uplink = Uplink(self.links.floor_bps)

    def transfers(self, now: float | None = None) -> dict:
        """Calls in flight (how long, how long since their last byte, bytes received so far) and the last
        ones finished (bytes, seconds, outcome): what a stalled state download looks like from here."""
        now = time.time() if now is None else now
        live = [
            {
                "peer": c["peer"],
                "op": c["op"],
                "age_s": round(now - c["since"], 3),
                "idle_s": round(now - c["last"], 3),
                "bytes": c["bytes"],
            }
            for c in list(self._calls.values())
        ]
        by_op = {op: {"calls": n, "sent": s, "received": r} for op, (n, s, r) in sorted(self.by_op.items())}
        return {
            "in_flight": live,
            "recent": list(self._done),
            "link_bps": self.links.snapshot(),
            "by_op": by_op,
            "uplink": self.uplink.snapshot(),
        }

    def idle_s(self, peer: str, timeout_s: float, ahead: int) -> float:
        """The longest one piece of a body may take on the link with ``peer``, behind the ``ahead`` bytes of
        other bodies on it, before the transfer counts as stalled: a body is allowed its bytes' time, but a
        peer that stops mid-body costs this, not the whole body's allowance."""
        return timeout_s + self.links.allowance_s(peer, CHUNK + ahead)

    def queued(self) -> int:
        """Bytes of bodies on this node's link now, to and from every peer: requests of ours being sent and
        their replies being read, requests being read here and our replies to them being written. A node's
        peers share its link (a datacenter's uplink), so three snapshots served at once each take three times
        their bytes' time: a body's allowance counts the bytes ahead of it to every peer, not only to its
        own (at 1 Mbit/s, counting one peer's, every concurrent snapshot ran past its allowance)."""
        return sum(n for n, _, _ in self._moving.values())

    def link_s(self, peer: str, nbytes: int) -> float:
        """The seconds a body of ``nbytes`` from ``peer`` is allowed at the rate measured on its link; 0 where
        none is measured yet (no body of ``MIN_SAMPLE`` bytes has moved: the bodies between the two are small,
        and at the floor's rate a wait of this node on a fast link would grow for nothing)."""
        if peer not in self.links.rates:
            return 0.0
        return self.links.allowance_s(peer, nbytes)

    def _on_link(self, key: int, nbytes: int, peer: str, deadline: asyncio.Timeout) -> None:
        """A body of ``nbytes`` to or from ``peer`` starts on the link: every body already on it shares the
        link with this one from now on, and is allowed this one's time on top (the first of three snapshots
        served at once counted on the link alone, and ran past its allowance)."""
        for _, q, other in self._moving.values():
            when = other.when()
            if when is not None:
                other.reschedule(when + self.links.allowance_s(q, nbytes))
        self._moving[key] = (nbytes, peer, deadline)

    def register(self, op: str, handler: Handler) -> None:
        self.handlers[op] = handler

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(PROTOCOL_NAME, self._serve)

    async def stop(self) -> None:
        # p2pd keeps routing the protocol to the first listener it was given: register one Transport per
        # daemon, for the daemon's whole life.
        await self.p2p.remove_binary_stream_handler(PROTOCOL_NAME)

    def _count(self, op: str, sent: int, received: int, call: bool) -> None:
        row = self.by_op.get(op)
        if row is None:
            if len(self.by_op) >= 64:  # made-up op names from a peer share one row, not one each
                op = "other"
            row = self.by_op.setdefault(op, [0, 0, 0])
        row[0] += call
        row[1] += sent
        row[2] += received

    def count_refusal(self, code: str) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1

    async def _serve(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = info.peer_id.to_base58()
        sent_go = False
        loop = asyncio.get_running_loop()
        op, sent, received = "?", 0, 0  # for ``by_op``
        key = next(self._ids)
        ticket: Ticket | None = None  # the reply body's room on this node's link, until it has arrived
        try:
            async with asyncio.timeout(self.timeout_s) as deadline:
                try:
                    raw = await reader.readexactly(header_size(await reader.readexactly(4)))
                    received, op = 4 + len(raw), op_named(raw)
                    header, nbytes = parse_header(raw, self.max_bytes)
                    handler = self.handlers.get(str(header.get("op")))
                    if handler is None:
                        raise ProtocolError(RejectCode.UNKNOWN_OP, f"no handler for op {header.get('op')!r}")
                    if self.admit is not None:  # a stranger or a banned peer: refused before its body
                        await self.admit(caller, str(header["op"]))
                    held = self.in_flight.get(caller, 0)
                    if held and held + nbytes > self.peer_budget:
                        raise ProtocolError(
                            RejectCode.PEER_BUSY,
                            f"{held} bytes from {caller} are being read; {nbytes} more would pass the "
                            f"per-peer budget of {self.peer_budget}",
                        )
                    writer.write(GO)  # the caller sends the body only now: refusals never race a big upload
                    sent_go, sent = True, 1
                    self.in_flight[caller] = held + nbytes
                    try:
                        began, ahead = loop.time(), self.queued()
                        self._on_link(key, nbytes, caller, deadline)
                        deadline.reschedule(self.links.until(began, self.timeout_s, caller, nbytes + ahead))
                        idle = self.idle_s(caller, self.timeout_s, ahead)
                        ceiling = (
                            began + self.timeout_s + SHARED * self.links.allowance_s(caller, nbytes + ahead)
                        )
                        payload = await read_body(reader, nbytes, None, idle, deadline, ceiling)
                        self._moving.pop(key, None)
                        received += nbytes
                        self.links.observe(caller, nbytes, loop.time() - began)
                        self.bytes_in += len(payload)
                        reply = await handler(caller, payload)
                    finally:
                        left = self.in_flight[caller] - nbytes
                        if left > 0:
                            self.in_flight[caller] = left
                        else:
                            del self.in_flight[caller]
                except ProtocolError as e:
                    reply = Reply(False, e.code.value, str(e))
                except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
                    raise  # the stream broke: nobody to answer
                except Exception as e:  # a handler bug must not kill the server; the caller gets told
                    logger.exception("handler failed for %s", caller)
                    reply = Reply(False, RejectCode.INTERNAL.value, f"{type(e).__name__}: {e}")
                if not reply.ok:
                    if not sent_go:
                        writer.write(STOP)
                        sent = 1
                    if reply.code != RejectCode.NOT_SYNCHRONISER.value:  # a routing redirect, not abuse
                        self.count_refusal(reply.code)
                        logger.warning("refused %s from %s: %s", reply.code, caller, reply.message)
                body, idle, ceiling = reply.body, None, float("inf")
                if body:  # a snapshot or records served: its bytes' time on the link, on top
                    # in its turn on this node's link, behind records and contributions; past half the
                    # deadline it goes anyway (its caller is waiting for it)
                    deadline.reschedule(loop.time() + self.timeout_s)
                    try:
                        ticket = await self.uplink.take(
                            len(body), class_of(op, len(body)), self.timeout_s / 2
                        )
                    except TimeoutError:
                        ticket = await self.uplink.take(len(body), URGENT, 0.0)
                    ahead, now = self.queued(), loop.time()
                    self._on_link(key, len(body), caller, deadline)
                    deadline.reschedule(self.links.until(now, self.timeout_s, caller, len(body) + ahead))
                    idle = self.idle_s(caller, self.timeout_s, ahead)
                    ceiling = (
                        now + self.timeout_s + SHARED * self.links.allowance_s(caller, len(body) + ahead)
                    )
                sent += write_header(
                    writer, {"ok": reply.ok, "code": reply.code, "message": reply.message}, body
                )
                await write_body(writer, body, idle, deadline, ceiling)
                sent += len(body)
                self.bytes_out += len(reply.body)
                self._moving.pop(key, None)
                if ticket is not None:  # it has arrived when the caller, having read it, closes the stream
                    self.uplink.give(ticket, arrived=await stream_closed(reader, deadline))
                    ticket = None
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, RuntimeError) as e:
            # RuntimeError: asyncio refuses to write to a transport the peer already closed
            self.count_refusal("broken_stream")
            logger.warning("stream from %s dropped: %s", caller, type(e).__name__)
        finally:
            self._moving.pop(key, None)
            self._count(op, sent, received, call=False)
            writer.close()
            if ticket is not None:
                self.uplink.give(ticket, arrived=False)

    async def call(
        self,
        peer_id: str,
        op: str,
        payload: bytes = b"",
        timeout_s: float | None = None,
        share: int = 1,
        queue_s: float | None = None,
    ) -> Reply:
        """Send ``payload`` to ``op`` on ``peer_id`` and wait for the reply, within the deadline. ``share``: how
        many such bodies the peer's link may be taking at once from others (a synchroniser's, from every
        learner of a round): the body is allowed its time that many times over. This node sees only its own
        link; once p2pd has taken the body, nothing tells it how fast the far end reads.

        The body first waits its turn on this node's link (``node.swarm.uplink``), at most ``queue_s``
        (default: the deadline), before the deadline starts; past that, ``LinkBusy`` and nothing sent."""
        deadline = self.timeout_s if timeout_s is None else timeout_s
        patience = deadline if queue_s is None else queue_s
        try:
            ticket: Ticket | None = await self.uplink.take(len(payload), class_of(op, len(payload)), patience)
        except TimeoutError:
            raise LinkBusy(
                f"{op} to {peer_id}: this node's link had no room for its {len(payload)}-byte body within "
                f"{patience:.1f}s ({self.uplink.out} bytes in flight)"
            ) from None
        now = time.time()
        key = next(self._ids)
        # bodies already on the link with this peer, either way, go first on its one connection: their
        # time is allowed to this request's round trips too
        ahead = self.queued()
        track = self._calls[key] = {"peer": peer_id, "op": op, "since": now, "last": now, "bytes": 0}
        outcome = "broken"
        sent = received = 0  # for ``by_op``
        loop = asyncio.get_running_loop()
        moving = 0  # the bytes of the body in flight when the deadline passed (0: none was)
        allowed = self.links.allowance_s(peer_id, ahead)  # seconds on top of the deadline
        try:
            async with asyncio.timeout(deadline + allowed) as cm:
                _, reader, writer = await self.p2p.call_binary_stream_handler(
                    PeerID.from_base58(peer_id), PROTOCOL_NAME
                )
                try:
                    sent = write_header(writer, {"op": op}, payload)
                    await writer.drain()
                    go = await reader.readexactly(1) == GO
                    received = 1
                    if go:
                        sent += len(payload)
                        began, moving, ahead = loop.time(), len(payload), self.queued()
                        self._on_link(key, len(payload), peer_id, cm)
                        # it, as many more on the far link, and those ahead on ours
                        allowed = self.links.allowance_s(peer_id, max(1, share) * len(payload) + ahead)
                        cm.reschedule(began + deadline + allowed)
                        ceiling = began + deadline + SHARED * allowed
                        await write_body(writer, payload, self.idle_s(peer_id, deadline, ahead), cm, ceiling)
                    header, nbytes = await read_header(reader, self.max_bytes)
                    self.uplink.give(ticket, arrived=go)  # the far end read it all (or was sent none)
                    ticket = None
                    received += header_bytes(header)
                    if go:  # from GO to the reply: the upload and the handler, a rate on the safe side
                        self.links.observe(peer_id, len(payload), loop.time() - began)
                    track["last"] = time.time()
                    self._moving.pop(key, None)
                    began, moving, ahead = loop.time(), nbytes, self.queued()
                    if nbytes:
                        self._on_link(key, nbytes, peer_id, cm)
                    allowed = self.links.allowance_s(peer_id, nbytes + ahead)
                    cm.reschedule(began + deadline + allowed)
                    idle = self.idle_s(peer_id, deadline, ahead)
                    ceiling = began + deadline + SHARED * allowed
                    body = await read_body(reader, nbytes, track, idle, cm, ceiling)
                    received += nbytes
                    self.links.observe(peer_id, nbytes, loop.time() - began)
                    moving = 0
                    outcome = "ok" if header.get("ok") else str(header.get("code"))
                    self.bytes_out += len(payload) if go else 0
                    self.bytes_in += len(body)
                finally:
                    writer.close()
        except TimeoutError as e:
            outcome = "timeout"
            if moving:  # the link is slower than this node counted on: twice the time, the next try
                self.links.overran(peer_id)
                raise TransportError(
                    f"{op} to {peer_id}: no reply within {deadline:.1f}s and {allowed:.1f}s for its "
                    f"{moving}-byte body"
                ) from e
            raise TransportError(f"{op} to {peer_id}: no reply within {deadline:.1f}s") from e
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError) as e:
            raise TransportError(f"{op} to {peer_id}: stream broke ({type(e).__name__}: {e})") from e
        except Exception as e:  # p2pd control errors arrive as various types
            raise TransportError(
                f"{op} to {peer_id}: could not open a stream ({type(e).__name__}: {e}); "
                "is the peer alive and reachable?"
            ) from e
        finally:
            if ticket is not None:
                self.uplink.give(ticket, arrived=False)
            self._moving.pop(key, None)
            self._count(op, sent, received, call=True)
            c = self._calls.pop(key)
            self._done.append(
                {
                    "peer": peer_id,
                    "op": op,
                    "bytes": c["bytes"],
                    "seconds": round(time.time() - c["since"], 3),
                    "outcome": outcome,
                    "t": round(time.time(), 3),
                }
            )
        return Reply(bool(header.get("ok")), str(header.get("code")), str(header.get("message")), body)
