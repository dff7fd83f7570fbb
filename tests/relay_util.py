"""A stand-in for the p2p daemons under two ``Transport``s: loopback TCP through a relay of the test's own.

The daemons only carry the streams, so a test of what the transport does on a slow or ordered link can put
its own relay between the two ends. ``LoopbackP2P`` is the part every such relay shares: the served
transport's stream handler (``add_binary_stream_handler``), a server that hands each relayed connection to
it as a stream from peer ``"caller"``, and ``call_binary_stream_handler``, which dials the relay. A subclass
says how the relay carries the bytes (``_relay``: the connection from the caller, and one to the handler)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace


class LoopbackP2P:
    def __init__(self) -> None:
        self.handler = None

    async def add_binary_stream_handler(self, name, handler) -> None:
        self.handler = handler

    async def remove_binary_stream_handler(self, name) -> None:
        self.handler = None

    async def start(self) -> None:
        async def served(reader, writer):
            info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "caller"))
            await self.handler(info, reader, writer)

        self.inner = await asyncio.start_server(served, "127.0.0.1", 0)
        self.relay = await asyncio.start_server(self._connected, "127.0.0.1", 0)

    async def _connected(self, reader, writer) -> None:
        port = self.inner.sockets[0].getsockname()[1]
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        await self._relay((reader, writer), (r2, w2))

    async def _relay(self, caller: tuple, served: tuple) -> None:
        raise NotImplementedError

    async def call_binary_stream_handler(self, peer, name):
        port = self.relay.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return None, reader, writer

    def close(self) -> None:
        self.inner.close()
        self.relay.close()
