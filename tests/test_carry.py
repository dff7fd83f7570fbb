"""``ProtocolConfig.carry``: a learner left out of a merged round keeps its unmerged progress, and a round
holding part of the swarm's work moves the global by its share."""

from __future__ import annotations

import pytest
import torch

from node.learner.learner import InnerConfig, Learner
from protocol.config import ProtocolConfig
from protocol.goodput import compute_goodput
from protocol.replica import FragmentReplica
from protocol.synchroniser import Contribution, round_share


def _learner(tiny_task, carry: bool) -> Learner:
    torch.manual_seed(0)
    pcfg = ProtocolConfig(fragments=2, sync_every=4, overlap=1, carry=carry)
    return Learner("a", tiny_task, pcfg, InnerConfig(), 100, seed=3)


def _global_after(lrn: Learner, p: int, shift: float) -> dict[str, torch.Tensor]:
    return {n: t + shift for n, t in lrn.base[p].items()}


@pytest.mark.parametrize("carry", [True, False])
def test_a_round_without_this_learner_keeps_its_progress_only_with_carry(tiny_task, carry):
    lrn = _learner(tiny_task, carry)
    for _ in range(3):
        lrn.train_step()
    before = lrn.outer_gradient(0)  # base - theta: what this learner has not contributed yet
    counters = (lrn.book.counters[0].c_steps, lrn.book.counters[0].c_tokens)
    theta = _global_after(lrn, 0, 0.01)  # another learner's round moved the global fragment
    assert lrn.adopt(0, 1, theta, merged=[] if carry else None)
    after = lrn.outer_gradient(0)
    assert lrn.book.counters[0].base_round == 1
    if carry:  # the same progress, now measured from the new global; the counters still count it
        for n in before:
            torch.testing.assert_close(after[n], before[n], atol=1e-6, rtol=0)
        assert (lrn.book.counters[0].c_steps, lrn.book.counters[0].c_tokens) == counters
    else:  # overwritten: nothing left to contribute
        assert all(float(t.abs().max()) == 0.0 for t in after.values())
        assert lrn.book.counters[0].c_steps == 0
    # the other fragment is untouched either way
    assert lrn.book.counters[1].c_steps == 3


def _send(lrn: Learner, p: int) -> tuple[int, int]:
    lrn.snapshot(p, "t")
    [(tag, q, _)] = lrn.ready_contributions()
    assert (tag, q) == ("t", p)
    return lrn.book.counters[p].c_steps, lrn.book.counters[p].c_tokens


def test_its_own_round_keeps_the_steps_trained_since_it_contributed(tiny_task):
    lrn = _learner(tiny_task, carry=True)
    for _ in range(3):
        lrn.train_step()
    sent = _send(lrn, 0)
    at_send = {n: t.detach().clone() for n, t in lrn.params.items()}
    lrn.train_step()  # one more step before the merged round comes back
    since = {n: lrn.params[n].detach() - at_send[n] for n in lrn.plan.fragments[0].names}
    theta = _global_after(lrn, 0, 0.01)
    assert lrn.adopt(0, 1, theta, merged=[sent])
    for n, t in theta.items():  # the global, plus the step it has not seen
        torch.testing.assert_close(lrn.params[n].detach(), t + since[n], atol=1e-6, rtol=0)
    c = lrn.book.counters[0]
    assert (c.c_steps, c.c_tokens) == (1, lrn.tokens_per_step)
    assert not lrn.adopt(0, 1, theta, merged=[])  # an old round changes nothing
    # unknown what the round merged (a resync): the global overwrites
    assert lrn.adopt(0, 2, _global_after(lrn, 0, 0.01), merged=None)
    assert lrn.book.counters[0].c_steps == 0
    torch.testing.assert_close(lrn.outer_gradient(0)[n], torch.zeros_like(theta[n]))


