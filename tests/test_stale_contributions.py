"""A contribution taken against an old round never joins a merge: re-anchored at the current global
fragment, it would undo every round merged since (found in a parity run: two step-1 contributions, carried
from round to round by a node that was not their synchroniser, merged alone 50 s later and set the
position embedding back to the model's first step; the eval loss went from 1.27 to 2.96)."""

from dataclasses import replace

import torch

from protocol.config import ProtocolConfig
from protocol.synchroniser import (
    Merge,
    Phase,
    SyncState,
    carried,
    on_contribution,
    on_merged,
    on_tick,
    pending_learners,
)


def _c(learner: str, base: int, cid: str = "") -> "object":
    from protocol.synchroniser import Contribution

    return Contribution(learner, 0, base, 4, 40, 1.0, {"w": torch.zeros(1)}, cid or f"{learner}:{base}")


def _sched(global_round: int, **kw) -> SyncState:
    """A synchroniser state on the swarm's schedule (a slot far ahead: nothing opens by the clock)."""
    return replace(SyncState(fragment=0, global_round=global_round, **kw), due_at=1e9, due_every=1e6)


def test_one_round_behind_is_carried_two_are_not():
    st = _sched(5)
    assert carried(_c("a", 4), st)
    assert carried(_c("a", 5), st)
    assert not carried(_c("a", 3), st)


def test_with_rounds_on_arrival_only_the_history_bounds_a_base():
    # no schedule: a fragment takes a round per arrival, so a base several rounds back is normal
    assert carried(_c("a", 1), SyncState(fragment=0, global_round=5))


def test_an_old_contribution_is_left_out_on_arrival_without_an_error():
    cfg = ProtocolConfig(quorum=1, grace=False)
    st = _sched(5, live=frozenset({"a"}))
    d = on_contribution(cfg, st, _c("a", 2), now=1.0)
    assert d.state.pending == {} and d.actions == ()
    assert "left out" in d.reason


def test_a_queued_contribution_is_carried_one_round_and_no_further():
    cfg = ProtocolConfig(quorum=2, grace=False)
    live = frozenset({"a", "b", "c"})
    # b's contribution to round 2 (taken against round 1) arrives while round 2 merges: it joins round 3
    due = (1e9, 1e6)  # the next round's slot, far ahead
    st = replace(_sched(1, live=live), phase=Phase.MERGING)
    st = on_contribution(cfg, st, _c("b", 1), now=1.0).state
    st = on_merged(cfg, st, now=1.1, sync_s=0.1, due=due).state
    assert pending_learners(st) == {"b"}
    # one taken against round 1 that arrives while round 3 merges is two behind once it has: let go
    st = replace(_sched(2, live=live), phase=Phase.MERGING)
    st = on_contribution(cfg, st, _c("b", 1), now=2.0).state
    assert {learner for learner, _ in st.queued} == {"b"}
    st = on_merged(cfg, st, now=2.1, sync_s=0.1, due=due).state
    assert st.global_round == 3 and "b" not in pending_learners(st)
    # and round 4 merges the fresh ones only (at its slot)
    st = on_contribution(cfg, st, _c("a", 3), now=3.0).state
    st = on_contribution(cfg, st, _c("c", 3), now=3.1).state
    d = on_tick(cfg, st, 1e9)
    (m,) = [x for x in d.actions if isinstance(x, Merge)]
    assert sorted(c.learner for c in m.contributions) == ["a", "c"]


def test_a_straggler_carried_over_is_not_replaced_by_its_learners_next_contribution():
    """A learner's contribution that missed round r (taken against r - 1) is carried into round r + 1.
    The learner adopted round r meanwhile, so its next contribution counts only the steps since: it holds
    other work and must not replace the straggler (seen in a chaos run: 2.7% of all steps sent were lost
    so, most of them 0-0.5 s late for their round). A second contribution against the *same* round counts
    the first one's steps too, and replaces it."""
    cfg = ProtocolConfig(quorum=2, grace=False)
    st = _sched(5, live=frozenset({"a", "b"}))
    st = on_contribution(cfg, st, _c("a", 4, "a-late"), now=1.0).state  # carried: one round behind
    st = on_contribution(cfg, st, _c("a", 5, "a-first"), now=2.0).state
    st = on_contribution(cfg, st, _c("a", 5, "a-again"), now=3.0).state  # the same base: replaces a-first
    assert sorted(c.cid for c in st.pending.values()) == ["a-again", "a-late"]
    assert pending_learners(st) == {"a"}  # one learner: no quorum of 2 with a alone
    d = on_tick(cfg, replace(st, due_at=3.5), 4.0)
    assert not any(isinstance(x, Merge) for x in d.actions)
    d = on_contribution(cfg, d.state, _c("b", 5, "b"), now=4.1)
    (m,) = [x for x in d.actions if isinstance(x, Merge)]
    assert [c.cid for c in m.contributions] == ["a-late", "a-again", "b"]
