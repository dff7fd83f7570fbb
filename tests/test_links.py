"""The rate measured on each peer's link and a body's allowance on it (``node.swarm.links``). The
transport's deadlines that follow it are tested on a capped link between real nodes (``tests/test_wan.py``)."""

from __future__ import annotations

import asyncio

import pytest

from node.swarm.links import MIN_SAMPLE, SLACK, LinkRates
from tests.relay_util import LoopbackP2P


def test_a_bodys_allowance_follows_the_measured_rate_never_below_the_floor():
    links = LinkRates(floor_bps=1000.0)
    assert links.allowance_s("a", 0) == 0.0
    assert links.allowance_s("a", 10_000) == pytest.approx(SLACK * 10.0)  # unmeasured: the floor
    links.observe("a", MIN_SAMPLE - 1, 0.001)  # a small body measures the round trip: not a sample
    assert links.rates == {}
    links.observe("a", 1 << 20, 1.0)
    assert links.rate("a") == pytest.approx(1 << 20)
    links.observe("a", 1 << 20, 0.5)  # a moving average, not the last sample
    assert (1 << 20) < links.rate("a") < (2 << 20)
    links.observe("b", 1 << 20, 10_000.0)  # slower than the floor: counted at the floor
    assert links.rate("b") == 1000.0
    assert links.allowance_s("b", 1 << 20) == pytest.approx(SLACK * (1 << 20) / 1000.0)
    assert set(links.snapshot()) == {"a", "b"}


def test_a_body_past_its_allowance_halves_the_rate_down_to_the_floor():
    links = LinkRates(floor_bps=1000.0)
    links.observe("a", 1 << 20, 1.0)
    before = links.allowance_s("a", 1 << 20)
    links.overran("a")
    assert links.allowance_s("a", 1 << 20) == pytest.approx(2 * before)
    for _ in range(40):
        links.overran("a")
    assert links.rate("a") == 1000.0
    links.overran("never-measured")
    assert links.rate("never-measured") == 1000.0


@pytest.mark.parametrize("floor", [0.0, -1.0, float("nan")])
def test_a_floor_that_is_not_a_positive_rate_is_refused(floor):
    with pytest.raises(ValueError, match="must be positive"):
        LinkRates(floor)


def test_a_link_floor_that_is_not_positive_is_a_config_error():
    from node.swarm.settings import NodeSettings
    from protocol.errors import ConfigError

    with pytest.raises(ConfigError, match="link_floor_mbps"):
        NodeSettings(link_floor_mbps=0.0)


