"""Per-peer backoff and token buckets, with the time passed in."""

from __future__ import annotations

import math

from node.swarm.limits import Backoff, TokenBucket


def test_backoff_doubles_to_its_cap_and_a_success_resets_it():
    b = Backoff(base_s=0.25, cap_s=4.0)
    waits = [b.failed("p", 0.0) for _ in range(8)]
    assert waits == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert not b.ready("p", 3.99) and b.ready("p", 4.0)
    assert b.ready("q", 0.0)  # per peer: another peer is not held back
    b.succeeded("p")
    assert b.ready("p", 0.0) and b.failed("p", 10.0) == 0.25


def test_backoff_turns_a_retry_storm_into_a_few_tries():
    """The issue: catching up from a peer that was just killed retried 16-20 times a second. Trying every
    50 ms for 60 s against a peer that always fails, the backoff lets through a few dozen tries at most."""
    b = Backoff(base_s=0.25, cap_s=30.0, log_every_s=60.0)
    tries = logged = 0
    for i in range(1200):
        now = i * 0.05
        if b.ready("dead", now):
            tries += 1
            b.failed("dead", now)
            logged += b.should_log("dead", now)
    assert 5 <= tries <= 12  # 0.25 + 0.5 + ... + 16 + 30 s: about 8 tries in a minute, not 1,200
    assert logged <= 7  # the first failure, then each doubling: not a line per try


def test_backoff_logs_at_the_cap_once_a_period():
    b = Backoff(base_s=1.0, cap_s=2.0, log_every_s=60.0)
    lines = []
    for i in range(100):
        b.failed("p", float(i * 2))
        lines.append(b.should_log("p", float(i * 2)))
    assert lines[:2] == [True, True] and sum(lines) == 2 + 3  # 200 s at the cap: every 60 s


def test_token_bucket_allows_a_burst_then_its_rate():
    t = TokenBucket(burst=4, per_s=1 / 15)  # 4 per minute
    assert [t.take("a", 1, 0.0) for _ in range(4)] == [0.0] * 4
    wait = t.take("a", 1, 0.0)
    assert math.isclose(wait, 15.0)  # refused: the next token comes in 15 s
    assert t.take("b", 1, 0.0) == 0.0  # per peer
    assert t.take("a", 1, 14.0) > 0 and t.take("a", 1, 15.0) == 0.0
    assert t.take("a", 2, 15.0) > 0  # a refused request spends nothing...
    assert t.take("a", 2, 45.0) == 0.0  # ...and the bucket refills at its rate, up to the burst
    assert t.take("a", 5, 1e9) == math.inf  # more than the burst is never possible


def test_a_failing_membership_read_holds_the_last_good_view_for_a_bounded_time():
    """Issue 19: a read that fails must not empty a node's view (each node alone splits the swarm), and
    must not keep dead members in it for ever either."""
    from types import SimpleNamespace

    from node.swarm.view import VIEW_HOLD_TTLS, SwarmView

    node = SimpleNamespace(settings=SimpleNamespace(ttl_s=3.0), _read_failing=False, _last_good_read=100.0)
    horizon = lambda now: SwarmView._view_horizon(node, now)  # noqa: E731
    assert horizon(150.0) == 150.0  # reads work: records expire as they say
    node._read_failing = True
    assert horizon(101.0) == 100.0 and horizon(105.0) == 100.0  # judged as of the last good read...
    hold = VIEW_HOLD_TTLS * 3.0
    assert horizon(100.0 + hold + 5.0) == 105.0  # ...for a bounded time, then records expire that late
    assert horizon(99.0) == 99.0  # never later than now


