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
