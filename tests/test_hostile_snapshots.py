"""Issue 31, "a head a little ahead is trusted": a member publishes, for every fragment, a head one round past
the honest nodes' (inside the slack a claim needs no backing for) and serves an all-zero snapshot whose hash
matches its claim, with two signed records that lead to it from the honest chain's round before its head
(a fork, as an honest one looks). The nodes rebuild the state those records reach from their own history
and refuse the snapshot as ``forged_snapshot``, which scores the liar: no node takes it, nothing changes
while the learners are paused, and the swarm trains on to one hash.

The same member with no records at all, its head kept a round past the honest nodes' newest as they merge:
no chain reaches its head from any state an honest node holds, and no member whose work the nodes merged
publishes it (a second identity of the liar's, which publishes it and never contributes, does not count),
while the honest chain is published by the honest nodes: no node fetches it (``unwitnessed_snapshot``). Before that
rule every node that caught up from it did, and trained on from the all-zero model.
Real node processes; the attacker has its own identity, DHT and p2p daemon (``Attacker``)."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest
import torch
from hivemind.utils import get_dht_time

from dht.identity import Identity
from dht.launch import SwarmUnreachable
from dht.records import Member
from dht.swarm import Membership
from node.swarm.transport import Reply
from node.swarm.wire import (
    FragmentState,
    decode_record,
    encode_record,
    encode_snapshot,
    pack_list,
    unpack_list,
)
from protocol.hashing import tensors_hash
from protocol.merge import contribution_weight
from protocol.replica import MergeRecord
from tests.swarm_util import Swarm, assert_eval_held, wait_until
from tests.test_hostile_state import (
    SWARM,
    _paused_at_rest,
    every_fragment_merges,
    hostile_swarm,
)
from tests.test_wire_refusals import _spec


def _like(tensors: dict) -> dict:
    return {n: torch.zeros_like(t) for n, t in tensors.items()}


def _refused(swarm: Swarm, code: str) -> int:
    return sum(s["refused"].get(code, 0) for s in swarm.status().values())


@pytest.mark.slow
def test_a_member_a_round_ahead_serving_a_zero_snapshot_its_own_records_refute_is_refused(tmp_path):
    # 6 rounds: a node that started late took its first rounds by snapshot, and a fork from a round that near
    # the head has no chain to check it; after 2 rounds every fragment was such a one in a loaded CI run
    with hostile_swarm(tmp_path, 3, 6) as (swarm, bad):
        # Past the late joiners' downloads: "6 rounds" counts from node 0's start, and under CI load the
        # others joined by snapshot one round below the head at rest, so every fragment counted as late.
        every_fragment_merges(swarm, 2, "past the joiners' downloads")
        at_rest = _paused_at_rest(swarm, 3)
        bad.publish()
        spec = _spec()
        zeros = {p: {n: torch.zeros(s) for n, s in shapes.items()} for p, shapes in spec.items()}
        zero_hash = {p: tensors_hash(z) for p, z in zeros.items()}
        bad.run(bad.tr.start())
        time.sleep(2.0)  # the nodes' views take in its record: they serve records to members only
        # the honest head of each fragment (all nodes agree, at rest) and the parent of its last round
        head, parent = {}, {}
        for p in spec:
            r = at_rest[0]["fragments"][p]["round"]
            for c in swarm.children.values():
                reply = bad.call(c.peer_id, "records", json.dumps({"fragment": p, "from": r}).encode())
                recs = [decode_record(raw, SWARM, spec).record for raw in unpack_list(reply.body)]
                if reply.ok and recs and recs[0].round == r:
                    head[p], parent[p] = r, recs[0].parent_hash
                    break
        assert len(head) == len(spec), "no node's log held its head's record"
        # The fork must leave from a round every node still keeps: not one a node took by snapshot (its history
        # starts there). Fragments where a node re-synced at the head's round or the one before are left out:
        # no chain reaches them, so the refusal there is ``unwitnessed_snapshot`` (the test below), unscored.
        late = {
            e["fragment"]
            for i in range(3)
            for e in swarm.events(i)
            if e["kind"] == "resync" and e["round"] >= head[e["fragment"]] - 1
        }
        target = sorted(set(spec) - late)
        assert target, f"every fragment was re-synced near its head: {late}"
        forged: dict[int, list[bytes]] = {}

        async def snapshot(caller: str, raw: bytes) -> Reply:
            frags = json.loads(raw)["fragments"]
            states = [
                FragmentState(p, head[p] + 1, zero_hash[p], 3, 1e9, zeros[p], _like(zeros[p])) for p in frags
            ]
            return Reply(True, body=encode_snapshot(states))

        async def records(caller: str, raw: bytes) -> Reply:
            return Reply(True, body=pack_list(forged.get(json.loads(raw)["fragment"], [])))

        own = [(bad.ident.peer_id, "bad:0:1", contribution_weight(2048, 8), 8, 2048)]
        for p in target:
            shapes = spec[p]
            tiny = {n: torch.full(s, 1e-6) for n, s in shapes.items()}
            fake = tensors_hash({n: torch.full(s, 7.0) for n, s in shapes.items()})
            chain = [(head[p], parent[p], fake), (head[p] + 1, fake, zero_hash[p])]
            forged[p] = [
                encode_record(SWARM, MergeRecord(p, r, before, after, tuple(own), tiny), bad.ident)
                for r, before, after in chain
            ]
        bad.serve("snapshot", snapshot)
        bad.serve("records", records)
        bad.publish({str(p): [head[p] + 1, zero_hash[p], 3, 1e9] for p in target})
        wait_until(
            lambda: _refused(swarm, "forged_snapshot") >= 3 * len(target),
            60,
            "the nodes refusing the snapshots",
        )
        now = swarm.status()
        assert {s["model_hash"] for s in now.values()} == {at_rest[0]["model_hash"]}, "a node changed at rest"
        for i in range(3):
            taken = [e for e in swarm.events(i) if e["kind"] == "resync" and e["donor"] == bad.ident.peer_id]
            assert not taken, f"node {i} installed the liar's snapshot: {taken}"
        assert bad.calls.get("snapshot", 0) >= 3 * len(target), bad.calls
        scores = [s["guard"]["scores"].get(bad.ident.peer_id, 0) for s in swarm.status().values()]
        assert sum(scores) <= -3, scores  # each refusal cost the donor a point of score
        for i in range(3):
            swarm.control(i, "resume")
        every_fragment_merges(swarm, 2, "after the liar's snapshots")
        final = swarm.settle()
        assert len({s["model_hash"] for s in final.values()}) == 1
        assert all(f["round"] > head[f["fragment"]] for s in final.values() for f in s["fragments"])
        assert_eval_held(swarm, bad.since)


def _copy(tensors: dict) -> dict:
    return {n: t.clone() for n, t in tensors.items()}


@pytest.mark.slow
def test_a_member_a_round_ahead_serving_a_zero_snapshot_is_not_installed(tmp_path):
    stop = threading.Event()
    with hostile_swarm(tmp_path, 3, 2) as (swarm, bad), contextlib.ExitStack() as done:
        done.callback(stop.set)  # the liar's thread stops however the test ends
        spec = _spec()
        zeros = {p: {n: torch.zeros(s) for n, s in shapes.items()} for p, shapes in spec.items()}
        zero_hash = {p: tensors_hash(z) for p, z in zeros.items()}
        claimed: dict[int, int] = {p: 0 for p in spec}

        async def snapshot(caller: str, raw: bytes) -> Reply:
            frags = json.loads(raw)["fragments"]
            states = [
                FragmentState(p, claimed[p], zero_hash[p], 3, 1e9, _copy(zeros[p]), _copy(zeros[p]))
                for p in frags
            ]
            return Reply(True, body=encode_snapshot(states))

        async def records(caller: str, raw: bytes) -> Reply:
            return Reply(True, body=pack_list([]))  # none to bridge to its head: a snapshot's needed

        bad.serve("snapshot", snapshot)
        bad.serve("records", records)
        bad.run(bad.tr.start())

        sybil = Identity.generate()  # a second identity of the liar's, publishing the same head: a witness

        def ahead() -> None:  # one round past the honest nodes' newest head, every second
            members = Membership(bad.dht, SWARM, bad.ident)
            sybils = Membership(bad.dht, SWARM, sybil)
            while not stop.wait(1.0):
                honest = [m for m in members.live()[0] if m.peer_id != bad.ident.peer_id]
                for p in spec:
                    claimed[p] = max((m.head_round(p) for m in honest), default=0) + 1
                heads = {str(p): [claimed[p], zero_hash[p], 3, 1e9] for p in spec}
                bad.publish(heads)
                now = get_dht_time()
                with contextlib.suppress(SwarmUnreachable):
                    sybils.publish(Member(sybil.peer_id, (), "ddiloco/0.3", now, now + 300, heads=heads))

        liar = threading.Thread(target=ahead, daemon=True)
        liar.start()
        refused = lambda: _refused(swarm, "unwitnessed_snapshot")  # noqa: E731
        # each looks for a chain to check the head first (a node more than ``history`` rounds behind cannot,
        # and under a loaded suite's weather the first refusals were all such: wait for both)
        wait_until(
            lambda: refused() >= 3 and bad.calls.get("records", 0) >= 3,
            120,
            "honest nodes refusing the liar's head, after asking it for records",
        )
        r0 = min(s["fragments"][0]["round"] for s in swarm.status().values())
        wait_until(
            lambda: all(s["fragments"][0]["round"] >= r0 + 4 for s in swarm.status().values()),
            120,
            "rounds merging beside the liar",
        )
        for i in range(3):
            taken = [e for e in swarm.events(i) if e["kind"] == "resync" and e["donor"] == bad.ident.peer_id]
            assert not taken, f"node {i} installed the liar's zero snapshot: {taken}"
        assert bad.calls.get("snapshot", 0) == 0, bad.calls  # refused before a byte of it was fetched
        stop.set()
        liar.join(10)
        final = swarm.settle()
        assert len({s["model_hash"] for s in final.values()}) == 1
        assert all(s["model_hash"] not in zero_hash.values() for s in final.values())
        assert_eval_held(swarm, bad.since)
