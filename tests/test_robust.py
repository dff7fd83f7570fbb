"""Defence against bad updates: bounds, the robust merge, scores and bans, replays."""

from __future__ import annotations

import pytest
import torch

from node.common.events import EventLog
from node.learner.learner import InnerConfig
from node.local.run_config import LearnerPlan, RunConfig
from node.local.runner import run_system
from node.swarm.trust.peer_scores import PeerScores
from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError, RejectCode
from protocol.norms import NormBook
from protocol.replica import FragmentReplica
from protocol.synchroniser import Contribution


def _rep(norms: NormBook) -> FragmentReplica:
    return FragmentReplica(0, {"w": torch.zeros(100)}, False, norms=norms)


def test_robust_merge_clips_one_outlier_and_refuses_absurd_sizes():
    cfg = ProtocolConfig(fragments=1, sync_every=4, overlap=1, merge="mean", record_codec="fp32", outer_lr=1.0,
                         outer_momentum=0.0)  # fmt: skip
    norms = NormBook()
    rep = _rep(norms)
    assert rep.norm_reference() is None  # fewer than three learners known: no reference yet
    honest = [
        Contribution(f"l{i}", 0, 0, 4, 400, 1.0, {"w": torch.full((100,), 0.01)}, f"c{i}") for i in range(3)
    ]
    rep.apply_record(rep.make_record(1, honest, cfg), cfg)
    ref = rep.norm_reference()
    assert ref == pytest.approx(0.1)  # RMS 0.01 per parameter x sqrt(100)
    big = Contribution("bad", 0, 1, 4, 400, 1.0, {"w": torch.full((100,), 0.05)}, "b1")  # 5x the others
    rec = rep.make_record(2, [big], cfg)
    assert rec.clipped == ("b1",)
    assert float(rec.grad["w"].norm()) == pytest.approx(cfg.clip_factor * ref, rel=1e-5)
    rep.check_delta({"w": torch.full((100,), 2.0)}, ProtocolConfig(max_rms=0))  # 200x: clipped, not refused
    with pytest.raises(ProtocolError) as e:  # 1200x the median: refused outright
        rep.check_delta({"w": torch.full((100,), 12.0)}, ProtocolConfig(max_rms=0))
    assert e.value.code is RejectCode.TOO_LARGE
    with pytest.raises(ProtocolError) as e:  # absurd per-parameter size, even with no reference yet
        _rep(NormBook()).check_delta({"w": torch.full((100,), 2.0)}, cfg)
    assert e.value.code is RejectCode.TOO_LARGE and "max_rms" in str(e.value)


def test_a_book_seeded_by_tiny_first_sizes_learns_the_sizes_it_refuses_and_a_liar_stays_refused():
    """A swarm's first contributions can be 1,000x and more smaller than a minute later's (a few steps at the
    start of the lr warm-up): a book that learnt only from merges refused every honest contribution after
    them, for good, and its node banned every honest peer (a suite run of ``ddiloco up``). A refused size is
    its learner's size now: each honest learner is refused a few times, fewer than a ban takes, and then
    taken; a liar sending 10,000x theirs raises only its own median, and is refused every time."""
    cfg = ProtocolConfig(fragments=1, sync_every=4, overlap=1, merge="mean", record_codec="fp32", outer_lr=1.0,
                         outer_momentum=0.0, max_rms=0)  # fmt: skip
    rep = _rep(NormBook())
    tiny = [
        Contribution(f"l{i}", 0, 0, 1, 100, 1.0, {"w": torch.full((100,), 1e-7)}, f"t{i}") for i in range(3)
    ]
    rep.apply_record(rep.make_record(1, tiny, cfg), cfg)
    refused = {f"l{i}": 0 for i in range(3)} | {"bad": 0}
    for r in range(12):
        taken = []
        for name, size in [(f"l{i}", 1e-3 * (1 + 0.1 * i)) for i in range(3)] + [("bad", 10.0)]:
            delta = {"w": torch.full((100,), size)}
            try:
                n = rep.check_delta(delta, cfg, name)
            except ProtocolError as e:
                assert e.code is RejectCode.TOO_LARGE
                refused[name] += 1
                continue
            taken.append(Contribution(name, 0, rep.round, 4, 400, 1.0, delta, f"{name}-{r}", n))
        if taken:
            rep.apply_record(rep.make_record(rep.round + 1, taken, cfg), cfg)
    honest = [refused[f"l{i}"] for i in range(3)]
    assert sum(honest) > 0 and max(honest) <= 5, refused  # refused at first; ban_after is 10 refusals
    assert refused["bad"] == 12, refused


