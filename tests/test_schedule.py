"""The swarm's round schedule (protocol.schedule): every node derives the same round moments from the same
records, a slot is contributed to once, and a round that does not merge in time is due again."""

from __future__ import annotations

import pytest
import torch

from dht.identity import Identity
from node.swarm.wire import FragmentState, decode_record, decode_snapshot, encode_record, encode_snapshot
from protocol.config import ProtocolConfig
from protocol.fragments import Fragment, FragmentPlan
from protocol.replica import FragmentReplica
from protocol.schedule import RoundClock, SlotBook, next_clock, round_due, swarm_clocks, swarm_period
from protocol.synchroniser import Contribution, Phase, SyncState, on_contribution, scheduled

H = 8


def _replica() -> FragmentReplica:
    return FragmentReplica(0, {"w": torch.zeros(4)}, is_embedding=False)


def _record(rep: FragmentReplica, due: float, period: float, cfg: ProtocolConfig):
    c = Contribution("a", 0, rep.round, 3, 30, 0.1, {"w": torch.full((4,), 0.01)}, cid=f"a:{due}")
    return rep.make_record(rep.round + 1, [c], cfg, live=1, due=due, period=period)


def test_every_replica_derives_the_same_next_round_from_the_same_record():
    cfg = ProtocolConfig(fragments=1, sync_every=H, codec="fp32", record_codec="fp32")
    maker, other = _replica(), _replica()
    assert maker.clock is None and other.clock is None  # round 0: no record says when round 1 is due
    rec = _record(maker, due=100.0, period=0.5, cfg=cfg)
    maker.apply_record(rec, cfg)
    # The other replica gets the record over the wire, signed.
    ident = Identity.generate()
    raw = encode_record("s", rec, ident)
    other.apply_record(decode_record(raw, "s", {0: {"w": (4,)}}).record, cfg)
    assert maker.clock == other.clock == RoundClock(2, 100.0 + H * 0.5, H * 0.5)


def test_the_clock_comes_with_a_snapshot_and_a_bad_one_is_dropped():
    cfg = ProtocolConfig(fragments=1, sync_every=H, codec="fp32", record_codec="fp32")
    rep = _replica()
    rep.apply_record(_record(rep, due=10.0, period=1.0, cfg=cfg), cfg)
    st = FragmentState(0, rep.round, rep.hash, 1, 1.0, rep.theta, rep.momentum, 0, rep.clock)
    (back,) = decode_snapshot(encode_snapshot([st]), {0: {"w": (4,)}})
    fresh = _replica()
    fresh.load_state(back.round, back.theta, back.momentum, back.clock)
    assert fresh.clock == rep.clock
    bad = FragmentState(0, rep.round, rep.hash, 1, 1.0, rep.theta, rep.momentum, 0, RoundClock(2, 5.0, -1.0))
    (back,) = decode_snapshot(encode_snapshot([bad]), {0: {"w": (4,)}})
    assert back.clock is None  # never trusted: the learners fall back to their steps until a record


def test_a_slot_is_taken_once_and_a_round_that_does_not_merge_is_due_again():
    clock = RoundClock(5, first=100.0, every=4.0)
    book = SlotBook()
    assert not book.due(0, clock, 97.0, lead=0.5)  # too early
    assert book.due(0, clock, 99.6, lead=0.5)  # within half a step of the slot: the nearest step end
    assert not book.due(0, clock, 100.2, lead=0.5)  # that slot is taken: the round never opens twice
    assert not book.due(0, clock, 102.0, lead=0.5)
    assert book.due(0, clock, 103.6, lead=0.5)  # round 5 did not merge: its next slot
    assert not book.due(0, clock, 103.9, lead=0.5)
    nxt = RoundClock(6, first=112.0, every=4.0)  # round 5 merged at slot 1
    assert book.due(0, nxt, 111.7, lead=0.5)
    assert not book.due(1, None, 200.0, lead=0.5)  # no clock: nothing from the schedule
    # the fragment resynced to an older head of another chain: its clock's round is below the slots taken
    older = RoundClock(2, first=130.0, every=4.0)
    assert not book.due(0, older, 129.8, lead=0.5)  # an older clock never takes a slot by itself
    book.forget(0)
    assert book.due(0, older, 129.8, lead=0.5)  # once the chain is replaced, its slots are the ones to take


