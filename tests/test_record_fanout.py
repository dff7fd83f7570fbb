"""Whom a new record is pushed to (``RecordPush.targets``): every reachable member of a small swarm; in a
large one its contributors, the fragment's next candidates and a bounded sample of the rest."""

from __future__ import annotations

import time
from types import SimpleNamespace

from node.swarm.record_push import RECORD_FANOUT, RecordPush
from node.swarm.trust.work_book import WorkBook
from node.swarm.view import SwarmView


class _Node:
    """What a record push reads of its node's membership view: the live members (some in client mode), the
    next candidates, the suspicions."""

    workers = SwarmView.workers  # read only in a public swarm (``_Public``)

    def __init__(self, n: int, client: set[str] = frozenset()) -> None:
        self.peer_id = "me"
        self.members = {f"p{i:04d}": SimpleNamespace(client_mode=f"p{i:04d}" in client) for i in range(n)}
        self.suspect: dict[str, float] = {}
        self.settings = SimpleNamespace(elect_workers=False)

    def live_members(self):
        return {**self.members, "me": SimpleNamespace(client_mode=False)}

    def candidates(self, p: int, dead=()):
        return ["me", "p0007", "p0008", "p0009", "p0010", "p0011", "p0012"]

    def record_push(self) -> RecordPush:
        """The push as the node wires it (no transport: only its targets are asked here)."""
        return RecordPush(
            None,
            self.settings,
            self.peer_id,
            self.suspect,
            self.live_members,
            self.workers,
            self.candidates,
            time.monotonic,
        )


def _record(*learners: str):
    return SimpleNamespace(
        record=SimpleNamespace(contributors=tuple((pid, "cid", 1.0, 8, 64) for pid in learners))
    )


def test_a_small_swarm_gets_every_record():
    node = _Node(RECORD_FANOUT, client={"p0003"})
    assert node.record_push().targets(0, _record("p0001")) == sorted(set(node.members) - {"p0003"})


def test_a_large_swarm_gets_contributors_candidates_and_a_bounded_sample():
    node = _Node(2000, client={"p0100"})
    node.suspect = {f"p{i:04d}": time.monotonic() + 60 for i in range(20, 2000)}  # all but 20 under suspicion
    sr = _record("p0100", "p0001", "p0002", "p0003", "p1500")
    got = node.record_push().targets(0, sr)
    assert len(got) == len(set(got)) == RECORD_FANOUT
    assert {"p0001", "p0002", "p0003", "p1500"} <= set(got)  # contributors, suspect or not
    assert {"p0007", "p0008", "p0009", "p0010"} <= set(
        got
    ) and "me" not in got  # the next candidates, not itself
    assert "p0100" not in got  # client mode: takes no inbound call
    rest = set(got) - {"p0001", "p0002", "p0003", "p1500", "p0007", "p0008", "p0009", "p0010"}
    assert rest and all(int(pid[1:]) < 20 for pid in rest)  # the sample avoids peers under suspicion
    many = _record(*(f"p{i:04d}" for i in range(200, 400)))  # a merge of 200 learners: each gets it
    assert len(node.record_push().targets(0, many)) == 200 + 4


class _Public(_Node):
    """A node of a public swarm (``--elect`` workers) that has merged the work of ``workers``, ``watched_s``
    seconds ago (the watch is 3 periods of 1 s)."""

    logged_learners = SwarmView.logged_learners

    def __init__(self, n: int, workers: list[str], watched_s: float) -> None:
        super().__init__(n)
        self.settings = SimpleNamespace(elect_workers=True)
        self.syncs = [SimpleNamespace(due_every=1.0)]
        self.work, self.logs = WorkBook(), []
        for q in workers:
            self.work.merged(q, 0, time.monotonic() - watched_s)
        self.work.settle(workers)  # credited on the chain (records past a fork's reach)


def test_a_public_swarm_pushes_to_members_whose_work_was_merged_not_to_identities_that_never_worked():
    workers = [f"p{i:04d}" for i in range(6)]  # 6 real nodes beside 64 identities with no process behind them
    node = _Public(70, workers, watched_s=100.0)
    assert node.record_push().targets(0, _record("p0001", "p0002")) == workers
    # a node that has watched for less than the window cannot tell them apart yet: the sample as before
    fresh = _Public(70, workers, watched_s=1.0)
    got = fresh.record_push().targets(0, _record("p0001", "p0002"))
    assert len(got) == RECORD_FANOUT and set(got) - set(workers)


def test_a_public_swarm_relinks_members_whose_work_was_merged_not_identities_that_never_worked():
    """``SwarmView.relink`` pings the known peers the DHT lost; an identity with no process behind it is never
    in the routing table, so it was pinged (dialled) every heartbeat for as long as its record lived."""
    import asyncio

    asked: list[list[str]] = []

    class _Membership:
        def relink(self, peer_ids, first=()):
            asked.append(sorted(peer_ids))
            return []

    class _View(_Public):
        relink = SwarmView.relink

    async def go(view: _View) -> list[str]:
        view.clock = asyncio.get_running_loop().time
        view.membership, view.events = _Membership(), None
        view.peer_book = {pid: view.clock() for pid in view.members}
        await view.relink()
        return asked.pop()

    workers = [f"p{i:04d}" for i in range(6)]
    view = _View(70, workers, watched_s=100.0)
    view.settings.initial_peers = ""
    assert asyncio.run(go(view)) == workers
    everyone = _View(70, workers, watched_s=100.0)
    everyone.settings = SimpleNamespace(elect_workers=False, initial_peers="")
    assert len(asyncio.run(go(everyone))) == 70
