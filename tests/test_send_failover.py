"""Routing a contribution past a synchroniser that hangs (``Contributions._send``).

A stopped node (SIGSTOP, a frozen VM, a link that drops packets without a reset) keeps its membership record
until it expires and answers nothing: the first request to it used up the whole failover budget, and every
contribution sent to its rounds was dropped (19 in one chaos run). The transport here is a stand-in: the
test is about how ``_send`` spends its deadline, not about sockets (tests/test_swarm.py kills real ones).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import node.swarm.contributions as contributions
from node.common.events import EventLog
from node.swarm.contributions import Contributions
from node.swarm.transport import Reply, TransportError
from protocol.config import ProtocolConfig


class _Transport:
    def __init__(self, hung: set[str]) -> None:
        self.hung = hung
        self.calls: list[tuple[str, float]] = []

    async def call(self, target: str, op: str, payload: bytes, timeout_s: float) -> Reply:
        self.calls.append((target, timeout_s))
        if target in self.hung:
            await asyncio.sleep(timeout_s)
            raise TransportError(f"{op} to {target}: no reply within {timeout_s:.1f}s")
        return Reply(True)


class _Sender(Contributions):
    def __init__(self, order: list[str], hung: set[str], failover_s: float) -> None:
        self.pcfg = ProtocolConfig()
        self.settings = SimpleNamespace(failover_s=failover_s, rpc_timeout_s=10.0, ttl_s=6.0, swarm="s")
        self.loop = asyncio.get_running_loop()
        self.peer_id, self.identity = "me", None
        self.order = order
        self.transport = _Transport(hung)
        self.suspect: dict[str, float] = {}
        self.counters: Counter = Counter()
        self.events = EventLog()

    def candidates(self, p: int) -> list[str]:
        return list(self.order)

    def rounds_behind(self, p: int) -> int:
        return 0


def _send(monkeypatch, order: list[str], hung: set[str], failover_s: float = 1.0) -> _Sender:
    monkeypatch.setattr(contributions, "encode_contribution", lambda header, enc: b"raw")
    monkeypatch.setattr(contributions, "sign_contribution", lambda swarm, identity, raw: b"sig")

    async def go() -> _Sender:
        s = _Sender(order, hung, failover_s)
        await s._send(SimpleNamespace(fragment=3, cid="me:3:10:1000"), None)
        return s

    return asyncio.run(go())


def test_a_hung_synchroniser_leaves_time_for_the_next_candidate(monkeypatch):
    s = _send(monkeypatch, ["A", "B", "C"], hung={"A"})
    assert [t for t, _ in s.transport.calls] == ["A", "B"]
    assert s.transport.calls[0][1] <= 0.5 + 1e-6  # half the budget while others are left
    assert s.counters["contributions_sent"] == 1 and s.counters["failovers"] == 1
    assert not s.events.of("drop")
    assert [e["dead"] for e in s.events.of("failover")] == ["A"]


def test_the_last_candidate_gets_what_is_left_and_then_the_contribution_is_dropped(monkeypatch):
    s = _send(monkeypatch, ["A", "B"], hung={"A", "B"})
    (a, wa), (b, wb) = s.transport.calls[:2]
    assert (a, b) == ("A", "B") and wa <= 0.5 + 1e-6 and wb > wa  # B, the last one left, gets the rest
    assert s.counters["contributions_sent"] == 0
    assert [e["why"] for e in s.events.of("drop")] == ["no synchroniser in time"]
