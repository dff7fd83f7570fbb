"""Bad input on the wire against a real node process: each bad message is refused with its
code and a log line, counted in the node's status, and leaves the node's model untouched."""

from __future__ import annotations

import asyncio
import json
import math
import struct
import time

import pytest
import torch

from dht.identity import Identity
from dht.launch import start_dht
from dht.records import Member
from dht.swarm import Membership
from node.learner.learner import plan_for
from node.learner.model import ModelConfig
from node.learner.task import TaskConfig, load_task
from node.swarm.frames import GO, read_frame
from node.swarm.transport import PROTOCOL_NAME, Transport
from node.swarm.wire import encode_record, pack_list, sign_contribution
from protocol.codecs import encode_tensors
from protocol.config import ProtocolConfig
from protocol.messages import ContributionHeader, encode_contribution
from protocol.replica import MergeRecord
from tests.swarm_util import Swarm, wait_until

pytestmark = pytest.mark.timeout(300)


def _spec():
    task = load_task(None, TaskConfig(batch_size=8, eval_batches=4, model=ModelConfig(32, 2, 2, 32)))
    model = task.new_model()
    plan = plan_for(task, model, ProtocolConfig(fragments=4, sync_every=8))
    shapes = dict(model.named_parameters())
    return {f.index: {n: tuple(shapes[n].shape) for n in f.names} for f in plan.fragments}


def _contribution(me, spec: dict, p: int = 0, base: int = 1, codec: str = "int4", swarm: str = "ddiloco-local",
                  **over) -> bytes:  # fmt: skip
    """A contribute request from ``me`` (an Identity signs it; a peer id string sends it unsigned)."""
    ident = me if isinstance(me, Identity) else None
    me = me.peer_id if ident is not None else me
    tensors = {n: torch.randn(s) * 1e-3 for n, s in spec[p].items()}
    if "tensors" in over:
        tensors = over.pop("tensors")
    h = dict(learner=me, fragment=p, base_round=base, c_steps=8, c_tokens=2048, step_time_s=0.1, codec=codec,
             block=64, cid=f"test:{time.monotonic_ns()}")  # fmt: skip
    h.update(over)
    raw = encode_contribution(ContributionHeader(**h), encode_tensors(tensors, codec, 64))
    sig = sign_contribution(swarm, ident, raw) if ident is not None else b""
    return pack_list([json.dumps({"dead": []}).encode(), raw, sig])


async def _oversized(p2p, peer_id) -> dict:
    from hivemind.p2p import PeerID

    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), PROTOCOL_NAME)
    try:
        raw = json.dumps({"op": "contribute", "nbytes": 1 << 40}).encode()
        writer.write(struct.pack("<I", len(raw)) + raw)
        await writer.drain()
        assert await reader.readexactly(1) != GO  # refused before a byte of the body is sent
        header, _ = await read_frame(reader, 1 << 20)
        return header
    finally:
        writer.close()


