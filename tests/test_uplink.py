"""The order bodies take this node's link (node.swarm.uplink): urgent ones never wait, the rest go by class
within a window that follows the rate measured from what arrived, one body always goes alone, and a body
that waits past its caller's patience holds nothing."""

from __future__ import annotations

import asyncio

import pytest

from node.swarm.uplink import (
    AUDIT,
    CONTRIBUTION,
    MIN_WINDOW,
    RATE_MEMORY_S,
    SMALL,
    SNAPSHOT,
    SPAN_S,
    TARGET_S,
    URGENT,
    Uplink,
    class_of,
)
from tests.relay_util import LoopbackP2P


def test_a_body_is_classed_by_its_op_and_a_small_one_is_urgent() -> None:
    assert class_of("contribute", 20_000) == CONTRIBUTION
    assert class_of("snapshot", 200_000) == SNAPSHOT
    assert class_of("kept", 50_000) == AUDIT
    assert class_of("record", 500_000) == URGENT  # a merge record pushed: first on the link
    assert class_of("contribute", SMALL) == URGENT


def test_the_window_follows_the_rate_measured_from_what_arrived_over_busy_time() -> None:
    now = [0.0]
    up = Uplink(1000.0, clock=lambda: now[0])
    assert up.rate() == 1000.0 and up.window() == MIN_WINDOW  # nothing measured: the floor
    # 1 MB/s for 2 s: a 100 KB body arrives every 0.1 s, one in flight at a time
    for _ in range(20):
        t = up._ticket(100_000, True)
        now[0] += 0.1
        up.give(t)
    assert up.rate() == pytest.approx(1e6)
    assert up.window() == int(TARGET_S * 1e6)
    # idle time is no part of a measure: after 5 s with nothing in flight, a burst arrives at the same rate
    now[0] += 5.0
    for _ in range(3):
        t = up._ticket(100_000, True)
        now[0] += 0.1
        up.give(t)
    assert up.rate() == pytest.approx(1e6)
    # a burst of replies read at once is averaged over SPAN_S of busy time, not taken for a fast link
    tickets = [up._ticket(10_000, True) for _ in range(10)]
    now[0] += 1.0
    for t in tickets:
        up.give(t)
    assert up.rate() < 2e6
    # a body that failed measures nothing; a measure is forgotten after RATE_MEMORY_S
    now[0] += RATE_MEMORY_S + SPAN_S
    up.give(up._ticket(5_000_000, True), arrived=False)
    assert up.rate() == 1000.0


