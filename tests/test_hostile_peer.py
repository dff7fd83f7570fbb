"""A hostile admitted peer against a real node: a replayed contribution, a x1000 update and a
stream of NaN updates are refused with their codes, the peer's score falls until it is banned, and then
even its valid work is refused and it leaves the node's view. Nothing it sends after its one honest
contribution changes the model."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hivemind.utils import get_dht_time

from dht.identity import Identity
from dht.launch import start_dht
from dht.records import Member
from dht.swarm import Membership
from node.local.launcher import wait_ready
from node.swarm.wire import unpack_signed_contribution
from protocol.messages import decode_contribution
from tests.swarm_util import Swarm, wait_until
from tests.test_old_format_peer import calls
from tests.test_wire_refusals import _contribution, _spec

pytestmark = pytest.mark.timeout(300)


def _one_paused_node_and_a_member(swarm: Swarm, tmp_path, ban_after: str):
    """Node 0 alone, merging then paused, and a member of the swarm of our own (its Identity and DHT)."""
    swarm.start_many(1, extra={0: ["--ban-after", ban_after, "--ban-s", "600"]})
    node = swarm.children[0]
    wait_until(lambda: swarm.status()[0]["fragments"][0]["round"] >= 2, 90, "fragment 0 merging")
    swarm.control(0, "pause")
    wait_until(lambda: swarm.status()[0]["learner"]["idle"], 30, "the learner to pause")
    time.sleep(1.5)
    bad = Identity.generate()
    dht = start_dht(bad.save(tmp_path / "bad.key"), ["/ip4/127.0.0.1/tcp/0"], node.maddrs, timeout_s=30)
    now = get_dht_time()
    Membership(dht, "ddiloco-local", bad).publish(Member(bad.peer_id, (), "test", now, now + 300))
    return node, bad, dht


def _contribute(dht, peer: str, payload: bytes):
    """One ``contribute`` call from the member's DHT's p2p daemon."""
    return calls(dht, peer, [("contribute", payload)])[0]


@pytest.mark.slow
def test_replay_scaled_and_nan_updates_are_refused_and_the_sender_banned(tmp_path):
    swarm = Swarm(tmp_path / "swarm")
    dht = None
    try:
        node, bad, dht = _one_paused_node_and_a_member(swarm, tmp_path, "4")
        spec = _spec()

        def fragment0() -> dict:
            return swarm.status()[0]["fragments"][0]

        r0 = fragment0()["round"]
        honest = _contribution(bad, spec, base=r0)
        small = {n: torch.randn(s) * 1e-3 for n, s in spec[0].items()}

        def call(payload: bytes):
            return _contribute(dht, node.peer_id, payload)

        first = call(honest)
        assert first.ok, first
        wait_until(lambda: fragment0()["round"] == r0 + 1, 30, "the honest contribution merged")
        h1 = swarm.status()[0]["model_hash"]
        # The same bytes again. The first copy is what an honest sender whose reply was lost sends: answered
        # as landed, not merged again, no strike. The second is a replay.
        resend = call(honest)
        assert resend.ok and resend.code == "replayed", resend
        assert fragment0()["round"] == r0 + 1 and swarm.status()[0]["model_hash"] == h1
        replies = [call(honest)]
        scaled = {n: t * 1000 * 1000 for n, t in small.items()}
        replies.append(call(_contribution(bad, spec, base=r0 + 1, tensors=scaled)))
        nan = {n: torch.full(s, math.nan) for n, s in spec[0].items()}
        for _ in range(2):
            replies.append(call(_contribution(bad, spec, base=r0 + 1, codec="fp32", tensors=nan)))
        assert [r.code for r in replies] == ["replayed", "too_large", "not_finite", "not_finite"]
        # four strikes: banned; now even a valid contribution is refused before it is decoded
        after_ban = call(_contribution(bad, spec, base=r0 + 1, tensors=small))
        assert not after_ban.ok and after_ban.code == "banned"
        st = swarm.status()[0]
        assert bad.peer_id in st["guard"]["banned"] and st["guard"]["bans"] == 1
        assert bad.peer_id not in {p["peer_id"] for p in st["peers"]}
        assert st["model_hash"] == h1 and st["fragments"][0]["round"] == r0 + 1
        for code in ("replayed", "too_large", "not_finite", "banned"):
            assert st["refused"].get(code, 0) >= 1, (code, st["refused"])
        assert any(e["kind"] == "ban" and e["peer"] == bad.peer_id for e in swarm.events(0))
    finally:
        swarm.stop()
        if dht is not None:
            dht.shutdown()


@pytest.mark.slow
def test_a_node_that_took_a_fragment_by_snapshot_still_refuses_replays_of_what_it_merged(tmp_path):
    """Issue 31, replay memory after a re-sync: a node that joined by downloading fragment 0 never applied
    the record that merged a contribution; once the node that merged it has left, the attacker sends that
    contribution to the newcomer again. The snapshot named the merged id: the first copy is answered as
    landed (what an honest sender whose reply was lost sends), later copies are refused as replays, and the
    newcomer merges nothing of it."""
    swarm = Swarm(tmp_path / "swarm")
    dht = None
    try:
        a, bad, dht = _one_paused_node_and_a_member(swarm, tmp_path, "100")
        spec = _spec()
        r0 = swarm.status()[0]["fragments"][0]["round"]
        honest = _contribution(bad, spec, base=r0)
        assert _contribute(dht, a.peer_id, honest).ok
        wait_until(
            lambda: swarm.status()[0]["fragments"][0]["round"] == r0 + 1, 30, "the contribution merged"
        )
        # The attacker's membership backs the node's heads (a round below them), or the newcomer would not
        # believe the one node it sees: a lone member far ahead.
        heads = {
            str(f["fragment"]): [f["round"] - 1, "0" * 64, 1, 1.0] for f in swarm.status()[0]["fragments"]
        }
        now = get_dht_time()
        Membership(dht, "ddiloco-local", bad).publish(
            Member(bad.peer_id, (), "test", now, now + 300, heads=heads)
        )
        # the newcomer's first step ends after this test (a pause does not cut a step short): it sends nothing
        b = swarm.start(1, ["--step-delay-s", "60"])
        wait_ready([b], 120)
        swarm.control(1, "pause")
        frag = swarm.status()[1]["fragments"][0]
        assert frag["round"] == r0 + 1 and frag["hash"] == swarm.status()[0]["fragments"][0]["hash"]
        assert not any(e["kind"] == "merge" for e in swarm.events(1)), "it took the round by a record"
        # The node that merged it leaves (a dead-peer list naming it would not do: the newcomer pings it
        # first), and the member's record, not renewed, ages out of the newcomer's view: the newcomer is the
        # fragment's synchroniser. (Started in half a second, it once read that record still fresh, and named
        # the member the synchroniser.)
        swarm.control(0, "stop")
        a.proc.wait(60)
        alone = lambda: {p["peer_id"] for p in swarm.status()[1]["peers"]} == {b.peer_id}  # noqa: E731
        wait_until(alone, 30, "A and the member's record gone from the newcomer's view")
        replies = [_contribute(dht, b.peer_id, honest) for _ in range(3)]
        st = swarm.status()[1]
        assert [(r.ok, r.code) for r in replies] == [
            (True, "replayed"),
            (False, "replayed"),
            (False, "replayed"),
        ], (replies[0].message, st["fragments"][0], [p["peer_id"][-6:] for p in st["peers"]], b.peer_id[-6:])
        time.sleep(2.0)
        cid = decode_contribution(unpack_signed_contribution(honest)[1], spec[0])[0].cid
        again = [e for e in swarm.events(1) if e["kind"] == "merge" and cid in e["cids"]]
        assert not again, again
    finally:
        swarm.stop()
        if dht is not None:
            dht.shutdown()
