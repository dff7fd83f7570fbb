"""A synchroniser merges on a worker thread, on a frozen view of its replica (``Replication._merge_off_loop``):
the node's loop keeps answering meanwhile, the record is applied only if the replica is still where the
merge began, and a merge the replica moved under is dropped and its round started over."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from types import SimpleNamespace

import torch

from dht.identity import Identity
from node.common.events import EventLog
from node.swarm.clocks import SwarmClocks
from node.swarm.record_push import RecordPush
from node.swarm.replication import Replication
from protocol.agreement import MIN_ROUNDS, AgreementBook
from protocol.codecs import encode_tensors
from protocol.config import ProtocolConfig
from protocol.replica import FragmentReplica
from protocol.synchroniser import Contribution, Merge, Phase, SyncState
from tests.trust_util import trust_of


class _Node(Replication):
    # the policy as the node wires it from this fake's settings, pcfg and parts, whichever a test set last
    trust = property(lambda self: trust_of(self))

    def __init__(self, rep: FragmentReplica) -> None:
        self.peer_id, self.settings = "me", SimpleNamespace(swarm="s")
        self.replicas = [rep]
        self.pcfg = ProtocolConfig()
        self.syncs = [SyncState(fragment=0, global_round=rep.round, phase=Phase.MERGING)]
        self._stop = None
        self.applied, self.resets, self.decided = [], [], []
        self.loop = asyncio.get_running_loop()
        self.agreement = AgreementBook()
        self.plan = SimpleNamespace(sync_every=8)
        self.clocks = SwarmClocks(self.replicas, self.plan, self.syncs, self.loop.time)
        # a swarm whose learners are vouched for: no receipts (node.swarm.trust.receipts)
        self.receipts = SimpleNamespace(receipts_on=lambda: False)

    def apply(self, sr, made_here=False):
        assert made_here
        self.replicas[0].apply_record(sr.record, self.pcfg)
        self.applied.append(sr.record.round)

    def reset_sync(self, p, merged=frozenset(), promised=frozenset()):
        self.resets.append((p, set(merged)))
        self.syncs[p] = SyncState(fragment=p, global_round=self.replicas[p].round, promised=promised)


def _contributions(theta, n=3):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        delta = {k: 1e-3 * torch.randn(v.shape, generator=g) for k, v in theta.items()}
        out.append(Contribution(f"l{i}", 0, 0, 8, 800, 0.1, encode_tensors(delta, "int4", 64), f"l{i}:0:8"))
    return tuple(out)


def _held(monkeypatch):
    """Make ``FragmentReplica.make_record`` wait, on its worker thread, until the test lets it go."""
    started, go = threading.Event(), threading.Event()
    real = FragmentReplica.make_record

    def slow(self, *a, **kw):
        started.set()
        assert go.wait(10)
        return real(self, *a, **kw)

    monkeypatch.setattr(FragmentReplica, "make_record", slow)
    return started, go


def _run(node_and_merge):
    asyncio.run(node_and_merge())


def test_the_merge_leaves_the_loop_free_and_its_record_is_applied_here(monkeypatch):
    started, go = _held(monkeypatch)
    theta = {"w": torch.randn(64, 32), "b": torch.randn(32)}

    async def main():
        rep = FragmentReplica(0, theta, is_embedding=False)
        node = _Node(rep)
        node.decide = lambda p, d: node.decided.append(d.state.global_round)
        node.spawn = lambda coro: asyncio.ensure_future(coro)
        # no member to push the record to (node.swarm.record_push)
        node.record_push = RecordPush(
            None,
            SimpleNamespace(elect_workers=False, rpc_timeout_s=1.0),
            "me",
            {},
            lambda: {},
            lambda p, seen: seen,
            lambda p: [],
            node.loop.time,
        )
        node.settings = type("S", (), {"swarm": "s"})()
        node.identity = Identity.generate()
        node.peer_id = node.identity.peer_id
        node.counters, node.leases = {"records_made": 0}, {}
        task = asyncio.ensure_future(
            node._merge_off_loop(0, Merge(1, _contributions(theta)), 3, 0.0, 0.0, 0.0)
        )
        while not started.is_set():
            await asyncio.sleep(0.01)
        ticks = 0
        for _ in range(5):  # the loop runs while the merge waits on its thread
            await asyncio.sleep(0.01)
            ticks += 1
        assert not task.done() and ticks == 5
        go.set()
        await task
        assert node.applied == [1] and rep.round == 1 and node.resets == []
        assert node.decided == [1]  # on_merged moved the state machine to round 1
        assert set(rep.norms.rms) == {"l0", "l1", "l2"}  # the norms the merge measured are the replica's now

    _run(main)


def test_a_merge_the_replica_moved_under_is_dropped_and_its_round_started_over(monkeypatch):
    started, go = _held(monkeypatch)
    theta = {"w": torch.randn(64, 32), "b": torch.randn(32)}

    async def main():
        rep = FragmentReplica(0, theta, is_embedding=False)
        other = FragmentReplica(0, theta, is_embedding=False)
        node = _Node(rep)
        task = asyncio.ensure_future(
            node._merge_off_loop(0, Merge(1, _contributions(theta)), 3, 0.0, 0.0, 0.0)
        )
        while not started.is_set():
            await asyncio.sleep(0.01)
        # a record of round 1 from another synchroniser lands here meanwhile
        monkeypatch.undo()
        theirs = other.make_record(1, _contributions(theta, 2), replace(ProtocolConfig(), robust="off"))
        rep.apply_record(theirs, node.pcfg)
        go.set()
        await task
        assert node.applied == [] and node.resets == [(0, set())]
        assert rep.round == 1 and rep.hash == theirs.new_hash  # theirs stands

    _run(main)


def test_a_learner_distrusted_here_is_left_out_of_this_nodes_merge_and_alone_it_starts_the_round_over():
    """``protocol.agreement`` at the node: the merge takes every contribution but those of a learner whose
    cosines with the rest stayed below zero in this node's merges (counted, and a ``distrusted`` event); a
    round of only such contributions is not merged: the round starts over without them."""
    theta = {"w": torch.randn(64, 32), "b": torch.randn(32)}

    async def main():
        node = _Node(FragmentReplica(0, theta, is_embedding=False))
        for _ in range(MIN_ROUNDS):
            node.agreement.add(["l0", "l1", "l2"], [0.5, -0.6, 0.4])
        node.counters, node.events = {"distrusted_left_out": 0}, EventLog()
        node._stop = None
        node.view = SimpleNamespace(live_members=dict)
        node.spawn = lambda coro: coro.close()
        merged = []

        def merge_off_loop(p, a, *rest):
            merged.append(tuple(c.learner for c in a.contributions))
            return asyncio.sleep(0)

        node._merge_off_loop = merge_off_loop
        cs = _contributions(theta)
        node.pcfg = ProtocolConfig(distrust=False)  # --no-distrust: every contribution merged
        node._merge(0, Merge(1, cs))
        assert merged == [("l0", "l1", "l2")] and node.counters["distrusted_left_out"] == 0
        node.pcfg, merged[:] = ProtocolConfig(), []  # on by default
        node._merge(0, Merge(1, cs))
        assert merged == [("l0", "l2")] and node.counters["distrusted_left_out"] == 1
        assert [e["learners"] for e in node.events.of("distrusted")] == [["l1"]]
        node._merge(0, Merge(1, cs[1:2]))
        assert merged == [("l0", "l2")] and node.resets == [(0, {cs[1].cid})]

    _run(main)