def test_a_contribution_merged_after_another_round_is_counted_once(tiny_task):
    """Sent against round 0, round 1 (another learner's) arrives, then round 2 merges it: the learner ends at
    round 2's global plus only what it trained after sending, whatever order the frames moved in."""
    lrn = _learner(tiny_task, carry=True)
    for _ in range(3):
        lrn.train_step()
    sent = _send(lrn, 0)
    at_send = {n: t.detach().clone() for n, t in lrn.params.items()}
    lrn.train_step()
    since = {n: lrn.params[n].detach() - at_send[n] for n in lrn.plan.fragments[0].names}
    assert lrn.adopt(0, 1, _global_after(lrn, 0, 0.02), merged=[])
    theta2 = _global_after(lrn, 0, -0.03)
    assert lrn.adopt(0, 2, theta2, merged=[sent])
    for n, t in theta2.items():
        torch.testing.assert_close(lrn.params[n].detach(), t + since[n], atol=1e-6, rtol=0)
    # a round naming a contribution it does not remember (from before a restart) keeps its progress
    before = lrn.outer_gradient(0)
    assert lrn.adopt(0, 3, _global_after(lrn, 0, 0.01), merged=[(999, 1)])
    for n, d in lrn.outer_gradient(0).items():
        torch.testing.assert_close(d, before[n], atol=1e-6, rtol=0)


def _contribution(learner: str, steps: int, value: float) -> Contribution:
    delta = {"w": torch.full((4, 4), value)}
    return Contribution(learner, 0, 0, steps, steps * 10, 0.1, delta, cid=f"{learner}{steps}")


def test_round_share_scales_a_partial_round_and_caps_at_one():
    cfg = ProtocolConfig(sync_every=8, overlap=2, carry=True)
    one = [_contribution("a", 8, 0.1)]
    assert round_share(one, cfg, live=4) == pytest.approx(0.25)
    assert round_share(one * 4, cfg, live=4) == 1.0
    assert round_share([_contribution("a", 40, 0.1)], cfg, live=4) == 1.0
    assert round_share(one, cfg, live=0) == 1.0  # no membership known: a plain round

    def grad(carry: bool) -> torch.Tensor:
        c = ProtocolConfig(sync_every=8, overlap=2, carry=carry, record_codec="fp32", clip_factor=0)
        rep = FragmentReplica(0, {"w": torch.zeros(4, 4)}, is_embedding=False)
        return rep.make_record(1, one, c, live=4).grad["w"]

    torch.testing.assert_close(grad(True), grad(False) * 0.25)


def test_goodput_counts_carried_work_once_a_later_contribution_merges():
    recs = [{"kind": "run", "t0": 0.0, "t1": 12.0, "learners": ["a"], "shares": [1.0]}]
    recs += [{"kind": "step", "learner": "a", "step": s, "t0": s - 1.0, "t1": float(s)} for s in range(1, 13)]
    recs += [
        {"kind": "contribute", "learner": "a", "fragment": 0, "step": 4, "cid": "a4"},  # left out
        {"kind": "adopt", "learner": "a", "fragment": 0, "step": 5, "kept": True},  # carried past a round
        {"kind": "contribute", "learner": "a", "fragment": 0, "step": 8, "cid": "a8"},  # merged: 1-8 useful
        {"kind": "adopt", "learner": "a", "fragment": 0, "step": 8, "kept": False},  # its own round
        {"kind": "adopt", "learner": "a", "fragment": 0, "step": 10, "kept": False},  # overwrites 9-10
        {"kind": "merge", "fragment": 0, "round": 2, "cids": ["a8"]},
    ]
    g = compute_goodput(recs)
    assert g.useful_s == pytest.approx(8.0)
    assert g.dropped_s == pytest.approx(2.0)  # steps 9 and 10, overwritten before they were sent
    assert g.pending_s == pytest.approx(2.0)  # steps 11 and 12


def test_a_resync_onto_another_chain_keeps_the_learners_progress_with_carry(tiny_task):
    lrn = _learner(tiny_task, carry=True)
    for _ in range(3):
        lrn.train_step()
    before = lrn.outer_gradient(0)
    lrn.resync(0, 1, _global_after(lrn, 0, 0.5))  # the swarm settled on another chain's round 1
    assert lrn.kept and lrn.book.counters[0].c_steps == 3
    for n, d in lrn.outer_gradient(0).items():
        torch.testing.assert_close(d, before[n], atol=1e-6, rtol=0)


