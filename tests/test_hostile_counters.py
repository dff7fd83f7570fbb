"""Issue 31, contribution weight without a bound: a member that claims more work than the swarm can see it
do (``protocol.work``), against three real node processes. Its contributions are refused as
``bad_counters`` by the synchroniser it sends them to, each refusal costs it a point of score, and ten get
it banned there; none of its contributions is merged anywhere, no honest one is refused, and the honest
nodes end on one hash."""

from __future__ import annotations

import statistics
import time

import pytest

from dht.swarm import Membership
from tests.swarm_util import Swarm, assert_eval_held, wait_until
from tests.test_hostile_state import SWARM, Attacker, _nodes_merging, every_fragment_merges
from tests.test_wire_refusals import _contribution, _spec

pytestmark = pytest.mark.timeout(400)


@pytest.mark.slow
def test_a_member_claiming_more_work_than_it_could_do_is_refused_then_banned(tmp_path):
    swarm = Swarm(tmp_path / "swarm")
    bad = None
    try:
        _nodes_merging(swarm, 3, 2)
        bad = Attacker(tmp_path, swarm.children[0].maddrs)
        bad.publish()
        members = Membership(bad.dht, SWARM, bad.ident)
        rated = lambda: [m for m in members.live()[0] if m.tokens_per_s > 0 and m.steps_per_s > 0]  # noqa: E731
        wait_until(lambda: len(rated()) >= 3, 90, "three members publishing their rates")
        per_step = statistics.median(m.tokens_per_s / m.steps_per_s for m in rated())
        time.sleep(2.0)  # the nodes' views take in the attacker's record
        peers = {c.peer_id: i for i, c in swarm.children.items()}
        spec, codes, why = _spec(), {i: [] for i in range(3)}, []
        deadline = time.monotonic() + 120
        # alternately: the 1e9 tokens in one step, and a million steps at the honest tokens a step
        while not any("banned" in c for c in codes.values()):
            assert time.monotonic() < deadline, codes
            st = swarm.status()[0]
            p = next(
                (f["fragment"] for f in st["fragments"] if peers.get(f["synchroniser"]) == 0),
                st["fragments"][0]["fragment"],
            )
            who = st["fragments"][p]["synchroniser"]
            steps, tokens = (1, 10**9) if len(why) % 2 == 0 else (10**6, int(10**6 * per_step))
            base = st["fragments"][p]["round"]
            payload = _contribution(bad.ident, spec, p=p, base=base, c_steps=steps, c_tokens=tokens)
            r = bad.call(who, "contribute", payload)
            codes[peers[who]].append(r.code)
            if r.code == "bad_counters":
                why.append(r.message)
        # refused, and what for: each bound was met; the ban came after ten such refusals at one node
        assert any("tokens a step" in w for w in why) and any("steps in" in w for w in why), why
        banned_at = next(i for i, c in codes.items() if "banned" in c)
        assert codes[banned_at].count("bad_counters") >= 10, codes
        assert set(c for cs in codes.values() for c in cs) <= {"bad_counters", "not_synchroniser", "banned"}
        every_fragment_merges(swarm, 2, "after the attack")
        final = swarm.settle()
        assert len({s["model_hash"] for s in final.values()}) == 1
        assert_eval_held(swarm, bad.since)
        for i in range(3):
            events = swarm.events(i)
            merged = {lrn for e in events if e["kind"] == "merge" for lrn in e["learners"]}
            assert bad.ident.peer_id not in merged
            honest_refused = [
                e
                for e in events
                if e["kind"] == "reject" and e["code"] == "bad_counters" and e["peer"] in peers
            ]
            assert not honest_refused, honest_refused
    finally:
        swarm.stop()
        if bad is not None:
            bad.close()
