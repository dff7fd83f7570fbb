"""A node joining a running swarm puts its fragment schedule in phase with the peers' (node.swarm.view)."""

from types import SimpleNamespace

import pytest

from dht.records import Member
from dht.swarm import get_dht_time
from node.swarm.view import SwarmView


def _member(pid: str, step: int, age_s: float, rate: float) -> Member:
    now = get_dht_time()
    return Member(pid, (), "v", now - age_s, now + 5, step=step, steps_per_s=rate)


def test_swarm_step_extrapolates_each_peer_from_its_record_and_takes_the_furthest():
    node = SimpleNamespace(
        members={
            "a": _member("a", 100, age_s=2.0, rate=5.0),  # ~110 now
            "b": _member("b", 104, age_s=0.0, rate=5.0),  # 104 now
        }
    )
    assert SwarmView.swarm_step(node) == pytest.approx(110.0, abs=0.2)


def test_swarm_step_is_none_without_a_stepping_peer():
    assert SwarmView.swarm_step(SimpleNamespace(members={})) is None
    fresh = SimpleNamespace(members={"a": _member("a", 0, age_s=3.0, rate=0.0)})
    assert SwarmView.swarm_step(fresh) is None


def _loop(steps: int, first_step: int, swarm_step):
    from node.learner.loop import LearnerLoop
    from protocol.fragments import plan_fragments
    from protocol.schedule import SlotBook

    plan = plan_fragments({"a": 8, "b": 8, "c": 8, "d": 8}, 4, 4)
    learner = SimpleNamespace(plan=plan, steps=steps, book=SimpleNamespace(step=steps))
    node = SimpleNamespace(
        blocking=False,
        view=SimpleNamespace(swarm_step=lambda: swarm_step),
        clocks=SimpleNamespace(current=lambda: [None] * len(plan.fragments)),
    )
    loop = SimpleNamespace(learner=learner, node=node, _first_step=first_step, slots=SlotBook(), step_s=0.1)
    return lambda: LearnerLoop._due_after_step(loop)


def test_a_lifes_first_step_among_peers_takes_nothing_by_its_own_count():
    """A joining node's first step would send the fragment its own step count makes due, out of phase with
    its peers' (its schedule is aligned after that step): a round of its single step, merged alone,
    overwrote the peers' work on that fragment. Alone, or after its first step, it goes by its count."""
    due_at = [s for s in range(4) if _loop(s, s, None)()]
    assert due_at, "some fragment is due by the step count in the first four steps"
    s = due_at[0]
    assert _loop(s, s, swarm_step=None)()  # the swarm's first learner: nothing to align to
    assert _loop(s, s, swarm_step=37.4)() == []  # among peers: nothing from its first step
    assert _loop(s, s - 1, swarm_step=37.4)()  # a later step of the same life: by its count again