def test_a_learner_restored_after_a_crash_drops_what_it_had_not_merged(tiny_task):
    """Its checkpoint's unmerged progress may have been merged before the crash: it is not sent twice."""
    lrn = _learner(tiny_task, carry=True)
    for _ in range(3):
        lrn.train_step()
    _send(lrn, 0)
    state = {k: v.clone() for k, v in lrn.opt.state_dict()["state"][0].items()}
    lrn.drop_unmerged()
    assert all(float(d.abs().max()) == 0.0 for p in range(2) for d in lrn.outer_gradient(p).values())
    assert [c.c_steps for c in lrn.book.counters] == [0, 0] and lrn.sent == {}
    kept = lrn.opt.state_dict()["state"][0]
    assert all(torch.equal(kept[k], v) for k, v in state.items())  # AdamW state stays


def test_two_contributions_from_one_base_merged_in_successive_rounds_are_counted_once(tiny_task):
    """Regression: contribution A (4 steps) merges in round 1; B, sent later from the same base (8 steps,
    holding A's 4), merges in round 2. Once B is merged the learner holds only what it trained after B:
    the counters are 0, not the 12 (or +4) left when B's reduced counters no longer matched its record."""
    lrn = _learner(tiny_task, carry=True)
    for _ in range(4):
        lrn.train_step()
    a = _send(lrn, 0)
    for _ in range(4):
        lrn.train_step()
    b = _send(lrn, 0)
    at_b = {n: lrn.params[n].detach().clone() for n in lrn.plan.fragments[0].names}
    assert (a[0], b[0]) == (4, 8)
    assert lrn.adopt(0, 1, _global_after(lrn, 0, 0.01), merged=[a])
    assert lrn.book.counters[0].c_steps == 4  # B's own 4 steps are still the global's to get
    theta2 = _global_after(lrn, 0, 0.02)
    assert lrn.adopt(0, 2, theta2, merged=[b])  # the record names B by the counters it was sent with
    assert lrn.book.counters[0].c_steps == 0
    assert lrn.sent.get(0) == []
    for n, t in theta2.items():  # nothing trained after B: the learner holds the global exactly
        torch.testing.assert_close(lrn.params[n].detach(), t, atol=1e-6, rtol=0)
    del at_b


def test_clipping_scales_the_learners_own_outer_gradient_not_the_global_change_since_its_base():
    """Regression: a contribution taken against an older round is re-anchored as (Theta_now - base) + delta.
    The robust merge measures delta and must scale delta alone: the global's own movement since that base
    is no learner's to clip."""
    from protocol.norms import NormBook

    cfg = ProtocolConfig(fragments=1, sync_every=4, overlap=1, merge="mean", record_codec="fp32",
                         outer_lr=1.0, outer_momentum=0.0, clip_factor=3.0)  # fmt: skip
    rep = FragmentReplica(0, {"w": torch.zeros(100)}, False, norms=NormBook())
    honest = [
        Contribution(f"l{i}", 0, 0, 4, 40, 1.0, {"w": torch.full((100,), 0.01)}, f"c{i}") for i in range(3)
    ]
    rep.apply_record(rep.make_record(1, honest, cfg), cfg)  # the global moved to -0.01 everywhere
    ref = rep.norm_reference()
    big = Contribution("x", 0, 0, 4, 40, 1.0, {"w": torch.full((100,), 0.1)}, "x1")  # 10x, from round 0
    rec = rep.make_record(2, [big], cfg)
    assert rec.clipped == ("x1",)
    moved = rep.theta["w"] - rep.base(0)["w"]  # -0.01: the global's change since the learner's base
    own = torch.full((100,), 0.1) * (cfg.clip_factor * ref / float(torch.full((100,), 0.1).norm()))
    torch.testing.assert_close(rec.grad["w"], moved + own, atol=1e-6, rtol=0)