@pytest.mark.slow
def test_each_bad_message_is_refused_counted_and_changes_nothing(tmp_path):
    swarm = Swarm(tmp_path / "swarm")
    dhts = []
    try:
        swarm.start_many(1, extra={0: ["--history", "4"]})
        node = swarm.children[0]
        wait_until(lambda: swarm.status()[0]["fragments"][0]["round"] >= 8, 90, "fragment 0 past its history")
        swarm.control(0, "pause")
        wait_until(lambda: swarm.status()[0]["learner"]["idle"], 30, "the learner to pause")
        time.sleep(2.0)  # last merges land
        before = swarm.status()[0]
        spec = _spec()

        member_id = Identity.generate()
        outsider_id = Identity.generate()
        for i, ident in enumerate((member_id, outsider_id)):
            path = ident.save(tmp_path / f"id{i}.key")
            dhts.append(start_dht(path, ["/ip4/127.0.0.1/tcp/0"], node.maddrs, timeout_s=30))
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        Membership(dhts[0], "ddiloco-local", member_id).publish(
            Member(member_id.peer_id, (), "test", now, now + 120)
        )
        me = member_id  # signs its contributions
        r0 = before["fragments"][0]["round"]
        nan = {n: torch.full(s, math.nan) for n, s in spec[0].items()}
        wrong = {n: torch.zeros(s[0] + 1, *s[1:]) for n, s in spec[0].items()}
        good_rec = MergeRecord(0, r0 + 1, "0" * 64, "1" * 64, (("x", "c", 1.0, 1, 1),),
                               {n: torch.zeros(s) for n, s in spec[0].items()})  # fmt: skip
        forged = encode_record("ddiloco-local", good_rec, outsider_id)  # signed by a non-member
        tampered = bytearray(encode_record("ddiloco-local", good_rec, member_id))
        key = b'round\\":'  # inside the safetensors header the record JSON is an escaped string
        i = tampered.find(key) + len(key)
        assert i > len(key)
        tampered[i] = ord("9") if tampered[i] != ord("9") else ord("8")  # alter the signed round

        cases = [
            ("malformed", "contribute", b"\x00garbage"),
            ("wrong_shape", "contribute", _contribution(me, spec, tensors=wrong)),
            ("wrong_shape", "contribute", _contribution(me, {0: {"nope": (4,)}})),
            ("not_finite", "contribute", _contribution(me, spec, codec="fp32", tensors=nan)),
            ("stale_base", "contribute", _contribution(me, spec, base=0)),
            ("future_base", "contribute", _contribution(me, spec, base=r0 + 5)),
            ("bad_counters", "contribute", _contribution(me, spec, base=r0, c_steps=0)),
            ("wrong_fragment", "contribute", _contribution(me, spec, p=0, fragment=99)),
            ("unknown_peer", "contribute", _contribution(outsider_id.peer_id, spec, base=r0)),
            ("bad_signature", "contribute", _contribution(member_id.peer_id, spec, base=r0)),  # unsigned
            ("bad_signature", "contribute", _contribution(member_id, spec, base=r0, swarm="another-swarm")),
            ("wrong_parent", "record", encode_record("ddiloco-local", good_rec, member_id)),
            ("unknown_peer", "record", forged),
            ("bad_signature", "record", bytes(tampered)),
            ("unknown_op", "no-such-op", b""),
        ]

        async def run():
            tr = Transport(await dhts[0].replicate_p2p(), timeout_s=20)
            out = [await _oversized(tr.p2p, node.peer_id)]
            try:
                for _, op, payload in cases:
                    out.append(await tr.call(node.peer_id, op, payload))
                # the outsider itself: not a member, so nothing it sends is taken
                tr2 = Transport(await dhts[1].replicate_p2p(), timeout_s=20)
                out.append(await tr2.call(node.peer_id, "contribute", _contribution(outsider_id.peer_id, spec,
                                                                                     base=r0)))  # fmt: skip
                out.append(await tr2.call(node.peer_id, "snapshot", b'{"fragments": [0]}'))
                await tr2.p2p.shutdown()
            finally:
                await tr.p2p.shutdown()
            return out

        replies = asyncio.run(run())
        assert replies[0]["code"] == "too_large" and not replies[0]["ok"]
        for (code, op, _), reply in zip(cases, replies[1:]):
            assert not reply.ok and reply.code == code, (op, code, reply)
        assert [r.code for r in replies[-2:]] == ["unknown_peer", "unknown_peer"]

        time.sleep(1.0)
        after = swarm.status()[0]
        assert after["model_hash"] == before["model_hash"]
        assert after["rounds_merged"] == before["rounds_merged"]
        want: dict[str, int] = {"too_large": 1, "unknown_peer": 2}
        for code, _, _ in cases:
            want[code] = want.get(code, 0) + 1
        for code, n in want.items():
            got = after["refused"].get(code, 0) - before["refused"].get(code, 0)
            assert got >= n, (code, got, after["refused"])
        log = (node.state_dir / "node.log").read_text()
        for code in want:
            assert f"refused {code}" in log, code
    finally:
        swarm.stop()
        for d in dhts:
            d.shutdown()