def test_the_synchroniser_snaps_the_round_to_the_slot_its_contributions_came_for():
    clock = RoundClock(3, first=50.0, every=10.0)
    assert round_due(clock, 50.3) == 50.0
    assert round_due(clock, 49.0) == 50.0
    assert round_due(clock, 60.4) == 60.0  # the round's second slot
    assert round_due(None, 12.5) == 12.5  # the first round: its first contribution's time
    # A round taken long before its slot (its learners sent by their steps, with no clock yet) is due
    # when it was taken: the slot ahead, written into its record, would push the next round a repeat on.
    assert round_due(clock, 42.0) == 42.0


def test_the_period_is_the_median_and_a_liar_cannot_move_it():
    assert swarm_period([0.1, 0.12, 0.11], fallback=1.0) == 0.11
    assert swarm_period([0.1, 0.12, 1e9], fallback=1.0) == 0.12
    assert swarm_period([], fallback=0.2) == 0.2
    assert swarm_period([float("nan"), -1.0], fallback=0.3) == 0.3
    assert next_clock(4, 10.0, 0.0, H) is None  # a record without a schedule
    assert next_clock(4, 10.0, 1e12, H).every == H * 3600.0  # clamped


def test_a_period_moves_at_most_a_factor_per_record():
    from protocol.schedule import PERIOD_STEP, bounded_period

    clock = RoundClock(3, first=10.0, every=H * 0.5)  # the last record's period: 0.5 s
    assert bounded_period(0.6, clock, H) == 0.6
    assert bounded_period(30.0, clock, H) == 0.5 * PERIOD_STEP  # a first step's warm-up, or a lie
    assert bounded_period(1e-4, clock, H) == 0.5 / PERIOD_STEP
    assert bounded_period(30.0, None, H) == 30.0  # no record yet: nothing to hold it to


def _c(learner: str, cid: str = "", base: int = 0) -> Contribution:
    return Contribution(learner, 0, base, 4, 40, 1.0, {"w": None}, cid or learner)


def test_a_round_on_the_schedule_does_not_open_before_its_slot_and_its_grace_runs_from_it():
    from dataclasses import replace

    from protocol.synchroniser import Merge, SyncState, WakeAt, on_contribution, on_tick

    cfg = ProtocolConfig(quorum=1, grace=True, overlap=2)
    live = frozenset({"a", "b", "c"})
    st = replace(SyncState(fragment=0, global_round=3, live=live), due_at=100.0, due_every=50.0)
    # A contribution left over from the round before (late for it: taken against round 2) arrives long
    # before this round's slot: it waits, and opens nothing.
    d = on_contribution(cfg, st, _c("a", "a-late", base=2), now=60.0)
    assert not any(isinstance(x, Merge) for x in d.actions)
    assert d.actions == (WakeAt(98.0),)  # the round opens two steps (xi_step = 1 s) before its slot
    st = on_tick(cfg, d.state, 98.0).state
    # K = 1 is reached at once, but the grace window runs from the slot, not from the quorum
    assert st.deadline is not None and st.deadline >= 100.0
    d = on_contribution(cfg, st, _c("b", base=3), now=99.2)  # learners on time: their last step before it
    d = on_contribution(cfg, d.state, _c("c", base=3), now=99.5)
    # b and c are in and a's pending one is the leftover: that is not a's contribution to this round
    assert not any(isinstance(x, Merge) for x in d.actions), d.reason
    d = on_contribution(cfg, d.state, _c("a", "a-now", base=3), now=99.9)  # a's own: everyone is in
    (m,) = [x for x in d.actions if isinstance(x, Merge)]
    # a's leftover holds other steps than its own contribution to this round (a adopted round 3 in
    # between): both are merged, the newer does not replace the older
    assert [c.cid for c in m.contributions] == ["a-late", "a-now", "b", "c"]


