"""Routing a contribution past a synchroniser that hangs (``Sender.send``).

A stopped node (SIGSTOP, a frozen VM, a link that drops packets without a reset) keeps its membership record
until it expires and answers nothing: the first request to it used up the whole failover budget, and every
contribution sent to its rounds was dropped (19 in one chaos run). The transport here is a stand-in: the
test is about how ``_send`` spends its deadline, not about sockets (tests/test_swarm.py kills real ones).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import node.swarm.sender as sender_mod
from dht.identity import Identity
from node.common.events import EventLog
from node.swarm.deadlines import MergeDeadlines
from node.swarm.intake import Intake
from node.swarm.sender import Outbox, OwnCids, Sender
from node.swarm.transport import Reply, TransportError
from node.swarm.trust.peer_scores import PeerScores
from node.swarm.trust.receipts import Receipts, make_receipt
from protocol.config import ProtocolConfig
from tests.test_receipts import receipts_of

CID = "me:3:10:1000"


class _NoReceipts:
    """A swarm whose learners are vouched for: no receipts (``node.swarm.trust.receipts``)."""

    def receipts_on(self) -> bool:
        return False

    def watched_round(self, rc, open_round: int) -> int:
        raise AssertionError("no receipt to watch")

    def check_omission(self, sr, rc) -> bool:
        raise AssertionError("no receipt to check")


class _Transport:
    def __init__(self, hung: set[str]) -> None:
        self.hung = hung
        self.calls: list[tuple[str, float]] = []
        self.replies: dict[str, Reply] = {}
        self.on_call = lambda target: None

    async def call(
        self, target: str, op: str, payload: bytes, timeout_s: float, share: int = 1, queue_s: float = 0.0
    ) -> Reply:
        self.calls.append((target, timeout_s))
        self.on_call(target)
        if target in self.hung:
            await asyncio.sleep(timeout_s)
            raise TransportError(f"{op} to {target}: no reply within {timeout_s:.1f}s")
        return self.replies.get(target, Reply(True))


class _Sender:
    """A node's sending side (``Sender``) and the intake it asks about dead peers (``Intake``), built from
    fakes of the rest: the view's order is ``order``, the transport a stand-in, this node's own intake a
    list of the callers it took from."""

    def __init__(self, order: list[str], hung: set[str], failover_s: float) -> None:
        self.pcfg = ProtocolConfig()
        self.settings = SimpleNamespace(
            failover_s=failover_s, rpc_timeout_s=10.0, ttl_s=6.0, heartbeat_s=1.0, swarm="s"
        )
        self.replicas = {3: SimpleNamespace(round=0)}
        self.members: dict = {}
        self.lease_seen: dict = {}
        self.swarm_steps = 0
        self.last_contribution: dict = {}
        self.outbox = Outbox(OwnCids("me"), self.last_contribution)  # the deadlines put one back in it
        self.outbox.start(asyncio.get_running_loop())
        self.loop = asyncio.get_running_loop()
        self.peer_id, self.identity = "me", None
        self.order = order
        self.transport = _Transport(hung)
        self.suspect: dict[str, float] = {}
        self.counters: Counter = Counter()
        self.events = EventLog()
        self.peer_scores = PeerScores()
        self.accepted: list[str] = []
        self.clocks = SimpleNamespace(due=lambda p: None)  # no schedule yet (node.swarm.clocks)
        self.receipts = self._receipts()
        # the deadlines of the rounds that take our contributions, as the node wires them
        self.deadlines = MergeDeadlines(
            self.settings,
            self.pcfg,
            self.replicas,
            self.clocks,
            self.loop,
            self.peer_scores,
            self.suspect,
            self.counters,
            self.events,
            self.live_members,
            self.rounds_behind,
            self.receipts.watched_round,
            self.receipts.check_omission,
            self.outbox.send_again,
        )
        auditor = SimpleNamespace(
            keep_message=lambda raw, sig: ""
        )  # node.swarm.trust.audit: nothing kept here
        self.sender = Sender(
            self.settings,
            self.pcfg,
            self.peer_id,
            self.identity,
            self.suspect,
            self.peer_scores,
            self.counters,
            self.events,
            auditor,
            self.transport,
            self.receipts,
            candidates=self.candidates,
            rounds_behind=self.rounds_behind,
            accept=self._accept,
            watch=self.deadlines.watch,
            clock=self.loop.time,
        )
        self.intake = Intake(
            self.settings,
            self.pcfg,
            self.peer_id,
            {},
            self.replicas,
            [],
            {},
            self.clocks,
            self.suspect,
            None,  # nothing is taken here (no trust asked): only the dead-list checks are asked
            None,
            self.counters,
            self.events,
            self.transport,
            known=None,
            members=lambda: self.members,
            live_members=self.live_members,
            candidates=self.candidates,
            synchroniser_of=None,
            lease_seen=lambda: self.lease_seen,
            swarm_steps=lambda: self.swarm_steps,
            decide=None,
            penalise=None,
            clock=self.loop.time,
        )

    def _receipts(self):
        return _NoReceipts()

    async def _accept(self, caller: str, payload: bytes) -> Reply:  # this node as the synchroniser
        self.accepted.append(caller)
        return Reply(True)

    def candidates(self, p: int, dead=()) -> list[str]:
        return [x for x in self.order if x not in dead]

    def rounds_behind(self, p: int) -> int:
        return 0

    def live_members(self) -> dict:
        return self.members


def _send(monkeypatch, order: list[str], hung: set[str], failover_s: float = 1.0, setup=None) -> _Sender:
    monkeypatch.setattr(sender_mod, "encode_contribution", lambda header, enc: b"raw")
    monkeypatch.setattr(sender_mod, "sign_contribution", lambda swarm, identity, raw: b"sig")

    async def go() -> _Sender:
        s = _Sender(order, hung, failover_s)
        if setup is not None:
            setup(s)
        await s.sender.send(SimpleNamespace(fragment=3, cid=CID, step_time_s=0.05), None)
        return s

    return asyncio.run(go())


def test_a_hung_synchroniser_leaves_time_for_the_next_candidate(monkeypatch):
    s = _send(monkeypatch, ["A", "B", "C"], hung={"A"})
    assert [t for t, _ in s.transport.calls] == ["A", "B"]
    assert s.transport.calls[0][1] <= 0.5 + 1e-6  # half the budget while others are left
    assert s.counters["contributions_sent"] == 1 and s.counters["failovers"] == 1
    assert not s.events.of("drop")
    assert [e["dead"] for e in s.events.of("failover")] == ["A"]


def test_the_last_candidate_gets_what_is_left_and_then_the_contribution_is_dropped(monkeypatch):
    s = _send(monkeypatch, ["A", "B"], hung={"A", "B"})
    (a, wa), (b, wb) = s.transport.calls[:2]
    assert (a, b) == ("A", "B") and wa <= 0.5 + 1e-6 and wb > wa  # B, the last one left, gets the rest
    assert s.counters["contributions_sent"] == 0
    assert [e["why"] for e in s.events.of("drop")] == ["no synchroniser in time"]


def test_a_contribution_merged_before_its_reply_came_back_is_not_sent_again(monkeypatch):
    """Seen in a failure-free parity run: the synchroniser merged the contribution, its stream broke before
    the reply, and the merge record reached the sender before its failover did. The failover went to the
    sender itself, which refused its own contribution as a replay (one refusal and one drop, no fault)."""

    def setup(s: _Sender) -> None:
        def merged_then_broke(target: str) -> None:
            s.peer_scores.merged([CID])  # the merge record arrives while the call fails
            raise TransportError("stream broke (IncompleteReadError)")

        s.transport.on_call = merged_then_broke

    s = _send(monkeypatch, ["A", "me"], hung=set(), setup=setup)
    assert [t for t, _ in s.transport.calls] == ["A"]
    assert s.accepted == []  # not offered to this node's own synchroniser again
    assert s.counters["contributions_sent"] == 1 and not s.events.of("drop")


def test_a_replayed_reply_to_an_own_resend_means_it_landed(monkeypatch):
    def setup(s: _Sender) -> None:
        s.transport.replies["A"] = Reply(False, "replayed", f"contribution {CID} was already merged")

    s = _send(monkeypatch, ["A", "B"], hung=set(), setup=setup)
    assert [t for t, _ in s.transport.calls] == ["A"]
    assert s.counters["contributions_sent"] == 1 and not s.events.of("drop")


def test_a_blocked_resend_of_what_this_nodes_own_role_holds_goes_to_the_next_candidate(monkeypatch):
    """Two views that each elected their own node (sync-diloco, every learner the quorum) each held one
    learner's contribution, and neither merged again. A blocked learner's re-send (``resent``) of a
    contribution its own node already took goes to the next candidate; where that one names us back (views
    agree on us), our own role takes it again. A first send, and a re-send of what another member took, go
    to the first candidate as before."""
    monkeypatch.setattr(sender_mod, "encode_contribution", lambda header, enc: b"raw")
    monkeypatch.setattr(sender_mod, "sign_contribution", lambda swarm, identity, raw: b"sig")
    header = SimpleNamespace(fragment=3, cid=CID, step_time_s=0.05)

    async def go() -> None:
        s = _Sender(["me", "B"], set(), 1.0)
        await s.sender.send(header, None)
        assert s.accepted == ["me"] and s.transport.calls == []
        await s.sender.send(header, None, resent=True)  # the other view's synchroniser gets it
        assert s.accepted == ["me"] and [t for t, _ in s.transport.calls] == ["B"]
        s.transport.replies["B"] = Reply(
            False, "not_synchroniser", "try me", json.dumps({"try": "me"}).encode()
        )
        await s.sender.send(header, None, resent=True)  # B's view elects us: back to our own role
        assert s.accepted == ["me", "me"] and [t for t, _ in s.transport.calls] == ["B", "B"]
        other = SimpleNamespace(fragment=3, cid="me:3:11:1100", step_time_s=0.05)
        s.order = ["B", "me"]
        s.transport.replies.clear()
        await s.sender.send(other, None, resent=True)  # held by B, not here: B again
        assert [t for t, _ in s.transport.calls] == ["B", "B", "B"]
        assert s.counters["contributions_sent"] == 4 and not s.events.of("drop")

    asyncio.run(go())


class _ReceiptSender(_Sender):
    """A sender in a public swarm: a synchroniser's ok must carry its receipt (``node.swarm.trust.receipts``)."""

    def __init__(self, order: list[str], hung: set[str], failover_s: float) -> None:
        super().__init__(order, hung, failover_s)
        self.replicas[3] = SimpleNamespace(round=4, hash="h4")  # the deadlines read the same dict

    def _receipts(self) -> Receipts:
        self.settings.trusted = False
        return receipts_of(
            SimpleNamespace(peer_id=self.peer_id),
            Path("/nonexistent"),  # no receipts.log of an earlier life: none given
            self.replicas,
            [],
            settings=self.settings,
            peer_scores=self.peer_scores,
            suspect=self.suspect,
            counters=self.counters,
            events=self.events,
            last_contribution=self.last_contribution,
            send_again=self.outbox.send_again,
        )


