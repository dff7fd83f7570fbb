"""Request/response over real hivemind P2P streams between two DHT nodes on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

import pytest

from dht.identity import Identity
from dht.launch import start_dht
from node.swarm.transport import Reply, Transport, TransportError
from protocol.errors import ProtocolError, RejectCode

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def two_dhts(tmp_path):
    # A fresh pair per test: p2pd keeps routing a protocol to the first listener registered for it, so a
    # daemon serves one Transport for its whole life (as a node does).
    tmp = tmp_path
    dhts = []
    try:
        for i in range(2):
            path = Identity.generate().save(tmp / f"id{i}.key")
            peers = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(start_dht(path, LOOPBACK, peers, timeout_s=30))
        yield dhts
    finally:
        for d in dhts:
            d.shutdown()


@contextlib.asynccontextmanager
async def _pair(two_dhts, **kw):
    a = Transport(await two_dhts[0].replicate_p2p(), **kw)
    b = Transport(await two_dhts[1].replicate_p2p(), **kw)
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        for t in (a, b):
            await t.stop()
            await t.p2p.shutdown()  # a replica: closes this process's client, the daemon stays up


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_large_payload_round_trip_and_caller_identity(two_dhts):
    async def main():
        async with _pair(two_dhts, max_bytes=64 << 20, timeout_s=30) as (a, b):
            seen = []

            async def digest(caller: str, payload: bytes) -> Reply:
                seen.append(caller)
                return Reply(True, body=hashlib.sha256(payload).digest() + payload[:10])

            b.register("digest", digest)
            payload = bytes(range(256)) * (12 * 4096 + 7)  # ~12 MiB: far over hivemind's 4 MiB unary cap
            reply = await a.call(two_dhts[1].peer_id.to_base58(), "digest", payload)
            assert reply.ok and reply.body[:32] == hashlib.sha256(payload).digest()
            assert seen == [two_dhts[0].peer_id.to_base58()]  # the authenticated caller, not a claim
            assert b.bytes_in == len(payload) and a.bytes_out == len(payload)

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_refusals_have_codes_and_the_server_survives(two_dhts):
    async def main():
        async with _pair(two_dhts, max_bytes=1 << 20, timeout_s=5) as (a, b):
            target = two_dhts[1].peer_id.to_base58()

            async def strict(caller: str, payload: bytes) -> Reply:
                if payload != b"good":
                    raise ProtocolError(RejectCode.MALFORMED, "expected b'good'")
                return Reply(True, body=b"fine")

            async def broken(caller: str, payload: bytes) -> Reply:
                raise RuntimeError("bug")

            b.register("strict", strict)
            b.register("broken", broken)
            r = await a.call(target, "strict", b"x" * (2 << 20))
            assert not r.ok and r.code == RejectCode.TOO_LARGE.value
            r = await a.call(target, "strict", b"bad")
            assert not r.ok and r.code == "malformed" and "expected" in r.message
            r = await a.call(target, "nope", b"")
            assert not r.ok and r.code == "unknown_op"
            r = await a.call(target, "broken", b"")
            assert not r.ok and r.code == "internal_error"
            r = await a.call(target, "strict", b"good")
            assert r.ok and r.body == b"fine"  # still serving after every refusal
            assert b.refused == {"too_large": 1, "malformed": 1, "unknown_op": 1, "internal_error": 1}
            # every byte each end put on the stream is counted by op, and the other end counted the same
            # (the refused 2 MiB body was never sent: refused after its header)
            for _ in range(50):  # the server counts a call after its reply is written
                if {op: r[1:] for op, r in b.by_op.items()} == {op: r[2:0:-1] for op, r in a.by_op.items()}:
                    break
                await asyncio.sleep(0.02)
            assert {op: r[1:] for op, r in b.by_op.items()} == {op: r[2:0:-1] for op, r in a.by_op.items()}
            assert {op: r[0] for op, r in a.by_op.items()} == {"strict": 3, "nope": 1, "broken": 1}
            assert 3 + 4 < a.by_op["strict"][1] < 1024 and a.transfers()["by_op"]["nope"]["calls"] == 1

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_a_body_holds_room_on_the_senders_link_until_word_of_its_arrival_comes_back(two_dhts):
    """A call's body holds room on its sender's link (``Transport.uplink``) until the reply's header is back;
    a served reply's, until the caller, having read it, closes the stream. Both are then counted as
    arrived (the rate the window follows is measured from them), and no room is left held."""

    async def main():
        async with _pair(two_dhts, max_bytes=8 << 20, timeout_s=10) as (a, b):
            target = two_dhts[1].peer_id.to_base58()

            async def snapshot(caller: str, payload: bytes) -> Reply:
                return Reply(True, body=bytes(300_000))

            b.register("snapshot", snapshot)
            b.register("contribute", lambda caller, payload: _ok())
            r = await a.call(target, "contribute", bytes(200_000))
            assert r.ok and a.uplink.delivered == 200_000 and a.uplink.out == 0
            r = await a.call(target, "snapshot", b"{}")
            assert r.ok and len(r.body) == 300_000
            for _ in range(100):  # the caller's close reaches the server through both daemons
                if b.uplink.delivered:
                    break
                await asyncio.sleep(0.02)
            assert b.uplink.delivered == 300_000 and b.uplink.out == 0

    asyncio.run(main())


async def _ok() -> Reply:
    return Reply(True)


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_deadlines_and_unreachable_peers(two_dhts):
    async def main():
        async with _pair(two_dhts, timeout_s=5) as (a, b):

            async def slow(caller: str, payload: bytes) -> Reply:
                await asyncio.sleep(10)
                return Reply(True)

            b.register("slow", slow)
            with pytest.raises(TransportError, match="no reply within 0.5s"):
                await a.call(two_dhts[1].peer_id.to_base58(), "slow", b"", timeout_s=0.5)
            with pytest.raises(TransportError, match="is the peer alive"):
                await a.call(Identity.generate().peer_id, "slow", b"", timeout_s=3)

    asyncio.run(main())


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_admission_refuses_before_the_body_and_bytes_in_flight_are_bounded_per_peer(two_dhts):
    """Issue 19: a stranger's body was read in full before it was refused; one peer could have any number
    of bodies being read at once."""

    async def main():
        async with _pair(two_dhts, timeout_s=20) as (a, b):
            target, caller = two_dhts[1].peer_id.to_base58(), two_dhts[0].peer_id.to_base58()
            allowed: set[str] = set()
            asked: list[tuple[str, str]] = []

            async def admit(peer: str, op: str) -> None:
                asked.append((peer, op))
                if peer not in allowed:
                    raise ProtocolError(RejectCode.UNKNOWN_PEER, f"{peer} is not a member")

            gate, handled = asyncio.Event(), []

            async def hold(peer: str, payload: bytes) -> Reply:
                handled.append(len(payload))
                await gate.wait()
                return Reply(True)

            b.admit, b.peer_budget = admit, 1 << 20
            b.register("hold", hold)
            big = b"x" * (64 << 20)
            r = await a.call(target, "hold", big)
            assert not r.ok and r.code == "unknown_peer" and "not a member" in r.message
            assert asked == [(caller, "hold")] and handled == [] and b.bytes_in == 0  # not a byte was read
            assert a.bytes_out == 0  # nor sent: the caller waits for GO

            allowed.add(caller)
            first = asyncio.create_task(a.call(target, "hold", b"y" * (700 << 10)))
            for _ in range(200):  # until the first body is read and its handler holds it
                if handled:
                    break
                await asyncio.sleep(0.05)
            assert handled == [700 << 10] and b.in_flight == {caller: 700 << 10}
            r = await a.call(target, "hold", b"z" * (700 << 10))
            assert not r.ok and r.code == "peer_busy" and "per-peer budget" in r.message
            assert handled == [700 << 10] and b.bytes_in == 700 << 10  # refused before its body too
            small = asyncio.create_task(a.call(target, "hold", b"s" * 1000))  # within the budget: taken
            gate.set()
            assert (await first).ok and (await small).ok
            assert b.in_flight == {}
            r = await a.call(target, "hold", b"z" * (700 << 10))  # the budget is free again
            assert r.ok
            assert b.refused == {"unknown_peer": 1, "peer_busy": 1}

    asyncio.run(main())