# ------------------------------------------------------------------ the transport's deadlines on a slow link
class _SlowLink(LoopbackP2P):
    """Two ``Transport``s joined by TCP on loopback through a relay that forwards each direction at ``bps``
    bytes/s. Relays given one ``shared`` dict share one link: each direction's bytes, of every connection
    through any of them, leave in turn at ``bps``."""

    def __init__(self, bps: float, shared: dict | None = None) -> None:
        super().__init__()
        self.bps = bps
        self.free = {"up": 0.0, "down": 0.0} if shared is None else shared  # when each direction is free

    async def _pump(self, reader, writer, way: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            while chunk := await reader.read(4096):
                start = max(loop.time(), self.free[way])
                self.free[way] = start + len(chunk) / self.bps
                await asyncio.sleep(self.free[way] - loop.time())
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _relay(self, caller: tuple, served: tuple) -> None:
        await asyncio.gather(self._pump(caller[0], served[1], "up"), self._pump(served[0], caller[1], "down"))


def test_a_body_several_times_the_deadline_on_a_slow_link_arrives_and_a_stalled_one_fails(monkeypatch):
    """A 200 KB body over a 100 KB/s link takes 2 s against a 0.5 s deadline. It arrives, both ways (the
    request, and the reply that echoes it), within its allowance at the link's floor; the link's rate is
    measured from it; under a fixed deadline the same call runs out. A handler that takes the body and never
    answers fails the call a deadline after the body, not never."""
    from node.swarm import transport as tmod
    from node.swarm.transport import Reply, Transport, TransportError

    monkeypatch.setattr(tmod.PeerID, "from_base58", staticmethod(lambda s: s))

    async def go() -> None:
        link = _SlowLink(bps=100_000)
        server = Transport(link, timeout_s=0.5, links=LinkRates(50_000))
        caller = Transport(link, timeout_s=0.5, links=LinkRates(50_000))

        async def echo(who: str, payload: bytes) -> Reply:
            return Reply(True, body=payload)

        stuck = asyncio.Event()

        async def hang(who: str, payload: bytes) -> Reply:
            await stuck.wait()
            return Reply(True)

        server.register("echo", echo)
        server.register("hang", hang)
        await server.start()
        await link.start()
        try:
            body = bytes(range(256)) * 800  # 204,800 bytes: about 2 s each way
            t0 = asyncio.get_running_loop().time()
            reply = await caller.call("server", "echo", body)
            took = asyncio.get_running_loop().time() - t0
            assert reply.ok and reply.body == body and took > 3.0  # both ways, each past the deadline
            assert 50_000 < caller.links.rate("server") < 150_000  # measured, near the link's rate
            assert server.links.rates.get("caller", 0) > 50_000
            # without the allowance (a fixed deadline), the same call runs out
            fixed = Transport(link, timeout_s=0.5, links=LinkRates(1e12))
            with pytest.raises(TransportError, match="no reply within"):
                await fixed.call("server", "echo", body)
            # a server that takes the body and never answers: the deadline after it, not forever
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(TransportError, match="no reply within|stream broke"):
                await caller.call("server", "hang", body)  # (the server's own deadline may close it first)
            assert asyncio.get_running_loop().time() - t0 < 2 * SLACK * len(body) / 50_000
        finally:
            stuck.set()
            link.close()

    asyncio.run(go())


class _Router:
    """The caller's p2p stand-in for several servers: a stream to a peer goes through that peer's relay."""

    def __init__(self, links: dict) -> None:
        self.links = links

    async def call_binary_stream_handler(self, peer, name):
        return await self.links[peer].call_binary_stream_handler(peer, name)


def test_bodies_to_three_peers_sharing_one_link_each_arrive_past_their_own_allowance(monkeypatch):
    """One node echoes a 100 KB body to each of three peers at once over a link of 100 KB/s that their streams
    share (one uplink, one downlink), every node counting on 100 KB/s. Each body alone takes 1 s of a 2.5 s
    allowance; sharing the link, each takes about 3 s each way. The caller counts every body on its link
    (``Transport.queued``, ``_on_link``); a server sees only its own, and a body that keeps arriving keeps its
    deadline ahead of it (``read_body``): all three arrive, none runs out."""
    from node.swarm import transport as tmod
    from node.swarm.transport import Reply, Transport

    monkeypatch.setattr(tmod.PeerID, "from_base58", staticmethod(lambda s: s))

    async def go() -> None:
        shared = {"up": 0.0, "down": 0.0}
        links = {name: _SlowLink(bps=100_000, shared=shared) for name in ("a", "b", "c")}

        async def echo(who: str, payload: bytes) -> Reply:
            return Reply(True, body=payload)

        servers = []
        for link in links.values():
            server = Transport(link, timeout_s=0.5, links=LinkRates(100_000))
            server.register("echo", echo)
            await server.start()
            await link.start()
            servers.append(server)
        caller = Transport(_Router(links), timeout_s=0.5, links=LinkRates(100_000))
        try:
            body = bytes(range(250)) * 400  # 100,000 bytes
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            replies = await asyncio.gather(*(caller.call(peer, "echo", body) for peer in links))
            took = loop.time() - t0
            assert all(r.ok and r.body == body for r in replies)
            assert took > 2 * 2.5  # every body ran past the allowance it had alone
            assert caller.queued() == 0 and all(s.queued() == 0 for s in servers)
            assert sum(s.refused.get("broken_stream", 0) for s in servers) == 0
        finally:
            for link in links.values():
                link.close()

    asyncio.run(go())


@pytest.mark.slow
def test_bodies_from_three_callers_into_one_peers_link_arrive_when_each_counts_the_others(monkeypatch):
    """Three nodes each send a 400 KB body at once to one peer whose link (200 KB/s) all three share, as a
    round's learners send a synchroniser their contributions. A caller's socket takes its body at once, so
    nothing tells it the far end reads at a third of the rate: with ``share=3`` each counts the two others'
    bodies (``Transport.call``) and all arrive; counting its own alone, a call runs out."""
    from node.swarm import transport as tmod
    from node.swarm.transport import Reply, Transport, TransportError

    monkeypatch.setattr(tmod.PeerID, "from_base58", staticmethod(lambda s: s))

    async def go(share: int) -> list:
        shared = {"up": 0.0, "down": 0.0}
        links = [_SlowLink(bps=200_000, shared=shared) for _ in range(3)]
        server = Transport(links[0], timeout_s=0.5, links=LinkRates(200_000))

        async def took(who: str, payload: bytes) -> Reply:
            return Reply(True)

        server.register("take", took)
        await server.start()
        for link in links:
            link.handler = links[0].handler
            await link.start()
        callers = [Transport(link, timeout_s=0.5, links=LinkRates(200_000)) for link in links]
        body = bytes(400_000)  # 2 s alone, 4.5 s allowed; 6 s with the two others
        try:
            return await asyncio.gather(
                *(c.call("server", "take", body, share=share) for c in callers), return_exceptions=True
            )
        finally:
            for link in links:
                link.close()

    assert all(isinstance(r, Reply) and r.ok for r in asyncio.run(go(share=3)))
    assert any(isinstance(r, TransportError) for r in asyncio.run(go(share=1)))