def test_an_ok_without_a_receipt_in_a_public_swarm_is_a_failover_and_a_receipt_is_watched(monkeypatch):
    """A synchroniser that takes a contribution and promises nothing (no receipt, one signed by someone else,
    or for another contribution) is passed over and suspected as a stalled one; the first that gives a good
    one gets the contribution, and its receipt is what the record of that round is checked against (one on a
    parent we do not hold too: honest synchronisers on the other side of a fork give them)."""
    monkeypatch.setattr(sender_mod, "encode_contribution", lambda header, enc: b"raw")
    monkeypatch.setattr(sender_mod, "sign_contribution", lambda swarm, identity, raw: b"sig")
    ids = {x: Identity.generate() for x in "ABCDE"}
    order = [ids[x].peer_id for x in "ABCDE"]

    async def go() -> _ReceiptSender:
        s = _ReceiptSender(order, set(), 5.0)
        s.peer_id = "me"
        replies = s.transport.replies

        def receipt(signer: str, round_=5, parent="h4", cid=CID, fragment=3) -> Reply:
            return Reply(
                True, body=make_receipt("s", ids[signer], fragment, round_, parent, "me", cid).packed()
            )

        replies[order[0]] = Reply(True)  # nothing
        replies[order[1]] = Reply(True, body=receipt("A").body)  # A's receipt, from B
        replies[order[2]] = receipt("C", cid="me:3:10:999")  # another contribution's
        replies[order[3]] = receipt("D", fragment=2)  # another fragment's
        replies[order[4]] = receipt("E", parent="h4-fork")  # E on another side of a fork: kept
        await s.sender.send(SimpleNamespace(fragment=3, cid=CID, step_time_s=0.05, base_round=4), None)
        return s

    s = asyncio.run(go())
    assert [t for t, _ in s.transport.calls] == order
    assert s.counters["no_receipt"] == 4 and s.counters["contributions_sent"] == 1
    assert set(s.suspect) == set(order[:4])
    header, target, round_, rc, _ = s.deadlines.taken[3]
    assert (target, round_, rc.signer, rc.cid, rc.parent) == (order[4], 5, order[4], CID, "h4-fork")
    # the record watched is the receipt's round where it is near ours, else ours (a far one never comes)
    watched = [s.receipts.watched_round(replace(rc, round=r), 5) for r in (3, 4, 5, 6, 7, 99)]
    assert watched == [5, 4, 5, 6, 5, 5]


