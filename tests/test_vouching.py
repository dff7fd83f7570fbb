"""Issue 31, "a head a little ahead is trusted": a snapshot is installed only when other live members say,
each for itself, that they hold its state (``node.swarm.vouching``). Unit checks of the request and the
count, and a real attacker process against three real nodes."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from dht.swarm import Membership
from node.swarm.transport import Reply
from node.swarm.vouching import judge, parse_vouch_request
from node.swarm.wire import FragmentState, encode_snapshot
from protocol.errors import ProtocolError, RejectCode
from protocol.hashing import tensors_hash
from tests.swarm_util import Swarm, wait_until
from tests.test_hostile_state import SWARM, Attacker, _nodes_merging, _stop_the_liar_and_agree, _tear_down
from tests.test_wire_refusals import _spec

pytestmark = pytest.mark.timeout(400)


def test_a_vouch_request_is_a_fragment_and_a_round():
    assert parse_vouch_request(b'{"fragment": 2, "round": 7}', 4) == (2, 7)
    for raw, code in [
        (b"", RejectCode.MALFORMED),
        (b"[1, 2]", RejectCode.MALFORMED),
        (b'{"fragment": 1}', RejectCode.MALFORMED),
        (b'{"fragment": "1", "round": 3}', RejectCode.MALFORMED),
        (b'{"fragment": 1, "round": -1}', RejectCode.MALFORMED),
        (b'{"fragment": 1, "round": 2.0}', RejectCode.MALFORMED),
        (b'{"fragment": true, "round": 2}', RejectCode.MALFORMED),
        (b'{"fragment": 4, "round": 2}', RejectCode.WRONG_FRAGMENT),
    ]:
        with pytest.raises(ProtocolError) as e:
            parse_vouch_request(raw, 4)
        assert e.value.code is code, raw


def test_a_snapshot_needs_a_member_that_reached_its_round_and_no_better_backed_rival():
    me_behind = (None, 5)
    assert judge("h", 9, [], 0, me_behind) is None  # no other member to ask: the donor's word stands
    assert "answered" in judge("h", 9, [], 2, me_behind)  # others in the view, none answering: wait
    # a lone claim to lead: nobody else reached round 9 (the attack: one round past every honest head)
    assert "reached" in judge("h", 9, [(None, 8), (None, 8)], 2, me_behind)
    assert judge("h", 9, [("h", 9), (None, 8)], 2, me_behind) is None  # one other holds it
    assert judge("h", 9, [("h", 12), ("x", 10)], 2, me_behind) is None  # a split 2:1 (donor's side)
    assert "another state" in judge("h", 9, [("x", 9), ("x", 11)], 2, me_behind)  # 1:2, honest agree
    assert "another state" in judge("h", 9, [("x", 9)], 1, ("x", 9))  # this node holds the rival too
    assert judge("h", 9, [("x", 9), ("y", 9)], 2, ("z", 9)) is None  # a split every way: best head wins
    assert judge("h", 9, [(None, 30)], 1, me_behind) is None  # round 9 left its log: reached, no rival


def test_a_member_a_round_ahead_serving_a_zero_snapshot_is_not_installed(tmp_path):
    """Three honest nodes and a member that publishes, every second, heads one round past the honest nodes'
    newest, with the hash of an all-zero state, serves that state as its snapshot (hash-consistent) and no
    records. Its head is inside the slack a claim needs no backing for, so every node tries to catch up
    from it; the other honest members answer that they do not hold that state, and nothing is installed.
    (Before the vouch, every node installed the zeros: eval went to the all-zero model's 5.545.)"""
    swarm = Swarm(tmp_path / "swarm")
    bad = None
    stop = threading.Event()
    try:
        _nodes_merging(swarm, 3, 2)
        bad = Attacker(tmp_path, swarm.children[0].maddrs)
        spec = _spec()
        zeros = {p: {n: torch.zeros(s) for n, s in shapes.items()} for p, shapes in spec.items()}
        zero_hash = {p: tensors_hash(z) for p, z in zeros.items()}
        claimed = dict.fromkeys(spec, 1)

        async def snapshot(caller: str, raw: bytes) -> Reply:
            frags = json.loads(raw)["fragments"]
            states = [
                FragmentState(
                    p, claimed[p], zero_hash[p], 3, 1e9, zeros[p], {n: t.clone() for n, t in zeros[p].items()}
                )
                for p in frags
            ]
            return Reply(True, body=encode_snapshot(states))

        async def records(caller: str, raw: bytes) -> Reply:
            return Reply(True, body=b"")

        bad.serve("snapshot", snapshot)
        bad.serve("records", records)
        bad.run(bad.tr.start())

        def ahead() -> None:
            members = Membership(bad.dht, SWARM, bad.ident)
            while not stop.wait(1.0):
                honest = [m for m in members.live()[0] if m.peer_id != bad.ident.peer_id]
                for p in spec:
                    claimed[p] = max((m.head_round(p) for m in honest), default=0) + 1
                bad.publish({str(p): [claimed[p], zero_hash[p], 3, 1e9] for p in spec})

        liar = threading.Thread(target=ahead, daemon=True)
        liar.start()
        wait_until(lambda: bad.calls.get("snapshot", 0) >= 3, 120, "nodes asking the liar for its state")
        r0 = min(s["fragments"][0]["round"] for s in swarm.status().values())
        wait_until(
            lambda: all(s["fragments"][0]["round"] >= r0 + 3 for s in swarm.status().values()),
            120,
            "rounds merging beside the liar",
        )
        now = swarm.status()
        for i in range(3):
            taken = [e for e in swarm.events(i) if e["kind"] == "resync" and e["donor"] == bad.ident.peer_id]
            assert not taken, f"node {i} installed the liar's zero state: {taken}"
        assert sum(s["refused"].get("unvouched", 0) for s in now.values()) >= 1, [
            s["refused"] for s in now.values()
        ]
        _stop_the_liar_and_agree(swarm, stop, liar)
        held = {f["hash"] for s in swarm.status().values() for f in s["fragments"]}
        assert not held & {h[:16] for h in zero_hash.values()}, "a fragment holds the zero state"
    finally:
        _tear_down(swarm, stop, bad)
