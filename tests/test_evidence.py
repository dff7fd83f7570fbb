"""Issue 31, item 5: bans travel. A member signs a merge record that breaks a rule every node checks alike
(a contributor's weight that does not follow its counters) and pushes it to one node. That node bans it and
hands the signed record to the others, who check it themselves and ban it too, though the liar never sent
them anything. A member that hands over an honest record as "evidence" is refused and scored, and nobody is
banned for it. Real node processes; the attacker has its own identity, DHT and p2p daemon (``Attacker``)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from node.swarm.wire import encode_record, unpack_list
from protocol.merge import contribution_weight
from protocol.replica import MergeRecord
from tests.swarm_util import Swarm, wait_until
from tests.test_hostile_state import SWARM, hostile_swarm
from tests.test_wire_refusals import _spec


def _bans(swarm: Swarm, i: int, peer: str) -> list[dict]:
    return [e for e in swarm.events(i) if e["kind"] == "ban" and e["peer"] == peer]


@pytest.mark.slow
def test_a_signed_lie_pushed_to_one_node_gets_its_signer_banned_by_all_and_false_evidence_is_refused(
    tmp_path,
):
    with hostile_swarm(tmp_path, 3, 2) as (swarm, bad):
        bad.publish()
        bad.run(bad.tr.start())
        time.sleep(2.0)  # the nodes' views take in its record
        peers = {i: c.peer_id for i, c in swarm.children.items()}
        # false evidence: an honest record of node 0's, handed to node 1 as if it proved a lie
        honest = b""
        for _ in range(20):
            r = swarm.status()[0]["fragments"][0]["round"]
            reply = bad.call(peers[0], "records", json.dumps({"fragment": 0, "from": r}).encode())
            got = unpack_list(reply.body) if reply.ok else []
            if got:
                honest = bytes(got[0])
                break
            time.sleep(0.5)
        assert honest, "node 0's log held no record of its head"
        reply = bad.call(peers[1], "evidence", honest)
        assert (reply.ok, reply.code) == (False, "malformed"), reply
        wait_until(lambda: swarm.status()[1]["refused"].get("malformed", 0) >= 1, 10, "the refusal counted")
        # the lie: a record whose contributor weighs 100 times what its counters give, pushed to node 0 only
        spec = _spec()
        tiny = {n: torch.full(s, 1e-6) for n, s in spec[0].items()}
        own = ((bad.ident.peer_id, "bad:0:1", 100 * contribution_weight(2048, 8), 8, 2048),)
        lie = MergeRecord(0, 1, "0" * 64, "1" * 64, own, tiny)
        reply = bad.call(peers[0], "record", encode_record(SWARM, lie, bad.ident))
        assert (reply.ok, reply.code) == (False, "forged_record"), reply
        wait_until(lambda: all(_bans(swarm, i, bad.ident.peer_id) for i in range(3)), 30, "every node's ban")
        first = {i: _bans(swarm, i, bad.ident.peer_id)[0] for i in range(3)}
        assert first[0]["evidence"] == bad.ident.peer_id  # node 0 saw the lie itself
        for i in (1, 2):  # the others had it handed over by a member, not from the liar
            assert first[i]["evidence"] in (peers[0], peers[3 - i]), first[i]
        for i in range(3):
            assert not [e for j in range(3) for e in _bans(swarm, i, peers[j])], "an honest node was banned"
            assert swarm.status()[i]["counters"]["convictions"] == 1
        final = swarm.settle()
        assert len({s["model_hash"] for s in final.values()}) == 1