def test_bodies_wait_in_class_order_and_urgent_ones_pass_them() -> None:
    async def main() -> None:
        up = Uplink(0.0)  # the least window: 64 KB
        went: list[str] = []
        first = await up.take(60_000, CONTRIBUTION, 1.0)  # in flight: the next bulk body does not fit

        async def one(name: str, nbytes: int, klass: int) -> None:
            up.tickets.append(await up.take(nbytes, klass, 5.0))
            went.append(name)

        up.tickets = []
        tasks = [
            asyncio.ensure_future(one("audit", 30_000, AUDIT)),
            asyncio.ensure_future(one("snapshot", 30_000, SNAPSHOT)),
            asyncio.ensure_future(one("contribution", 30_000, CONTRIBUTION)),
        ]
        await asyncio.sleep(0.01)
        assert went == []  # none fits beside the body in flight
        record = await up.take(100_000, URGENT, 0.0)  # a record: past the window, at once
        assert up.out == 160_000
        up.give(record)
        await asyncio.sleep(0.01)
        assert went == []  # still 60 KB in flight
        up.give(first)  # it arrived: the two that fit go, best class first
        await asyncio.sleep(0.01)
        assert went == ["contribution", "snapshot"]
        up.give(up.tickets[0])
        await asyncio.sleep(0.01)
        assert went == ["contribution", "snapshot", "audit"]
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_one_body_larger_than_the_window_goes_alone() -> None:
    async def main() -> None:
        up = Uplink(0.0)
        big = await up.take(10 * MIN_WINDOW, SNAPSHOT, 0.0)  # nothing in flight: it goes, however large
        waiter = asyncio.ensure_future(up.take(1_000_000, CONTRIBUTION, 5.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        up.give(big)
        await asyncio.wait_for(waiter, 1.0)
        assert up.out == 1_000_000
        # a record in flight beside it does not keep the next large one from going once the first arrives
        record = await up.take(10_000, URGENT, 0.0)
        third = asyncio.ensure_future(up.take(1_000_000, CONTRIBUTION, 5.0))
        await asyncio.sleep(0.01)
        assert not third.done()
        up.give(waiter.result())
        await asyncio.wait_for(third, 1.0)
        up.give(record)

    asyncio.run(main())


def test_a_body_that_waits_past_its_patience_holds_nothing_and_the_next_goes() -> None:
    async def main() -> None:
        up = Uplink(0.0)
        first = await up.take(MIN_WINDOW, CONTRIBUTION, 0.0)
        with pytest.raises(TimeoutError):
            await up.take(30_000, CONTRIBUTION, 0.05)
        assert up.gave_up[CONTRIBUTION] == 1
        later = asyncio.ensure_future(up.take(30_000, AUDIT, 5.0))
        await asyncio.sleep(0.01)
        up.give(first)
        await asyncio.wait_for(later, 1.0)
        assert up.out == 30_000  # the one that gave up took no room
        snap = up.snapshot()
        assert snap["gave_up"] == {"contribution": 1} and snap["waiting"] == 0

    asyncio.run(main())


# ------------------------------------------------------------------ on a link that queues what it is given
class _OneConnection(LoopbackP2P):
    """Two ``Transport``s joined on loopback through a relay that, like one TCP connection carrying every
    stream (p2pd's), sends each direction's bytes strictly in the order they were written, at ``bps``
    bytes/s, with no limit on what it holds: a body written after others waits behind all of them."""

    def __init__(self, bps: float) -> None:
        super().__init__()
        self.bps = bps
        self.wire: dict[str, asyncio.Queue] = {"up": asyncio.Queue(), "down": asyncio.Queue()}

    async def start(self) -> None:
        await super().start()
        self.senders = [asyncio.ensure_future(self._send(q)) for q in self.wire.values()]

    async def _send(self, q: asyncio.Queue) -> None:
        while True:
            chunk, writer = await q.get()
            await asyncio.sleep(len(chunk) / self.bps)
            if chunk:
                writer.write(chunk)
            else:
                writer.close()

    async def _take(self, reader, writer, way: str) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                self.wire[way].put_nowait((chunk, writer))
        except ConnectionError:
            pass
        self.wire[way].put_nowait((b"", writer))

    async def _relay(self, caller: tuple, served: tuple) -> None:
        await asyncio.gather(self._take(caller[0], served[1], "up"), self._take(served[0], caller[1], "down"))

    def close(self) -> None:
        for t in self.senders:
            t.cancel()
        super().close()


def test_a_record_pushed_behind_three_contributions_on_a_full_link_arrives_before_the_last_two(monkeypatch):
    """Three 100 KB contributions go to one peer over a 100 KB/s link that sends its bytes in the order they
    were written (one connection), then a 5 KB merge record. The record waits behind the one contribution
    on the link, not behind all three: its reply comes back before the second contribution's. With every
    body written at once (a window as large as the three), it comes back after the third."""
    from node.swarm import transport as tmod
    from node.swarm import uplink as umod
    from node.swarm.links import LinkRates
    from node.swarm.transport import Reply, Transport

    monkeypatch.setattr(tmod.PeerID, "from_base58", staticmethod(lambda s: s))

    async def go() -> list[str]:
        link = _OneConnection(bps=100_000)
        server = Transport(link, timeout_s=5.0, links=LinkRates(100_000))

        async def took(who: str, payload: bytes) -> Reply:
            return Reply(True)

        server.register("contribute", took)
        server.register("record", took)
        await server.start()
        await link.start()
        caller = Transport(link, timeout_s=5.0, links=LinkRates(100_000))
        done: list[str] = []

        async def send(name: str, op: str, nbytes: int) -> None:
            reply = await caller.call("server", op, bytes(nbytes))
            assert reply.ok
            done.append(name)

        try:
            tasks = [asyncio.ensure_future(send(f"c{i}", "contribute", 100_000)) for i in range(3)]
            await asyncio.sleep(0.2)  # the first is on the link
            await send("record", "record", 5_000)
            await asyncio.gather(*tasks)
        finally:
            link.close()
        return done

    order = asyncio.run(go())
    assert order.index("record") < 2, order
    monkeypatch.setattr(umod, "MIN_WINDOW", 400_000)  # all three written at once: the record waits behind
    order = asyncio.run(go())
    assert order.index("record") == 3, order
