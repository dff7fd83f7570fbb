"""The baseline systems on real nodes (``--system sync-diloco``): the same core with every live learner as
the quorum, one fragment, and learners that wait after contributing until the merge is back."""

from __future__ import annotations

import pytest

from node.swarm.settings import NodeSettings
from protocol.errors import ConfigError
from tests.swarm_util import TINY, Swarm, wait_until

pytestmark = pytest.mark.timeout(300)


def test_a_node_refuses_a_system_it_cannot_run():
    with pytest.raises(ConfigError, match="system='dp' is invalid"):
        NodeSettings(system="dp")


@pytest.mark.slow
def test_sync_diloco_nodes_wait_for_every_merge_and_merge_everyone(tmp_path):
    swarm = Swarm(tmp_path / "swarm", TINY + ["--system", "sync-diloco"])
    try:
        swarm.start_many(2)
        ids = {i: c.peer_id for i, c in swarm.children.items()}

        def merged_together() -> int:
            return sum(
                set(e["learners"]) == set(ids.values()) for e in swarm.events(0) if e["kind"] == "merge"
            )

        try:
            wait_until(lambda: merged_together() >= 5, 150, "5 merges holding both learners' contributions")
        except AssertionError as e:  # what each node merged and holds, for whoever reads the failure
            seen = {
                i: [(m["round"], len(m["learners"])) for m in swarm.events(i) if m["kind"] == "merge"][-8:]
                for i in ids
            }
            st = {i: (s["fragments"][0], s["learner"]) for i, s in swarm.status().items()}
            raise AssertionError(f"{e}; merges (round, learners): {seen}; status: {st}") from e
        swarm.settle()
        events = {i: swarm.events(i) for i in ids}
    finally:
        swarm.stop()

    for i, ev in events.items():
        me = ids[i]
        steps = {e["step"]: e for e in ev if e["kind"] == "step" and e["learner"] == me}
        contribs = [e for e in ev if e["kind"] == "contribute" and e["learner"] == me]
        adopts = sorted(e["t"] for e in ev if e["kind"] == "adopt" and e["learner"] == me)
        blocks = [e for e in ev if e["kind"] == "block" and e["learner"] == me]
        assert len(contribs) >= 4 and blocks, f"node {i}: {len(contribs)} contributions, {len(blocks)} waits"
        assert all(c["fragment"] == 0 for c in contribs), "sync-diloco has one fragment"
        # The learner never starts the step after a contribution before the merged model is back.
        for c in contribs:
            nxt = steps.get(c["step"] + 1)
            if nxt is None:
                continue  # the last contribution before the pause
            assert any(c["t"] <= t <= nxt["t0"] for t in adopts), f"node {i} stepped past step {c['step']}"
    # Every live learner is the quorum: once both are training, every merge holds both contributions.
    merges = [e for e in events[0] if e["kind"] == "merge"]
    both = [m for m in merges if set(m["learners"]) == set(ids.values())]
    assert len(both) >= 4
    first_both = merges.index(both[0])
    assert all(set(m["learners"]) == set(ids.values()) for m in merges[first_both:])
