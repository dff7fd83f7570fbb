"""The relay that adds round trips between network namespaces (``node.chaos.delay``), on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from node.chaos.delay import _route, main, serve


async def _echo_server():
    async def echo(reader, writer):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_relay_adds_its_round_trip_and_carries_every_byte_in_order():
    """A one-byte echo through a relay holding bytes 40 ms each way takes about 80 ms more than direct; 2 MB
    through it, with a 256 KB window, come back whole and in order."""

    async def go():
        server, port = await _echo_server()
        listen = _free_port()
        up = asyncio.Event()
        relay = asyncio.ensure_future(
            serve([(("127.0.0.1", listen), ("127.0.0.1", port))], 40.0, 256 << 10, up.set)
        )
        await asyncio.wait_for(up.wait(), 10)
        loop = asyncio.get_running_loop()
        try:

            async def rtt(to: int) -> float:
                r, w = await asyncio.open_connection("127.0.0.1", to)
                t0 = loop.time()
                w.write(b"x")
                await w.drain()
                assert await asyncio.wait_for(r.readexactly(1), 5) == b"x"
                took = loop.time() - t0
                w.close()
                return took

            direct, relayed = await rtt(port), await rtt(listen)
            assert 0.075 < relayed - direct < 0.5, (direct, relayed)
            blob = os.urandom(2 << 20)
            r, w = await asyncio.open_connection("127.0.0.1", listen)

            async def send():
                w.write(blob)
                await w.drain()
                w.write_eof()

            sender = asyncio.ensure_future(send())
            got = await asyncio.wait_for(r.readexactly(len(blob)), 30)
            await sender
            assert hashlib.sha256(got).digest() == hashlib.sha256(blob).digest()
            w.close()
        finally:
            relay.cancel()
            server.close()
            with pytest.raises(asyncio.CancelledError):
                await relay

    asyncio.run(go())


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--one-way-ms", "-1", "127.0.0.1:1=127.0.0.1:2"], "0 to 10000"),
        (["--one-way-ms", "5", "--window", "10", "127.0.0.1:1=127.0.0.1:2"], "at least 65536"),
        (["--one-way-ms", "5", "127.0.0.1:1"], "not LISTEN_HOST"),
        (["--one-way-ms", "5", "127.0.0.1:x=127.0.0.1:2"], "not HOST:PORT"),
    ],
)
def test_a_bad_flag_or_route_is_refused_with_its_reason(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_a_route_names_where_it_listens_and_where_it_forwards():
    assert _route("10.0.0.1:41000=10.0.0.2:41000") == (("10.0.0.1", 41000), ("10.0.0.2", 41000))
