"""A hostile admitted peer against a real node (issue 5): a replayed contribution, a x1000 update and a
stream of NaN updates are refused with their codes, the peer's score falls until it is banned, and then
even its valid work is refused and it leaves the node's view. Nothing it sends after its one honest
contribution changes the model."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from hivemind.utils import get_dht_time

from dht.identity import Identity
from dht.launch import start_dht
from dht.records import Member
from dht.swarm import Membership
from node.swarm.transport import Transport
from tests.swarm_util import Swarm, wait_until
from tests.test_wire_refusals import _contribution, _spec

pytestmark = pytest.mark.timeout(300)


def test_replay_scaled_and_nan_updates_are_refused_and_the_sender_banned(tmp_path):
    swarm = Swarm(tmp_path / "swarm")
    dht = None
    try:
        swarm.start_many(1, extra={0: ["--ban-after", "4", "--ban-s", "600"]})
        node = swarm.children[0]
        wait_until(lambda: swarm.status()[0]["fragments"][0]["round"] >= 2, 90, "fragment 0 merging")
        swarm.control(0, "pause")
        wait_until(lambda: swarm.status()[0]["learner"]["idle"], 30, "the learner to pause")
        time.sleep(1.5)
        spec = _spec()
        bad = Identity.generate()
        dht = start_dht(bad.save(tmp_path / "bad.key"), ["/ip4/127.0.0.1/tcp/0"], node.maddrs, timeout_s=30)
        now = get_dht_time()
        Membership(dht, "ddiloco-local", bad).publish(Member(bad.peer_id, (), "test", now, now + 300))

        def fragment0() -> dict:
            return swarm.status()[0]["fragments"][0]

        r0 = fragment0()["round"]
        honest = _contribution(bad, spec, base=r0)
        small = {n: torch.randn(s) * 1e-3 for n, s in spec[0].items()}

        async def call(payload: bytes):
            tr = Transport(await dht.replicate_p2p(), timeout_s=20)
            try:
                return await tr.call(node.peer_id, "contribute", payload)
            finally:
                await tr.p2p.shutdown()

        first = asyncio.run(call(honest))
        assert first.ok, first
        wait_until(lambda: fragment0()["round"] == r0 + 1, 30, "the honest contribution merged")
        h1 = swarm.status()[0]["model_hash"]
        # The same bytes again. The first copy is what an honest sender whose reply was lost sends: answered
        # as landed, not merged again, no strike. The second is a replay.
        resend = asyncio.run(call(honest))
        assert resend.ok and resend.code == "replayed", resend
        assert fragment0()["round"] == r0 + 1 and swarm.status()[0]["model_hash"] == h1
        replies = [asyncio.run(call(honest))]
        scaled = {n: t * 1000 * 1000 for n, t in small.items()}
        replies.append(asyncio.run(call(_contribution(bad, spec, base=r0 + 1, tensors=scaled))))
        nan = {n: torch.full(s, math.nan) for n, s in spec[0].items()}
        for _ in range(2):
            replies.append(
                asyncio.run(call(_contribution(bad, spec, base=r0 + 1, codec="fp32", tensors=nan)))
            )
        assert [r.code for r in replies] == ["replayed", "too_large", "not_finite", "not_finite"]
        # four strikes: banned; now even a valid contribution is refused before it is decoded
        after_ban = asyncio.run(call(_contribution(bad, spec, base=r0 + 1, tensors=small)))
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