def test_a_round_taken_and_not_merged_by_its_deadline_suspects_the_synchroniser_and_sends_again():
    """``MergeDeadlines.check_merged`` at the deadline of a round A took: merged (our replica, or a head another member
    publishes, reached the round) changes nothing; not merged suspects A for ``STALL_TTLS`` x ``ttl_s`` and
    puts our latest contribution to the fragment back in the outbox (an older one's watch does not)."""

    async def go() -> None:
        s = _Sender(["A", "B"], set(), 1.0)
        old, latest = SimpleNamespace(fragment=3, cid="me:3:1"), SimpleNamespace(fragment=3, cid="me:3:2")
        s.last_contribution[3] = (latest, "enc")
        s.replicas[3].round = 5
        s.deadlines.check_merged("A", latest, open_round=5)  # our replica holds the round: merged
        s.replicas[3].round = 4
        s.members = {"B": SimpleNamespace(head_round=lambda p: 5)}
        s.deadlines.check_merged("A", latest, open_round=5)  # B publishes the round: merged, we catch up
        s.peer_scores.merged(["me:3:2"])
        s.members = {"B": SimpleNamespace(head_round=lambda p: 4)}
        s.deadlines.check_merged("A", latest, open_round=5)  # a record named our contribution
        assert not s.suspect and s.outbox.queue.empty() and not s.counters["stalls"]
        s = _Sender(["A", "B"], set(), 1.0)  # nothing merged anywhere
        s.last_contribution[3] = (latest, "enc")
        s.replicas[3].round = 4
        s.deadlines.check_merged("A", old, open_round=5)  # an older one: A suspected, the latest not resent
        assert s.suspect["A"] > 0 and s.outbox.queue.empty()
        s.deadlines.check_merged("A", latest, open_round=5)
        assert s.outbox.queue.get_nowait() == (latest, "enc") and s.counters["stalls"] == 2
        assert [e["peer"] for e in s.events.of("stall")] == ["A", "A"]

    asyncio.run(go())


