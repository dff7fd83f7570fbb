"""Fragment planning, the staggered schedule, learner counters and the synchroniser state machine,
driven by hand with a fake clock."""

from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.config import ProtocolConfig
from protocol.errors import ConfigError, ProtocolError, RejectCode
from protocol.fragments import plan_fragments
from protocol.learner_book import LearnerBook
from protocol.synchroniser import (
    Contribution,
    Ema,
    Merge,
    Phase,
    SyncState,
    WakeAt,
    grace_window,
    on_contribution,
    on_membership,
    on_merged,
    on_tick,
    pending_learners,
)

SHAPES = {"emb": 1000, "a": 500, "b": 400, "c": 300, "d": 300, "e": 200, "f": 100, "g": 90}


def test_embedding_is_its_own_fragment_and_bins_balance():
    plan = plan_fragments(SHAPES, 4, 8, embedding="emb")
    assert plan.fragments[0].names == ("emb",) and plan.fragments[0].is_embedding
    sizes = sorted(f.numel for f in plan.fragments[1:])
    assert sum(sizes) == sum(SHAPES.values()) - 1000
    assert max(sizes) - min(sizes) <= 100  # greedy largest-first keeps bins close
    names = [n for f in plan.fragments for n in f.names]
    assert sorted(names) == sorted(SHAPES)  # every tensor exactly once


def test_more_fragments_than_tensors_is_refused_naming_the_value():
    with pytest.raises(ConfigError, match="fragments=9 .* only 8 parameter tensors"):
        plan_fragments(SHAPES, 9, 8)


@settings(max_examples=50, deadline=None)
@given(p=st.integers(1, 8), h=st.integers(1, 30))
def test_each_fragment_due_exactly_once_per_h_steps(p, h):
    plan = plan_fragments(SHAPES, p, h, embedding="emb")
    for start in (1, 5 * h + 3):
        counts = [0] * p
        for t in range(start, start + h):
            for f in plan.due(t):
                counts[f] += 1
        assert counts == [1] * p


def test_offsets_spread_evenly_with_p_equal_h():
    plan = plan_fragments({f"t{i}": 10 for i in range(6)}, 6, 6)
    assert sorted(f.offset for f in plan.fragments) == list(range(6))


def test_learner_counters_count_since_last_receipt():
    plan = plan_fragments(SHAPES, 2, 4)
    book = LearnerBook(plan)
    due = [book.on_step(100) for _ in range(4)]
    assert [d for d in due if d]  # something became due
    assert book.counters[0].c_steps == 4 and book.counters[0].c_tokens == 400
    assert book.on_receive(0, 1)
    assert book.counters[0].c_steps == 0 and book.counters[0].base_round == 1
    assert book.counters[1].c_steps == 4  # other fragment untouched
    assert not book.on_receive(0, 1)  # the same round twice is ignored


def contrib(learner, steps=4, tokens=400, base=0, step_time=1.0):
    return Contribution(learner, 0, base, steps, tokens, step_time, {}, f"{learner}-{base}")


CFG = ProtocolConfig(
    fragments=1, sync_every=8, overlap=2, quorum=2, grace=True, grace_gamma=0.5, ema_beta=0.0
)


def live(*names):
    return SyncState(fragment=0, live=frozenset(names))


def test_waits_for_quorum_then_grace_then_merges_on_tick():
    s = live("a", "b", "c")
    d = on_contribution(CFG, s, contrib("a"), now=0.0)
    assert d.state.phase is Phase.COLLECTING and not d.actions and "quorum 1/2" in d.reason
    d = on_contribution(CFG, d.state, contrib("b"), now=0.5)
    # grace = 0.5 * (2 * 1.0 - 0.5 - 0) = 0.75
    assert d.state.phase is Phase.GRACE and d.actions == (WakeAt(1.25),), d.reason
    assert on_tick(CFG, d.state, 1.0).actions == (WakeAt(1.25),)
    d = on_tick(CFG, d.state, 1.25)
    (m,) = d.actions
    assert isinstance(m, Merge) and m.round == 1 and [c.learner for c in m.contributions] == ["a", "b"]


def test_merges_early_when_every_live_learner_is_in():
    s = live("a", "b")
    d = on_contribution(CFG, s, contrib("a"), 0.0)
    d = on_contribution(CFG, d.state, contrib("b"), 0.1)
    assert isinstance(d.actions[0], Merge) and "every live learner" in d.reason


