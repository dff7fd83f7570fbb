"""A synchroniser that will not sign the round it took hands it on (``Receipts.renounce``).

Where a merge would leave out a contribution this node gave a receipt for (``holds_receipts``), the node
did not sign and kept the round: it stayed merging for good, refused every contribution ``peer_busy`` (772
in one CI run), its lease kept every view electing it, and the fragment merged nothing until it left. Now it
names the round renounced in its record, every view elects the next candidate, and its round starts over.
And the commonest way into that: a contribution taken one round behind right after a snapshot, which the
merge could not re-anchor, is refused ``stale_base`` at the door instead."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dht.identity import Identity
from dht.records import Member
from node.common.events import EventLog
from node.swarm.intake import Intake
from node.swarm.transport import Reply
from node.swarm.trust.peer_scores import PeerScores
from node.swarm.trust.receipts import Receipts
from node.swarm.view import SwarmView
from node.swarm.wire import pack_list, sign_contribution
from protocol.codecs import encode_tensors
from protocol.config import ProtocolConfig
from protocol.election import candidates
from protocol.messages import ContributionHeader, encode_contribution
from protocol.replica import FragmentReplica
from protocol.synchroniser import Contribution, Merge, Phase, SyncState, on_contribution, on_tick
from tests.swarm_util import Swarm, wait_until
from tests.test_merge_off_loop import _contributions, _Node
from tests.test_receipts import receipts_of
from tests.trust_util import trust_of

SWARM = "s"


def _round(status: dict, p: int) -> int:
    return status["fragments"][p]["round"]


def test_a_merge_that_would_break_a_receipt_renounces_the_round_and_hands_on_the_latest_of_its_own(tmp_path):
    theta = {"w": torch.randn(64, 32), "b": torch.randn(32)}

    async def main():
        rep = FragmentReplica(0, theta, is_embedding=False)
        node = _Node(rep)
        outbox, events = asyncio.Queue(), EventLog()
        cs = _contributions(theta)
        mine = SimpleNamespace(fragment=0, cid=cs[0].cid)
        last = {0: (mine, "enc")}

        def send_again(header) -> None:  # as ``Outbox.send_again``
            if last[header.fragment][0] is header:
                outbox.put_nowait(last[header.fragment])

        class _Holding(Receipts):
            def holds_receipts(self, rec) -> bool:  # it leaves out a contribution we gave a receipt for
                return True

        node.receipts = receipts = receipts_of(
            Identity.generate(),
            tmp_path,  # no receipts.log of an earlier life
            node.replicas,
            node.syncs,
            settings=SimpleNamespace(swarm=SWARM, trusted=False),
            events=events,
            last_contribution=last,
            send_again=send_again,
            reset_sync=node.reset_sync,
            cls=_Holding,
        )
        assert receipts.renounced_now() == {}
        for c in cs[1:]:  # the others' contributions came with receipts; ours did not
            receipts.give_receipt(0, c.learner, c.cid)
        await node._merge_off_loop(0, Merge(1, cs), 3, 0.0, 0.0, 0.0)
        assert node.applied == [] and rep.round == 0  # not signed
        assert node.resets == [(0, {c.cid for c in cs})]  # the round starts over, none of them carried
        assert node.syncs[0].phase is Phase.COLLECTING
        # and here it merges only once each learner it gave a receipt to has contributed again
        assert node.syncs[0].promised == {c.learner for c in cs[1:]}
        assert receipts.renounced == {0: (1, rep.hash)} and receipts.renounced_now() == {"0": 1}
        assert outbox.get_nowait() == (mine, "enc")  # our own latest goes to the next candidate
        assert [(e["fragment"], e["round"]) for e in events.of("renounce")] == [(0, 1)]
        rep.round = 1  # the next candidate's record of round 1 applied here: the renouncement is over
        assert receipts.renounced_now() == {}

    asyncio.run(main())


class _View(SwarmView):
    """What ``candidates`` reads: the live members' records, this node's replica, its suspicions, and the
    rounds it renounced (its receipts)."""

    def __init__(self, me: str, others: dict[str, Member]) -> None:
        self.peer_id, self.others = me, others
        self.replicas = [SimpleNamespace(round=4, hash="h4")]
        self.settings = SimpleNamespace(swarm=SWARM, elect_workers=False)
        self.published_self, self.suspect = None, {}
        # no receipts.log of an earlier life
        self.receipts = receipts_of(SimpleNamespace(peer_id=me), Path("/nonexistent"), self.replicas, [])
        self.renounced = self.receipts.renounced_now

    def live_members(self) -> dict[str, Member]:
        # its own record as last published: a renouncement of a moment ago is not in it yet (the view reads
        # its book; read off the record, its own re-sent contribution came back to it until the next heartbeat)
        return {**self.others, self.peer_id: _member(self.peer_id)}

    def credible(self, p, pid, round_, members) -> bool:
        return True


def _member(pid: str, **kw) -> Member:
    return Member(pid, ("/ip4/127.0.0.1/tcp/1",), "v", 0.0, 1e11, heads={"0": [4, "h4"]}, **kw)


def test_every_view_elects_past_a_member_that_renounced_the_open_round_and_never_past_all_of_them():
    ids = [Identity.generate().peer_id for _ in range(4)]
    me, rest = ids[0], ids[1:]
    view = _View(me, {q: _member(q) for q in rest})
    order = view.candidates(0)
    assert sorted(order) == sorted(ids) and order == candidates(SWARM, 0, 5, sorted(ids))
    first = order[0]
    if first == me:  # this node renounced round 5 on the parent it holds
        view.receipts.renounced = {0: (5, "h4")}
    else:  # a member's record says it renounced round 5
        view.others[first] = _member(first, renounced={"0": 5})
    assert view.candidates(0) == order[1:] and view.synchroniser_of(0) == order[1]
    view.receipts.renounced = {}
    view.others = {q: _member(q, renounced={"0": 6}) for q in rest}  # another round
    view.receipts.renounced = {0: (5, "h3")}  # renounced on another parent: a round that is not this one
    assert view.candidates(0) == order
    view.receipts.renounced = {0: (5, "h4")}
    view.others = {q: _member(q, renounced={"0": 5}) for q in rest}
    assert view.candidates(0) == order  # everyone renounced: the round waits for them, as before


def test_a_round_that_owes_receipted_learners_merges_only_once_each_has_contributed_again():
    """``SyncState.promised``: the node that renounced a round and is still the one to take it does not merge
    it again until each learner it gave a receipt to has a contribution pending (which covers the receipt);
    merged at once at quorum 1, the merge broke the receipts again and was renounced again, 76 times in 0.7 s."""
    cfg = ProtocolConfig(quorum=1, grace=False)
    live = frozenset({"me", "a", "b"})

    def c(learner: str) -> Contribution:
        return Contribution(
            learner, 0, 3, 4, 40, 1.0, {"w": torch.zeros(1)}, f"{learner}:0:4:{time.time_ns()}"
        )

    def merges(d) -> list[Merge]:
        return [x for x in d.actions if isinstance(x, Merge)]

    free = on_contribution(cfg, SyncState(fragment=0, global_round=3, live=live), c("me"), 1.0)
    assert merges(free)  # owing nothing, quorum 1 merges the first contribution
    d = on_contribution(
        cfg, SyncState(fragment=0, global_round=3, live=live, promised=frozenset("ab")), c("me"), 1.0
    )
    assert not merges(d) and "receipted" in d.reason
    d = on_contribution(cfg, d.state, c("a"), 2.0)
    assert not merges(d) and not merges(
        on_tick(cfg, d.state, 50.0)
    )  # b still owed; the clock changes nothing
    d = on_contribution(cfg, d.state, c("b"), 3.0)
    assert [sorted(x.learner for x in m.contributions) for m in merges(d)] == [["a", "b", "me"]]


def _synchroniser(ident: Identity, rep: FragmentReplica, spec: dict) -> Intake:
    """``Intake.accept`` up to its checks of a contribution's base, over fakes: this node elects itself for
    every round, and the counters pass their own check (tests/test_work.py)."""
    settings = SimpleNamespace(swarm=SWARM, client_mode=False, trusted=False, ttl_s=3.0)

    async def known(caller: str) -> bool:
        return True

    scores = PeerScores()
    intake = Intake(
        settings,
        ProtocolConfig(distrust=False),
        ident.peer_id,
        {0: spec},
        [rep],
        [SyncState(fragment=0, global_round=rep.round)],
        {},
        None,
        {},
        trust_of(SimpleNamespace(settings=settings, peer_id=ident.peer_id, peer_scores=scores)),
        None,
        {},
        EventLog(),
        SimpleNamespace(count_refusal=lambda code: None),
        known=known,
        members=dict,
        live_members=dict,
        candidates=lambda p, dead=(): [ident.peer_id],
        synchroniser_of=lambda p, dead=(): ident.peer_id,
        lease_seen=dict,
        swarm_steps=lambda: 0,
        decide=None,
        penalise=lambda peer, code, signed=False: scores.penalise(peer, code, time.monotonic(), signed),
        clock=time.monotonic,
    )
    intake.check_work = lambda h: None
    return intake


def test_a_contribution_one_round_behind_a_snapshot_installed_here_is_refused_stale_and_nothing_changes():
    theta = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    rep = FragmentReplica(0, theta, is_embedding=False)
    rep.load_state(5, theta, {k: torch.zeros_like(v) for k, v in theta.items()})  # joined by snapshot at 5
    sync, learner = Identity.generate(), Identity.generate()
    node = _synchroniser(sync, rep, {k: tuple(v.shape) for k, v in theta.items()})
    h = ContributionHeader(
        learner=learner.peer_id, fragment=0, base_round=4, c_steps=8, c_tokens=2048, step_time_s=0.1,
        codec="int4", block=64, cid=f"{learner.peer_id[-10:]}:0:8:1",
    )  # fmt: skip

    def send(header: ContributionHeader, scale: float) -> Reply:
        delta = {k: scale * torch.randn(v.shape) for k, v in theta.items()}
        raw = encode_contribution(header, encode_tensors(delta, "int4", 64))
        payload = pack_list([json.dumps({"dead": []}).encode(), raw, sign_contribution(SWARM, learner, raw)])
        return asyncio.run(node.accept(learner.peer_id, payload))

    before = node.syncs[0]
    reply = send(h, 1e-3)
    assert not reply.ok and reply.code == "stale_base" and "no longer keeps round 4" in reply.message
    assert (
        node.syncs[0] is before and not node.trust.peer_scores.scores
    )  # taken into nothing; no count against it
    assert not node.trust.peer_scores.was_merged(h.cid)
    # a bad message is refused for what it is, stale or not (and counted against its sender)
    reply = send(replace(h, cid=f"{learner.peer_id[-10:]}:0:8:2"), 1e6)  # far past the bound
    assert (
        reply.code == "too_large"
        and node.trust.peer_scores.scores[learner.peer_id] < 0
        and node.syncs[0] is before
    )


@pytest.mark.slow
def test_a_node_that_lost_what_it_gave_receipts_for_hands_its_round_on_and_nobody_is_banned(tmp_path):
    """Real node processes: the test hook ``forget`` drops the contributions of every open round a node holds
    (the receipts it gave for them stay): its next merge of such a round would leave them out, so it renounces
    the round. Another member merges that round, every node gets to it, nobody is banned for it, and the
    swarm settles on one hash. (Kept taken, the round stayed merging at that node for good.) The forgetting
    starts once every node has seen every learner's work merged: before, a public swarm elects only the
    members whose learners it credits, and a renouncer that is the only one left takes the round back once
    its receipted learners have contributed again (``SyncState.promised``; tested above)."""
    swarm = Swarm(tmp_path / "swarm")
    try:
        swarm.start_many(3)
        ids = {i: c.peer_id for i, c in swarm.children.items()}
        wait_until(lambda: all(s["rounds_merged"] >= 4 for s in swarm.status().values()), 90, "first rounds")
        every = set(ids.values())
        wait_until(lambda: all(swarm.credited(j) >= every for j in ids), 60, "every learner credited")

        def renounced():
            found = [(i, e) for i in ids for e in swarm.events(i) if e["kind"] == "renounce"]
            for i in ids if not found else ():
                swarm.control(i, "forget")
            return found

        i, e = wait_until(renounced, 90, "a round renounced", interval_s=0.5)[0]
        p, r = e["fragment"], e["round"]

        def merged_by_another() -> bool:  # at any node: one that lost a fork to it takes the round by resync
            return any(
                x["kind"] == "merge" and (x["fragment"], x["round"]) == (p, r) and x["signer"] != ids[i]
                for j in ids
                for x in swarm.events(j)
            )

        wait_until(merged_by_another, 60, f"fragment {p}'s round {r} merged by another member")
        final = swarm.settle(timeout_s=60)
        assert len({s["model_hash"] for s in final.values()}) == 1
        assert all(_round(final[j], p) >= r for j in ids)
        bans = [(j, x) for j in ids for x in swarm.events(j) if x["kind"] == "ban" and x["peer"] == ids[i]]
        assert not bans, bans
    finally:
        swarm.stop()
