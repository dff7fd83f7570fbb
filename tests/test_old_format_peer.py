"""A node of this commit and a peer that speaks only stored bytes (``tests/golden``: what the commit before
wrote, ``tests/test_golden_wire.py``). The peer is a member of the swarm with the golden learner's key and a
DHT of its own; it sends the stored ``contribute`` request, then the stored ``records`` and ``snapshot``
requests. The node takes the contribution with a receipt the peer reads, merges it into fragment 0's next
round, and answers both requests with replies the peer decodes: two neighbouring commits interoperate over
the wire, not only in a decoder's unit test."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.utils import get_dht_time

from dht.launch import start_dht
from dht.records import Member
from dht.swarm import Membership
from node.swarm.transport import Transport
from node.swarm.trust.receipts import read_receipt
from node.swarm.wire import decode_record, decode_snapshot, unpack_list
from tests.swarm_util import Swarm, wait_until
from tests.test_golden_wire import GOLDEN, LEARNER, PEER_CID, PEER_SWARM
from tests.test_wire_refusals import _spec

pytestmark = pytest.mark.timeout(300)


def calls(dht, node: str, requests: list[tuple[str, bytes]]):
    """Each (op, stored body) in turn from the peer's DHT's p2p daemon; their replies."""

    async def run():
        tr = Transport(await dht.replicate_p2p(), timeout_s=20)
        try:
            return [await tr.call(node, op, body) for op, body in requests]
        finally:
            await tr.p2p.shutdown()

    return asyncio.run(run())


@pytest.mark.slow
def test_a_node_takes_an_old_format_peers_stored_contribution_and_answers_its_stored_requests(tmp_path):
    swarm = Swarm(tmp_path / "swarm")
    dht = None
    try:
        swarm.start_many(1)
        node = swarm.children[0]
        swarm.control(0, "pause")  # its own learner sends nothing more: the round merges the peer's message
        wait_until(lambda: swarm.status()[0]["learner"]["idle"], 30, "the learner to pause")
        r0 = swarm.status()[0]["fragments"][0]["round"]
        assert r0 < 4, r0  # the stored message is on round 0: kept (history 4) and re-anchored up to round 4
        # the peer: the golden learner's key, a DHT of its own, a membership record in client mode (never a
        # candidate, so this node is the synchroniser of every fragment)
        dht = start_dht(str(GOLDEN / "learner.key"), ["/ip4/127.0.0.1/tcp/0"], node.maddrs, timeout_s=30)
        now = get_dht_time()
        member = Member(LEARNER.peer_id, (), "test", now, now + 300, client_mode=True)
        Membership(dht, PEER_SWARM, LEARNER).publish(member)
        (took,) = calls(dht, node.peer_id, [("contribute", (GOLDEN / "peer_contribute.bin").read_bytes())])
        assert took.ok and took.code == "ok", took
        receipt = read_receipt(PEER_SWARM, node.peer_id, took.body)  # a public swarm's synchroniser signs one
        assert (receipt.learner, receipt.cid, receipt.fragment) == (LEARNER.peer_id, PEER_CID, 0)

        def merged() -> list[dict]:
            return [e for e in swarm.events(0) if e["kind"] == "merge" and PEER_CID in e["cids"]]

        wait_until(lambda: merged(), 60, "the stored contribution merged")
        (rec,) = merged()
        assert rec["fragment"] == 0 and rec["round"] == receipt.round and rec["learners"] == [LEARNER.peer_id]
        spec = _spec()
        records, snapshot = calls(
            dht,
            node.peer_id,
            [("records", (GOLDEN / "records_request.json").read_bytes()),  # fragment 0 from round 3
             ("snapshot", (GOLDEN / "snapshot_request.json").read_bytes())],  # fragments 0 and 1
        )  # fmt: skip
        assert records.ok and snapshot.ok, (records, snapshot)
        served = [decode_record(raw, PEER_SWARM, spec) for raw in unpack_list(records.body)]
        assert [sr.record.round for sr in served] == [r for r in range(3, rec["round"] + 1)]
        assert all(sr.signer == node.peer_id for sr in served)
        states = decode_snapshot(snapshot.body, spec)
        fragments = {f["fragment"]: f for f in swarm.status()[0]["fragments"]}
        assert [s.fragment for s in states] == [0, 1]
        for s in states:  # the node's own state of each fragment, as its status shows it (hash: a prefix)
            shown = fragments[s.fragment]
            assert s.round == shown["round"] and s.hash.startswith(shown["hash"]), (s.round, s.hash, shown)
        assert PEER_CID in states[0].merged  # its replay memory, handed on with the snapshot
    finally:
        swarm.stop()
        if dht is not None:
            dht.shutdown()