def test_a_ping_answered_in_any_way_but_unknown_op_means_up_and_a_held_overdue_lease_means_stalled():
    """The dead-list check (``Intake.checked_dead``): a peer that answers a ping, even ``unknown_peer`` (it has not
    seen us yet), is up; ``unknown_op`` (takes no contribution, or too old to ping) or no answer is down and
    suspected. A peer that publishes the lease of fragment p's open round two repeats after its first slot
    stalled it, in this node's own view, with no ping asked, if the swarm's learners worked two rounds'
    steps since it was first seen."""

    async def go() -> None:
        s = _Sender(["A", "B"], {"C"}, 1.0)
        s.settings.rpc_timeout_s = 0.2
        s.transport.replies = {"A": Reply(False, "unknown_peer", ""), "B": Reply(False, "unknown_op", "")}
        assert await s.intake.answers("A") and "A" not in s.suspect
        assert not await s.intake.answers("B") and "B" in s.suspect
        assert not await s.intake.answers("C") and "C" in s.suspect  # no answer in time
        s.members = {"A": SimpleNamespace(leases={"3": 1}), "B": SimpleNamespace(leases={"3": 7})}
        now = s.loop.time()
        s.clocks.due = lambda p: (now - 2.5, 1.0)  # the open round's first slot, 2.5 repeats ago
        assert not s.intake.stalled_here(3, "A")  # a lease never seen in a view read: no evidence
        two = 2 * s.pcfg.sync_every  # the learners' summed steps over two rounds
        s.swarm_steps = 1000 + two
        s.lease_seen = {("A", "3", 1): (now - 30.0, 1000), ("B", "3", 7): (now - 30.0, 1000)}  # held 30 s
        assert s.intake.stalled_here(3, "A") and not s.intake.stalled_here(
            3, "B"
        )  # B's lease is of another round
        s.clocks.due = lambda p: (now - 1.5, 1.0)
        assert not s.intake.stalled_here(3, "A")
        # a swarm at rest: the open round's slot long past, A's lease first seen a moment ago (it just took
        # the first contribution in a while): not stalled until two repeats after that
        s.clocks.due = lambda p: (now - 100.0, 1.0)
        s.lease_seen = {("A", "3", 1): (now - 0.5, 1000)}
        assert not s.intake.stalled_here(3, "A")
        s.lease_seen = {("A", "3", 1): (now - 2.5, 1000)}
        assert s.intake.stalled_here(3, "A")
        # held open for a minute, but no learner stepped since (paused): starved below its quorum, not stalled
        s.lease_seen = {("A", "3", 1): (now - 60.0, 1000 + two - 1)}
        assert not s.intake.stalled_here(3, "A")

    asyncio.run(go())