def test_a_record_counts_a_bounded_time_whatever_expiry_it_claims():
    """A member signing ``expires_at`` = now + 1e6 stayed in every view long after its ttl: a record
    counts at most LIFETIME_TTLS x ttl_s after its issue time, and one issued in the future is not counted."""
    from types import SimpleNamespace

    from dht.records import Member
    from dht.swarm import get_dht_time
    from node.swarm.view import LIFETIME_TTLS, SwarmView

    ttl, now = 3.0, get_dht_time()

    def member(pid: str, issued: float, expires: float) -> Member:
        return Member(pid, (), "0", issued, expires)

    members = {
        "honest": member("honest", now - 1.0, now - 1.0 + ttl),
        "forever": member("forever", now - 1.0, now + 1e6),  # fresh: counts, for now
        "stale-forever": member("stale-forever", now - LIFETIME_TTLS * ttl - 1.0, now + 1e6),
        "from-the-future": member("from-the-future", now + 1e6, now + 2e6),
    }
    node = SimpleNamespace(
        settings=SimpleNamespace(ttl_s=ttl),
        _read_failing=False,
        members=members,
        blocked=set(),
        peer_scores=SimpleNamespace(banned_until={}),
        peer_id="me",
        self_member=lambda t: member("me", t, t + ttl),
    )
    node._view_horizon = lambda t: SwarmView._view_horizon(node, t)
    assert set(SwarmView.live_members(node)) == {"honest", "forever", "me"}


def test_a_heartbeat_whose_write_fails_still_reads_the_view():
    """A DHT peer that refuses our record (one holding junk over the members key) fails the write while
    reads work. The view must still be re-read each beat: left unread for a ttl, every record in it expires
    and the node sees itself alone (a split seen in tests/test_strangers.py under load)."""
    import asyncio
    from types import SimpleNamespace

    from dht.launch import SwarmUnreachable
    from node.swarm.view import SwarmView

    reads = []

    def publish(member):
        raise SwarmUnreachable("refused by the DHT peer that answered last")

    async def refresh():
        reads.append(True)

    node = SimpleNamespace(
        membership=SimpleNamespace(publish=publish), self_member=lambda now: None, refresh=refresh
    )
    for _ in range(3):
        asyncio.run(SwarmView.heartbeat(node))
    assert len(reads) == 3


def test_a_beat_that_fails_does_not_end_the_heartbeats():
    """A beat raised (a status read racing the learner's thread: ``deque mutated during iteration``) and the
    heartbeat task ended with it: the node's record expired from every view, its own view froze, it never
    reconciled again and stayed on its own forks to the end of a test run. The next beat comes as usual."""
    import asyncio
    from types import SimpleNamespace

    from node.swarm.view import SwarmView

    beats, reconciled = [], []

    async def beat():
        beats.append(True)
        if len(beats) == 1:
            raise RuntimeError("deque mutated during iteration")
        if len(beats) == 3:
            raise asyncio.CancelledError  # the node stopping: that one does end the loop

    async def go():
        node = SimpleNamespace(
            settings=SimpleNamespace(exit_with_parent=False, heartbeat_s=0.01),
            clock=asyncio.get_running_loop().time,
            heartbeat=beat,
            reconcile=lambda: reconciled.append(True),
            _relinking=asyncio.get_running_loop().create_future(),
            spawn=lambda coro: coro.close(),
        )
        node._relinking.set_result(None)
        node.relink = lambda: asyncio.sleep(0)
        try:
            await SwarmView.heartbeat_loop(node)
        except asyncio.CancelledError:
            pass

    asyncio.run(go())
    assert len(beats) == 3 and len(reconciled) == 1  # the second beat came, and reconciled


def test_the_learner_rate_is_read_from_a_copy_made_under_its_lock():
    """``steps_per_s`` and ``tokens_per_s`` run on the agent's thread while the learner's thread appends."""
    import threading
    from collections import deque

    from node.learner.loop import LearnerLoop

    loop = LearnerLoop.__new__(LearnerLoop)
    loop._rate, loop._rate_lock = deque([(float(i), 100 * i) for i in range(10)], maxlen=64), threading.Lock()
    assert loop.tokens_per_s() == 100.0 and loop.steps_per_s() == 1.0
    with loop._rate_lock:  # held by an append: a reader waits for it instead of iterating under it
        reader = threading.Thread(target=loop.steps_per_s)
        reader.start()
        reader.join(0.2)
        assert reader.is_alive()
    reader.join(5)
    assert not reader.is_alive()