def test_a_leftover_is_merged_when_its_learner_sends_nothing_newer():
    from dataclasses import replace

    from protocol.synchroniser import Merge, SyncState, on_contribution, on_tick

    cfg = ProtocolConfig(quorum=1, grace=True, overlap=2)
    st = replace(
        SyncState(fragment=0, global_round=3, live=frozenset({"a", "b"})), due_at=100.0, due_every=50.0
    )
    d = on_contribution(cfg, st, _c("a", "a-late", base=2), now=60.0)
    d = on_tick(cfg, d.state, 98.0)
    d = on_contribution(cfg, d.state, _c("b", base=3), now=99.5)
    assert not any(isinstance(x, Merge) for x in d.actions)
    deadline = d.state.deadline
    d = on_tick(cfg, d.state, deadline)  # the grace window is over: the leftover's work is merged
    (m,) = [x for x in d.actions if isinstance(x, Merge)]
    assert [c.cid for c in m.contributions] == ["a-late", "b"]


def test_a_round_that_missed_its_slot_is_taken_at_the_next():
    from dataclasses import replace

    from protocol.synchroniser import SyncState, on_contribution, slot_due

    cfg = ProtocolConfig(quorum=2, grace=False)
    st = replace(SyncState(fragment=0, live=frozenset({"a", "b"})), due_at=100.0, due_every=50.0)
    assert slot_due(st, 90.0) == 100.0
    assert slot_due(st, 140.0) == 150.0  # nearest slot: the round is due again
    d = on_contribution(cfg, st, _c("a"), now=140.0)  # before slot 150's opening: waits
    assert "opens at 148" in d.reason


def test_a_peers_schedule_is_bounded_before_anyone_uses_it():
    from protocol.schedule import MAX_PERIOD_S, MIN_PERIOD_S, sane_clock, usable

    # A snapshot's clock with a denormal repeat would overflow every slot computation: held to the bounds.
    c = sane_clock(RoundClock(3, 100.0, 5e-324), H)
    assert c.every == H * MIN_PERIOD_S and c.slot_at(1e9) is not None
    assert sane_clock(RoundClock(3, 100.0, 1e300), H).every == H * MAX_PERIOD_S
    assert sane_clock(RoundClock(3, float("inf"), 1.0), H) is None
    # A clock whose first slot is far ahead (a writer's clock far off, or a lie) is not followed.
    assert usable(RoundClock(3, 1000.0, 10.0), now=900.0) is None
    assert usable(RoundClock(3, 1000.0, 10.0), now=985.0) is not None
    # Receivers hold a record's period within a factor of the clock they had, as the writer should have.
    cfg = ProtocolConfig(fragments=1, sync_every=H, codec="fp32", record_codec="fp32")
    rep = _replica()
    rep.apply_record(_record(rep, due=10.0, period=1.0, cfg=cfg), cfg)
    rep.apply_record(_record(rep, due=rep.clock.first, period=1e-3, cfg=cfg), cfg)
    assert rep.clock.every == H * 0.5


def test_a_round_in_its_grace_window_does_not_go_back_to_waiting_for_a_slot():
    from dataclasses import replace

    from protocol.synchroniser import Merge, SyncState, on_contribution, on_tick

    cfg = ProtocolConfig(quorum=1, grace=True, overlap=2)
    st = replace(SyncState(fragment=0, live=frozenset({"a", "b"})), due_at=100.0, due_every=4.0)
    d = on_contribution(cfg, st, _c("a"), now=99.5)
    assert d.state.quorum_at == 99.5
    # Past the midpoint to the next slot (102), the round keeps its grace window and merges at its deadline.
    d = on_tick(cfg, d.state, max(102.5, d.state.deadline))
    assert any(isinstance(x, Merge) for x in d.actions)


def test_a_first_period_is_held_to_the_step_times_the_rounds_learners_report():
    from protocol.schedule import held_to_steps

    # Rates measured over a slow start said 3 s a step; the learners in the round report 0.3 s.
    assert held_to_steps(3.0, [0.3, 0.31, 0.29]) == 0.6
    assert held_to_steps(0.3, [0.3, 0.31]) == 0.3
    assert held_to_steps(3.0, []) == 3.0