def test_a_first_round_has_time_for_its_grace_window_before_it_counts_as_stalled():
    """Before the swarm has a schedule, a round merges on arrival after a grace window of up to ``overlap``
    steps: with 10 s steps the watch waits for 2 x 2 x 10 s, not for the 2 x ``failover_s`` / 2 that suits
    a small model (and suspected every first-round synchroniser of a 124M swarm a moment before it merged)."""

    async def go() -> None:
        s = _Sender(["A"], set(), failover_s=8.0)
        slow, fast = (SimpleNamespace(fragment=3, cid=CID, step_time_s=t) for t in (10.0, 0.05))
        assert s.deadlines.deadline(slow) == 2 * s.pcfg.overlap * 10.0
        assert s.deadlines.deadline(fast) == 8.0  # failover_s: the small model's deadline is as it was
        s.clocks.due = lambda p: (s.loop.time() + 5.0, 30.0)  # on the schedule: due moment + 2 periods
        assert abs(s.deadlines.deadline(slow) - 65.0) < 0.1

    asyncio.run(go())


def test_a_synchroniser_merging_its_round_is_tried_again_after_its_merge_time_on_top_of_the_budget(
    monkeypatch,
):
    """``peer_busy`` with a wait (a public swarm's synchroniser merging the round it holds) sends the
    contribution to the same synchroniser again once that wait is over: no failover, and the wait is added
    to the sender's failover budget rather than taken from its tries."""
    monkeypatch.setattr(sender_mod, "encode_contribution", lambda header, enc: b"raw")
    monkeypatch.setattr(sender_mod, "sign_contribution", lambda swarm, identity, raw: b"sig")
    a, b = Identity.generate(), Identity.generate()

    async def go() -> _ReceiptSender:
        s = _ReceiptSender([a.peer_id, b.peer_id], set(), 1.0)
        s.peer_id = "me"
        busy = Reply(False, "peer_busy", "merging", b'{"retry_s": 0.8}')
        good = Reply(True, body=make_receipt("s", a, 3, 5, "h4", "me", CID).packed())
        s.transport.replies[a.peer_id] = busy

        def second(target: str) -> None:
            if len(s.transport.calls) == 2:
                s.transport.replies[a.peer_id] = good

        s.transport.on_call = second
        await s.sender.send(SimpleNamespace(fragment=3, cid=CID, step_time_s=0.05, base_round=4), None)
        return s

    s = asyncio.run(go())
    (t1, w1), (t2, w2) = s.transport.calls
    assert (t1, t2) == (a.peer_id, a.peer_id) and w2 >= 0.8 * w1  # the 0.8 s wait left the try its time
    assert s.counters["busy_retries"] == 1 and s.counters["contributions_sent"] == 1
    assert not s.counters["failovers"] and not s.suspect


