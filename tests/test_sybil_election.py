"""Issue 32, Sybils: in a public swarm only members whose learner's work was merged lately are elected
synchroniser (``--elect workers``, the default there). A signed membership record costs nothing: a member
that published copies of its record under fresh identities had them win rounds, and every sender failed over
past each one. Real node processes; the attacker is this test process with its own DHT and p2p daemon."""

from __future__ import annotations

import threading
import time

import pytest
from hivemind.utils import get_dht_time

from dht.identity import Identity
from dht.records import Member
from dht.swarm import Membership
from node.swarm.transport import Reply
from tests.swarm_util import wait_until
from tests.test_hostile_state import SWARM, every_fragment_merges, hostile_swarm

pytestmark = pytest.mark.timeout(400)
SYBILS = 8


@pytest.mark.slow
def test_members_whose_work_is_never_merged_are_not_elected_in_a_public_swarm(tmp_path):
    """Three honest nodes; a member that copies their newest heads into its record (so that, heads alone, it
    is electable for every fragment), answers ``ok`` to every contribution and never merges, and publishes the
    same record under 8 more identities with no process behind them. Once the nodes have watched the swarm
    merge for the working window, none of the 9 is elected in any view, no contribution reaches the
    member, no sender fails over past any of them, and the swarm ends on one hash."""
    with hostile_swarm(tmp_path, 3, 2) as (swarm, bad):
        stop = threading.Event()

        async def ok(caller: str, raw: bytes) -> Reply:
            return Reply(True)

        for op in ("contribute", "ping"):
            bad.serve(op, ok)
        bad.run(bad.tr.start())
        sybils = [Identity.generate() for _ in range(SYBILS)]
        hostile = {bad.ident.peer_id} | {s.peer_id for s in sybils}

        def copy_heads() -> None:  # the newest honest head of each fragment, under every identity
            members = Membership(bad.dht, SWARM, bad.ident)
            books = [Membership(bad.dht, SWARM, s) for s in sybils]
            while not stop.wait(0.5):
                try:
                    heads: dict = {}
                    for m in members.live()[0]:
                        if m.peer_id in hostile:
                            continue
                        for p, h in m.heads.items():
                            if p not in heads or int(h[0]) > int(heads[p][0]):
                                heads[p] = h
                    bad.publish(heads)
                    now = get_dht_time()
                    for s, book in zip(sybils, books):
                        book.publish(Member(s.peer_id, (), "ddiloco/0.3", now, now + 300, heads=heads))
                except Exception:  # noqa: BLE001 - the attacker's DHT under load; the next beat retries
                    continue

        liar = threading.Thread(target=copy_heads, daemon=True)
        liar.start()
        try:
            honest = {s["peer_id"] for s in swarm.status().values()}

            def in_view() -> bool:  # every view holds the member and its Sybils
                return all(
                    s["elect"] == "workers" and s["peer_count"] >= len(honest) + SYBILS
                    for s in swarm.status().values()
                )

            wait_until(in_view, 120, "every view to hold the member and its Sybils")
            # past the watch (``node.swarm.view.WORKING_ROUNDS``: 8 of a fragment's periods) since the nodes'
            # first merges: every view now tells a worker from an identity whose work was never merged
            every_fragment_merges(swarm, 8, "while the views fill")
            t0, sent = time.time(), bad.calls.get("contribute", 0)
            seen: set = set()
            for _ in range(3):
                seen |= {f["synchroniser"] for s in swarm.status().values() for f in s["fragments"]}
                every_fragment_merges(swarm, 3, "beside the Sybils")
            assert seen <= honest, seen - honest
            assert bad.calls.get("contribute", 0) == sent, (
                "a contribution reached the member after the window"
            )
            for i in range(len(honest)):
                past = [
                    e
                    for e in swarm.events(i)
                    if e["kind"] == "failover" and e["t"] > t0 and e["dead"] in hostile
                ]
                assert not past, past[:3]
        finally:
            stop.set()
            liar.join(10)
        final = swarm.settle()
        assert len({s["model_hash"] for s in final.values()}) == 1


def test_a_head_that_sybils_echo_is_pulled_from_a_worker_that_holds_it():
    """``CatchUp.reconcile`` in a public swarm: where the best head is held by a worker and by 32 copies of
    its record, the pull goes to the worker (nearly every pull went to a copy, with no process behind it);
    where this node cannot tell workers yet, any holder."""
    from types import SimpleNamespace

    from node.swarm.trust.work_book import WorkBook
    from node.swarm.view import SwarmView
    from tests.test_catch_up import fake_catch_up

    class _View:  # what the view reads to tell workers (``SwarmView.workers``)
        workers = SwarmView.workers
        logged_learners = SwarmView.logged_learners

        def __init__(self, watched_s: float) -> None:
            self.settings = SimpleNamespace(elect_workers=True)
            self.syncs = [SimpleNamespace(due_every=1.0)]
            self.work, self.logs = WorkBook(), []
            self.work.merged("worker", 0, time.monotonic() - watched_s)
            self.work.settle(["worker"])

    def catch_up(watched_s: float):
        view = _View(watched_s)
        node = fake_catch_up(
            settings=SimpleNamespace(
                elect_workers=True, heartbeat_s=0.5, snapshot_burst=0, snapshots_per_min=0
            ),
            lagging_since={0: time.monotonic() - 60},
            winning_heads=lambda p, ms, refused=(): (
                [9, "h9", 2, 1.0],
                ["worker", *(f"sybil{i:02d}" for i in range(32))],
            ),
            workers=view.workers,
            spawn=lambda coro: None,
        )
        node.pulled = []
        node.catch_up = lambda p, pid, head, yielding=False: node.pulled.append(pid)
        return node

    node = catch_up(watched_s=100.0)
    for _ in range(20):
        node.reconcile()
    assert node.pulled == ["worker"] * 20
    fresh = catch_up(watched_s=0.0)  # has not watched the swarm merge for 3 periods: cannot tell
    for _ in range(20):
        fresh.reconcile()
    assert set(fresh.pulled) - {"worker"}
