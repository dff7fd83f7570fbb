"""The dispatcher (``node.swarm.dispatch``): one place admits a request's caller, runs its op and scores a
refusal, so an op handler holds only its op."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from node.swarm.dispatch import OPS, Dispatcher
from node.swarm.transport import Reply
from node.swarm.view import SwarmView
from protocol.errors import ProtocolError, RejectCode


class _Node:
    def __init__(self) -> None:
        self.members, self.banned, self.penalised, self.ran = {"member"}, {"banned"}, [], []

    async def known(self, caller: str) -> bool:
        if caller in self.banned:
            raise ProtocolError(RejectCode.BANNED, f"{caller} is banned here")
        return caller in self.members

    def penalise(self, caller: str, code: RejectCode) -> None:
        self.penalised.append((caller, code.value))

    def handler(self, op: str):
        async def run(caller: str, body: bytes) -> Reply:
            self.ran.append((op, caller))
            if body == b"bad":
                raise ProtocolError(RejectCode.MALFORMED, f"a bad {op}")
            return Reply(True, body=body)

        return run


def _dispatcher(node: _Node) -> Dispatcher:
    return Dispatcher(node.known, node.penalise, {op: node.handler(op) for op in OPS})


def test_a_stranger_is_refused_before_its_op_runs_where_the_dispatcher_admits():
    node = _Node()
    d = _dispatcher(node)
    for op, rule in OPS.items():
        reply = asyncio.run(d(op, "stranger", b"x"))
        if rule.admit:
            assert (reply.ok, reply.code) == (False, "unknown_peer"), op
        else:  # contribute and record admit their callers themselves, after checks that come first
            assert reply.ok, op
    assert node.ran == [(op, "stranger") for op, rule in OPS.items() if not rule.admit]
    assert node.penalised == []  # not knowing a caller is no proof it misbehaved


def test_a_refused_request_is_scored_only_where_its_op_says_and_a_banned_caller_gets_banned():
    node = _Node()
    d = _dispatcher(node)
    for op in OPS:
        reply = asyncio.run(d(op, "member", b"bad"))
        assert (reply.ok, reply.code, reply.message) == (False, "malformed", f"malformed: a bad {op}")
    assert node.penalised == [("member", "malformed") for op, rule in OPS.items() if rule.scored]
    assert {"evidence", "kept", "proof", "omission"} == {op for op, rule in OPS.items() if rule.scored}
    assert asyncio.run(d("records", "member", b"ok")).body == b"ok"
    # the view raises for a banned caller: the transport answers ``banned`` (its refusal, unscored here)
    with pytest.raises(ProtocolError, match="banned"):
        asyncio.run(d("proof", "banned", b"x"))


def test_a_handler_for_an_op_with_no_rule_is_a_bug_caught_at_start():
    node = _Node()
    with pytest.raises(ValueError, match="no rule for ops"):
        Dispatcher(node.known, node.penalise, {"fetch_everything": node.handler("x")})


class _SlowView:
    """What ``SwarmView.look_up`` reads: the view, its settings and clock, and a DHT re-read that ``delay_s``
    holds up (a loaded host's DHT) before it adds ``joined`` to the view."""

    look_up = SwarmView.look_up

    def __init__(self, delay_s: float, joined: str) -> None:
        self.settings = SimpleNamespace(heartbeat_s=10.0, rpc_timeout_s=0.4)
        self.clock = time.monotonic
        self.members: dict = {}
        self._unknown_asked: dict = {}
        self.delay_s, self.joined, self.reads = delay_s, joined, 0

    async def refresh(self) -> None:
        self.reads += 1
        await asyncio.sleep(self.delay_s)
        self.members[self.joined] = object()


def test_a_stranger_is_answered_within_its_deadline_while_a_slow_dht_read_goes_on():
    async def run(view: _SlowView, caller: str) -> tuple[bool, bool, bool]:
        first = await view.look_up(caller)
        done = view._unknown_asked[caller][1].done()  # the re-read, still going on or not
        await asyncio.sleep(view.delay_s)  # it goes on and ends; a request within the heartbeat reads no more
        return first, done, await view.look_up(caller)

    # a re-read that takes 5x the request's deadline: the stranger is refused from the view as it stands
    slow = _SlowView(2.0, joined="someone else")
    assert asyncio.run(run(slow, "stranger")) == (False, False, False) and slow.reads == 1
    # a joiner whose record the quick re-read finds is admitted on that read
    quick = _SlowView(0.05, joined="joiner")
    assert asyncio.run(run(quick, "joiner"))[0] is True and quick.reads == 1


class _ViewAfterAMemberLeft:
    """What ``SwarmView.known`` reads, on a hand-driven clock: ``gone`` was in a view read at t = 0 and is in
    none since (its stores stopped reaching us on a full link, or it died)."""

    known, recent, look_up = SwarmView.known, SwarmView.recent, SwarmView.look_up

    def __init__(self) -> None:
        self.settings = SimpleNamespace(heartbeat_s=2.0, rpc_timeout_s=0.4, ttl_s=8.0)
        self.now = 0.0
        self.clock = lambda: self.now
        self.peer_id, self.members, self.blocked = "me", {"member": object()}, set()
        self.last_in_view = {"member": 0.0, "gone": 0.0}
        self._unknown_asked: dict = {}
        self.peer_scores = SimpleNamespace(check=lambda peer, now: None)

    async def refresh(self) -> None:  # the DHT holds no record of it
        pass


def test_a_member_that_left_the_view_is_answered_for_recent_ttls_and_a_stranger_never():
    from node.swarm.view import RECENT_TTLS

    view = _ViewAfterAMemberLeft()
    horizon = RECENT_TTLS * view.settings.ttl_s
    for t, gone_known in ((1.0, True), (horizon, True), (horizon + 0.1, False)):
        view.now = t
        assert asyncio.run(view.known("gone")) is gone_known, t
        assert asyncio.run(view.known("member")) and not asyncio.run(view.known("stranger"))
    view.blocked.add("member")  # a partition (the test hook) still cuts a member in the view
    assert asyncio.run(view.known("member")) is False