def test_late_contribution_is_left_out_and_queued_for_next_round():
    s = live("a", "b", "c")
    d = on_contribution(CFG, s, contrib("a"), 0.0)
    d = on_contribution(CFG, d.state, contrib("b"), 0.0)
    d = on_tick(CFG, d.state, 10.0)
    assert d.state.phase is Phase.MERGING
    d = on_contribution(CFG, d.state, contrib("c"), 10.1)
    assert d.actions == () and "queued" in d.reason
    d = on_merged(CFG, d.state, 10.2, sync_s=0.2)
    assert d.state.global_round == 1 and pending_learners(d.state) == {"c"}


def test_quorum_never_exceeds_live_learners():
    s = live("a")
    d = on_contribution(CFG.__class__(**{**vars(CFG), "grace": False}), s, contrib("a"), 0.0)
    assert isinstance(d.actions[0], Merge)


def test_dead_learner_leaving_the_live_set_completes_the_round():
    s = live("a", "b", "c")
    d = on_contribution(CFG, s, contrib("a"), 0.0)
    d = on_contribution(CFG, d.state, contrib("b"), 0.0)
    assert isinstance(d.actions[0], WakeAt)
    d = on_membership(CFG, d.state, frozenset({"a", "b"}), 0.1)
    assert isinstance(d.actions[0], Merge)


@pytest.mark.parametrize(
    "bad,code",
    [
        (contrib("a", steps=0), RejectCode.BAD_COUNTERS),
        (contrib("a", base=5), RejectCode.FUTURE_BASE),
        (Contribution("a", 3, 0, 1, 1, 1.0, {}), RejectCode.WRONG_FRAGMENT),
    ],
)
def test_bad_contributions_are_refused_and_change_nothing(bad, code):
    s = live("a", "b")
    with pytest.raises(ProtocolError) as e:
        on_contribution(CFG, s, bad, 0.0)
    assert e.value.code is code
    assert s.pending == MappingProxyType({})


def test_stale_base_refused():
    s = SyncState(fragment=0, global_round=40, live=frozenset({"a"}))
    with pytest.raises(ProtocolError) as e:
        on_contribution(CFG, s, contrib("a", base=3), 0.0)
    assert e.value.code is RejectCode.STALE_BASE


@settings(max_examples=200, deadline=None)
@given(
    step=st.floats(0, 100),
    quorum=st.floats(0, 100),
    sync=st.floats(0, 100),
    tau=st.integers(0, 5),
    gamma=st.floats(0, 0.99),
)
def test_grace_window_never_exceeds_its_bound(step, quorum, sync, tau, gamma):
    cfg = ProtocolConfig(fragments=1, sync_every=8, overlap=tau, grace_gamma=gamma)
    s = SyncState(fragment=0, xi_step=Ema(step), xi_quorum=Ema(quorum), xi_sync=Ema(sync))
    g = grace_window(cfg, s)
    assert 0.0 <= g <= gamma * tau * step + 1e-9
    assert g <= max(0.0, gamma * (tau * step - quorum - sync)) + 1e-9


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"overlap": 24, "sync_every": 24}, "overlap=24"),
        ({"codec": "int3"}, "codec='int3'"),
        ({"quorum": 0}, "quorum=0"),
        ({"merge": "median"}, "merge='median'"),
    ],
)
def test_bad_config_names_the_value(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ProtocolConfig(**kwargs)


def test_k_larger_than_m_and_p_larger_than_tensors():
    cfg = ProtocolConfig(quorum=5)
    with pytest.raises(ConfigError, match="quorum=5"):
        cfg.check_swarm(learners=4, tensors=100)
    with pytest.raises(ConfigError, match="fragments=24"):  # P set by the user is refused
        ProtocolConfig(fragments=24).check_swarm(learners=4, tensors=10)
    # the default takes one fragment a tensor when the model has fewer than 24, and says so
    auto = ProtocolConfig()
    auto.check_swarm(learners=4, tensors=10)
    assert auto.fragments_for(10) == 10 and auto.fragments_for(100) == 24


def test_a_departed_learners_contribution_does_not_fill_a_live_quorum_slot():
    cfg = ProtocolConfig(fragments=1, sync_every=8, overlap=2, quorum=3, grace=False)
    s = live("a", "b", "c")
    d = on_contribution(cfg, s, contrib("c"), 0.0)
    d = on_membership(cfg, d.state, frozenset({"a", "b"}), 0.1)  # c went down after sending
    d = on_contribution(cfg, d.state, contrib("a"), 0.2)
    assert not d.actions, d.reason  # live quorum is 2 (a, b); only a is in
    d = on_contribution(cfg, d.state, contrib("b"), 0.3)
    (m,) = d.actions
    assert [c.learner for c in m.contributions] == ["a", "b", "c"]  # c's real work is still merged
