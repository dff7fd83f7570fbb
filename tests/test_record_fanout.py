"""Whom a new record is pushed to (``RecordPush._record_targets``): every reachable member of a small swarm;
in a large one its contributors, the fragment's next candidates and a bounded sample of the rest."""

from __future__ import annotations

import time
from types import SimpleNamespace

from node.swarm.push import RECORD_FANOUT
from node.swarm.replication import Replication


class _Node(Replication):
    def __init__(self, n: int, client: set[str] = frozenset()) -> None:
        self.peer_id = "me"
        self.members = {f"p{i:04d}": SimpleNamespace(client_mode=f"p{i:04d}" in client) for i in range(n)}
        self.suspect: dict[str, float] = {}

    def live_members(self):
        return {**self.members, "me": SimpleNamespace(client_mode=False)}

    def candidates(self, p: int, dead=()):
        return ["me", "p0007", "p0008", "p0009", "p0010", "p0011", "p0012"]


def _record(*learners: str):
    return SimpleNamespace(
        record=SimpleNamespace(contributors=tuple((pid, "cid", 1.0, 8, 64) for pid in learners))
    )


def test_a_small_swarm_gets_every_record():
    node = _Node(RECORD_FANOUT, client={"p0003"})
    assert node._record_targets(0, _record("p0001")) == sorted(set(node.members) - {"p0003"})


def test_a_large_swarm_gets_contributors_candidates_and_a_bounded_sample():
    node = _Node(2000, client={"p0100"})
    node.suspect = {f"p{i:04d}": time.monotonic() + 60 for i in range(20, 2000)}  # all but 20 under suspicion
    sr = _record("p0100", "p0001", "p0002", "p0003", "p1500")
    got = node._record_targets(0, sr)
    assert len(got) == len(set(got)) == RECORD_FANOUT
    assert {"p0001", "p0002", "p0003", "p1500"} <= set(got)  # contributors, suspect or not
    assert {"p0007", "p0008", "p0009", "p0010"} <= set(
        got
    ) and "me" not in got  # the next candidates, not itself
    assert "p0100" not in got  # client mode: takes no inbound call
    rest = set(got) - {"p0001", "p0002", "p0003", "p1500", "p0007", "p0008", "p0009", "p0010"}
    assert rest and all(int(pid[1:]) < 20 for pid in rest)  # the sample avoids peers under suspicion
    many = _record(*(f"p{i:04d}" for i in range(200, 400)))  # a merge of 200 learners: each gets it
    assert len(node._record_targets(0, many)) == 200 + 4