def test_a_resend_of_a_contribution_still_on_its_way_sends_nothing_more(monkeypatch):
    """A blocked learner re-sends its contribution every two heartbeats; while the first try is still on
    the link (synchronous DiLoCo's 3.5 MB model takes 28 s at 1 Mbit/s), a re-send would only queue a second
    copy behind it. Once the first try is over, a re-send goes as before."""
    monkeypatch.setattr(sender_mod, "encode_contribution", lambda header, enc: b"raw")
    monkeypatch.setattr(sender_mod, "sign_contribution", lambda swarm, identity, raw: b"sig")
    header = SimpleNamespace(fragment=3, cid=CID, step_time_s=0.05)

    async def go() -> None:
        s = _Sender(["B", "me"], set(), 5.0)
        slow = asyncio.Event()
        inner = s.transport.call

        async def call(*a, **kw):
            await slow.wait()
            return await inner(*a, **kw)

        s.transport.call = call
        first = asyncio.ensure_future(s.sender.send(header, None))
        await asyncio.sleep(0.05)
        await s.sender.send(header, None, resent=True)  # the first is still on its way: nothing sent
        slow.set()
        await first
        assert [t for t, _ in s.transport.calls] == ["B"] and s.counters["contributions_sent"] == 1
        await s.sender.send(header, None, resent=True)  # the first is over: a re-send goes
        assert [t for t, _ in s.transport.calls] == ["B", "B"]

    asyncio.run(go())


def test_a_contribution_without_room_on_this_nodes_own_link_is_dropped_and_no_one_suspected(monkeypatch):
    """Where this node's own link had no room for the body within what is left of the budget
    (``LinkBusy``: records and older contributions ahead of it), the synchroniser is not at fault: the
    contribution is dropped, saying why, with no fail-over and no suspicion, and the next goes to the same
    synchroniser."""
    from node.swarm.transport import LinkBusy

    monkeypatch.setattr(sender_mod, "encode_contribution", lambda header, enc: b"raw")
    monkeypatch.setattr(sender_mod, "sign_contribution", lambda swarm, identity, raw: b"sig")

    async def go() -> None:
        s = _Sender(["B", "C", "me"], set(), 1.0)
        seen: list = []
        inner = s.transport.call

        async def call(target, op, payload, timeout_s, share=1, queue_s=0.0):
            seen.append((target, queue_s))
            if len(seen) == 1:
                raise LinkBusy(f"{op} to {target}: this node's link had no room")
            return await inner(target, op, payload, timeout_s, share, queue_s)

        s.transport.call = call
        await s.sender.send(SimpleNamespace(fragment=3, cid=CID, step_time_s=0.05), None)
        assert [t for t, _ in seen] == ["B"] and 0 < seen[0][1] <= 1.0  # waited from the budget
        drops = s.events.of("drop")
        assert len(drops) == 1 and "no room" in drops[0]["why"]
        assert not s.events.of("failover") and not s.suspect and s.counters["failovers"] == 0
        other = SimpleNamespace(fragment=3, cid="me:3:11:1100", step_time_s=0.05)
        await s.sender.send(other, None)
        assert [t for t, _ in seen] == ["B", "B"] and s.counters["contributions_sent"] == 1

    asyncio.run(go())