def test_a_records_period_is_the_measured_one_and_none_before_any_learner_has_a_measure():
    """One rule for the node and the runner (``record_period``): until some live learner has
    ``RATE_MIN_STEPS`` steps measured a record carries no schedule (or its clock's), then the median of the
    measures, held to the clock and to what the round's learners report."""
    from protocol.schedule import RATE_MIN_STEPS, measured_period, record_period

    ends = [0.5 * k for k in range(RATE_MIN_STEPS)]
    assert measured_period(ends[:-1]) == 0.0  # one step short of a measure
    assert measured_period(ends) == 0.5
    assert measured_period([4.5, 11.4] + [11.4 + 0.9 * k for k in range(1, 100)]) == pytest.approx(0.9)
    assert record_period([0.0, 0.0], None, H, [4.0]) == 0.0  # no measure, no clock: no schedule yet
    clock = RoundClock(3, 10.0, H * 0.5)
    assert record_period([0.0], clock, H, [0.5]) == 0.5  # no measure: the clock's own period
    assert record_period([0.4, 0.5, 9.0], clock, H, [0.5, 0.5]) == 0.5  # the median
    assert record_period([4.0], None, H, [0.3]) == 0.6  # a slow start's measure held to the reports


def _plan(n: int, h: int) -> FragmentPlan:
    return FragmentPlan(tuple(Fragment(i, (f"w{i}",), 4, False, (i * h) // n) for i in range(n)), h)


def test_a_fragment_with_no_record_takes_the_staggers_slot_from_the_newest_clock():
    plan = _plan(4, 8)  # offsets 0, 2, 4, 6; period 0.5 s, so a round every 4 s
    old = RoundClock(2, first=104.0, every=4.0)  # fragment 0: round 1 at 100, round 2 due at 104
    newest = RoundClock(2, first=105.0, every=4.0)  # fragment 1: round 1 at 101, round 2 due at 105
    clocks = swarm_clocks([old, newest, None, None], [1, 1, 0, 0], plan, now=101.5)
    assert clocks[:2] == [old, newest]  # a fragment's own clock is kept
    # from fragment 1's last round (101), two and four steps of 0.5 s on: round 1 of fragments 2 and 3
    assert clocks[2:] == [RoundClock(1, 102.0, 4.0), RoundClock(1, 103.0, 4.0)]
    # The order of the records a node got them in does not matter: only which it holds.
    assert swarm_clocks([old, newest, None, None], [1, 1, 0, 0], plan, now=101.5) == clocks
    # around the stagger: the newest clock is fragment 3's (offset 6, last round at 199)
    c3 = RoundClock(4, first=203.0, every=4.0)
    assert swarm_clocks([None, None, None, c3], [0, 2, 2, 3], plan, now=200.0)[:2] == [
        RoundClock(1, 200.0, 4.0),
        RoundClock(3, 201.0, 4.0),
    ]
    assert swarm_clocks([None] * 4, [0] * 4, plan, now=0.0) == [None] * 4  # no schedule anywhere: by steps
    # A clock far ahead of now (a lie, or a runaway) gives no slots: the next newest does.
    liar = RoundClock(2, first=10_000.0, every=4.0)
    assert swarm_clocks([old, liar, None, None], [1, 1, 0, 0], plan, now=101.5)[2:] == [
        RoundClock(1, 102.0, 4.0),
        RoundClock(1, 103.0, 4.0),
    ]


def test_an_idle_round_takes_a_slot_and_one_under_way_keeps_its_own():
    st = SyncState(fragment=2, live=frozenset({"a", "b"}))
    timed = scheduled(st, (102.0, 4.0))
    assert (timed.due_at, timed.due_every) == (102.0, 4.0)
    assert scheduled(st, None) is st
    c = Contribution("a", 2, 0, 3, 30, 0.5, {"w": torch.zeros(4)}, cid="a:1")
    busy = on_contribution(ProtocolConfig(fragments=4, sync_every=8), st, c, now=50.0).state
    assert busy.pending and busy.phase in (Phase.COLLECTING, Phase.GRACE)
    assert scheduled(busy, (102.0, 4.0)) is busy


def test_a_fragment_on_the_stagger_slot_is_due_every_repeat_while_its_reference_moves_on():
    """Before a fragment's first record its clock is the stagger's, re-anchored at the newest round of
    another fragment: the slot indices restart at every record of that fragment. A learner must still
    contribute once a repeat (under K = M a first round that missed a learner waited for the next slot,
    which never came: one fragment went 560 s without a round in a chaos run)."""
    plan = _plan(4, H)
    book, taken, step_s = SlotBook(), [], 0.5
    ref_first = 100.0  # fragment 0's clock: its round r due at ref_first, every H steps of 0.5 s
    every = H * step_s
    now = 90.0
    while now < 100.0 + 6 * every:
        while ref_first + every <= now:  # fragment 0 merges on time: its clock moves to the next round
            ref_first += every
        r0 = int((ref_first - 100.0) / every) + 3
        clocks = swarm_clocks(
            [RoundClock(r0, ref_first, every), None, None, None], [r0 - 1, 0, 0, 0], plan, now
        )
        if book.due(2, clocks[2], now, step_s):
            taken.append(now)
        now += step_s
    assert len(taken) >= 6, taken  # once a repeat, not once and never again
    assert all(b - a >= every - 2 * step_s for a, b in zip(taken, taken[1:])), taken  # and never twice a slot


def test_a_fragment_with_no_clock_gets_a_slot_every_repeat_while_the_others_phases_disagree():
    """After the start-up the clocked fragments are off the stagger by phases of their own (their first
    records were taken at the learners' step counts). The stagger slot of a fragment with no clock must
    still come once a repeat: when the reference was the newest clock anywhere, each record elsewhere
    could push the slot further ahead (one fragment went 60-90 s without a slot in chaos runs)."""
    import random

    n, h, step_s = 8, 8, 0.5
    every = h * step_s
    plan = _plan(n, h)
    phase = [0.0, 0.8, -0.4, 1.2, 0.3, -1.0, 1.6]
    for seed in range(3):
        rng = random.Random(seed)
        merged = {  # fragment q's rounds: (when merged, round), its phase plus a little noise per round
            q: [(q * step_s + r * every + phase[q] + rng.uniform(-0.2, 0.2), r) for r in range(1, 40)]
            for q in range(n - 1)
        }
        book, taken, now = SlotBook(), [], 10.0
        while now < 10.0 + 20 * every:
            latest = [max(m for m in merged[q] if m[0] <= now) for q in range(n - 1)]
            clocks = [RoundClock(r + 1, t + every, every) for t, r in latest]
            got = swarm_clocks([*clocks, None], [r for _, r in latest] + [1], plan, now)
            assert got[: n - 1] == clocks
            if book.due(n - 1, got[n - 1], now, step_s):
                taken.append(now)
            now += step_s
        gaps = [b - a for a, b in zip(taken, taken[1:])][1:]  # the first: the slot already up at 10 s
        assert len(taken) >= 20, (seed, taken)
        assert max(gaps) <= every + 2 * step_s and min(gaps) >= every - 2 * step_s, (seed, gaps)


def test_a_learner_that_resyncs_a_fragment_forgets_its_taken_slots():
    """The loop's wiring of ``SlotBook.forget``: a forced adoption (a resync onto another chain) frees the
    fragment's slots; an ordinary adoption keeps them."""
    from collections import deque
    from types import SimpleNamespace

    from node.learner.loop import LearnerLoop

    calls = []
    loop = LearnerLoop.__new__(LearnerLoop)
    loop.learner = SimpleNamespace(
        resync=lambda *a: calls.append(("resync", a[:2])),
        adopt=lambda *a: calls.append(("adopt", a[:2])) or True,
        kept=False,
        steps=3,
        sharded=False,
    )
    loop.node = SimpleNamespace(events=SimpleNamespace(emit=lambda *a, **k: None), peer_id="me")
    loop.requests, loop.slots = deque(), SlotBook()
    loop.slots.taken = {0: (94, 500.0), 1: (40, 480.0)}
    loop.inbox = deque([(1, 41, {}, False, []), (0, 72, {}, True, [])])
    adopted, asks = loop._service()
    assert adopted == [1, 0] and asks == []
    assert calls == [("adopt", (1, 41)), ("resync", (0, 72))]
    assert loop.slots.taken == {1: (40, 480.0)}  # fragment 0's slots forgotten, fragment 1's kept


def _run_chains(clocks: list[RoundClock], plan: FragmentPlan, merges: int, steer: bool) -> list[float]:
    """Merge the fragments' rounds in due order, each at its slot with the swarm's step period 1.0; the dues
    of the last round of every fragment."""
    from protocol.schedule import steered_period

    clocks = list(clocks)
    dues: list[float] = []
    for _ in range(merges):
        p = min(range(len(clocks)), key=lambda q: clocks[q].first)
        due = clocks[p].first
        period = steered_period(1.0, due, p, clocks, plan) if steer else 1.0
        assert 0.5 <= period <= 1.5
        clocks[p] = next_clock(clocks[p].round, due, period, plan.sync_every, before=clocks[p])
        dues.append(due)
    return sorted(dues[-len(clocks) :])


def test_rounds_bunched_by_a_change_of_pace_come_back_to_one_fragment_a_step():
    """Eight fragments, H = 8: one falls due each step when staggered. Started bunched (all eight within one
    step, as a slow start-up left them at 124M), steered periods spread them back out within a few rounds;
    on unsteered chains they stay bunched."""
    plan = FragmentPlan(tuple(Fragment(p, (f"t{p}",), 1, False, p) for p in range(8)), H)
    bunched = [RoundClock(1, 100.0 + 0.1 * p, H * 1.0) for p in range(8)]
    steered = _run_chains(bunched, plan, 8 * 12, steer=True)
    gaps = [b - a for a, b in zip(steered, steered[1:])]
    assert min(gaps) > 0.7 and max(gaps) < 1.3, gaps  # a step apart, give or take
    plain = _run_chains(bunched, plan, 8 * 12, steer=False)
    assert plain[-1] - plain[0] < 1.0  # still all within one step


def test_the_record_timing_and_phase_rules_the_node_and_the_runner_share():
    """``record_timing`` is the slot nearest the round's moment and the held, steered period; the learner's
    alignment waits at most 2 s and moves only forward; a round's moment is its quorum's, else its first
    contribution's, else now."""
    from protocol.schedule import aligned_step, in_phase_step, record_period, record_timing, steered_period
    from protocol.synchroniser import taken_at

    plan = _plan(4, 8)
    clocks = [RoundClock(3, 100.0, 4.0), RoundClock(2, 101.0, 4.0), None, None]
    due, period = record_timing(1, clocks, 105.2, [0.5, 0.55, 0.0], [0.52], 8, plan)
    assert due == round_due(clocks[1], 105.2) == 105.0
    assert period == steered_period(
        record_period([0.5, 0.55, 0.0], clocks[1], 8, [0.52]), due, 1, clocks, plan
    )
    assert record_timing(2, clocks, 7.0, [], [], 8, plan)[0] == 7.0  # no clock of its own: the moment itself

    assert aligned_step(None, 0.5) is None
    assert aligned_step(12.25, 0.5) == (13, 0.375)
    assert aligned_step(12.0, 0.5) == (12, 0.0)
    assert aligned_step(2.1, 10.0) == (3, 2.0)  # at most 2 s
    assert in_phase_step(None, 4) is None and in_phase_step(4.4, 4) is None and in_phase_step(3.0, 9) is None
    assert in_phase_step(4.5, 4) == 4  # half a step: Python rounds half to even (as before these were shared)
    assert in_phase_step(7.6, 4) == 8

    st = SyncState(0, 3)
    assert taken_at(st, 9.0) == 9.0
    assert taken_at(SyncState(0, 3, first_at=5.0), 9.0) == 5.0
    assert taken_at(SyncState(0, 3, first_at=5.0, quorum_at=6.0), 9.0) == 6.0