def test_guard_bans_after_hostile_refusals_only_and_remembers_merged_ids():
    g = PeerScores(ban_after=3, ban_s=10)
    for _ in range(5):
        assert not g.penalise("p", RejectCode.STALE_BASE, 0.0)  # honest peers meet these: free
    g.check("p", 0.0)
    assert not g.penalise("p", RejectCode.NOT_FINITE, 0.0)
    assert not g.penalise("p", RejectCode.WRONG_SHAPE, 0.0)
    assert g.penalise("p", RejectCode.TOO_LARGE, 1.0)  # third strike
    with pytest.raises(ProtocolError) as e:
        g.check("p", 5.0)
    assert e.value.code is RejectCode.BANNED
    g.check("p", 11.5)  # the ban ends, with a clean score
    assert g.scores["p"] == 0.0
    g.merged(["a:0:1", "a:0:2"])
    with pytest.raises(ProtocolError) as e:
        g.check_replay("a:0:1")
    assert e.value.code is RejectCode.REPLAYED
    g.check_replay("a:0:3")


def test_a_ban_on_evidence_is_at_once_counted_once_and_ends_like_any_ban():
    g = PeerScores(ban_after=3, ban_s=10)
    assert g.ban("p", 0.0) and not g.ban("p", 1.0)  # a second piece of evidence changes nothing
    assert g.bans == 1
    with pytest.raises(ProtocolError):
        g.check("p", 9.0)
    g.check("p", 10.5)
    assert g.ban("p", 11.0) and g.bans == 2


def test_the_first_copy_of_a_merged_contribution_is_a_resend_and_the_second_a_replay():
    g = PeerScores()
    assert not g.first_resend("a:0:1")  # never merged: an ordinary contribution
    g.merged(["a:0:1"])
    assert g.first_resend("a:0:1")  # its reply was lost: answered as landed, no strike
    assert not g.first_resend("a:0:1")  # a second copy: a replay
    with pytest.raises(ProtocolError) as e:
        g.check_replay("a:0:1")
    assert e.value.code is RejectCode.REPLAYED
    g.merged(["a:0:1"])  # a later record naming it again does not make the next copy free
    assert not g.first_resend("a:0:1")


def _final_loss(task, scale: float, **defence) -> float:
    pcfg = ProtocolConfig(fragments=4, sync_every=8, overlap=2, **defence)
    plans = (LearnerPlan(), LearnerPlan(), LearnerPlan(), LearnerPlan(scale=scale))
    run = RunConfig(
        learners=4, token_budget=4 * 48 * task.tokens_per_batch, eval_points=2, seed=3, plans=plans
    )
    return run_system(task, run, pcfg, InnerConfig(), EventLog()).evals[-1][2]


@pytest.mark.timeout(900)  # three runs of 192 steps: minutes on a loaded machine, bounded by steps, not time
@pytest.mark.slow
def test_a_learner_sending_1000x_updates_is_neutralised(tiny_task):
    honest = _final_loss(tiny_task, 1.0)
    attacked = _final_loss(tiny_task, 1000.0)
    undefended = _final_loss(tiny_task, 1000.0, clip_factor=0.0, refuse_factor=0.0, max_rms=0.0)
    assert attacked <= 1.02 * honest  # within 2% of the honest run (1.0045x here; its work is refused)
    assert undefended > 2 * honest  # and without the defence the same attack ruins the model


def test_a_forged_or_oversized_record_costs_only_the_peer_that_signed_it():
    g = PeerScores(ban_after=2)
    for code in (RejectCode.FORGED_RECORD, RejectCode.RECORD_TOO_LARGE):
        assert not g.penalise("relay", code, 0.0)  # fetched from a holder: not its fault
    assert "relay" not in g.scores
    assert not g.penalise("signer", RejectCode.FORGED_RECORD, 0.0, signed=True)
    assert g.penalise("signer", RejectCode.RECORD_TOO_LARGE, 0.0, signed=True)  # banned at -2
    assert not g.penalise("signer", RejectCode.WRONG_PARENT, 0.0, signed=True)  # honest peers meet this one
