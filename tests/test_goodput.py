"""Goodput from hand-built event records."""

import pytest

from protocol.goodput import compute_goodput


def test_goodput_counts_merged_dropped_down_and_pending():
    recs = [{"kind": "run", "t0": 0.0, "t1": 10.0, "learners": ["a", "b"], "shares": [1.0]}]
    # a: 8 steps of 1s; contributes after step 4 (merged) and step 8 (dropped)
    recs += [{"kind": "step", "learner": "a", "step": s, "t0": s - 1.0, "t1": float(s)} for s in range(1, 9)]
    recs += [
        {"kind": "contribute", "learner": "a", "fragment": 0, "step": 4, "cid": "a4"},
        {"kind": "contribute", "learner": "a", "fragment": 0, "step": 8, "cid": "a8"},
    ]
    # b: down from t=0 to t=6, then 2 steps (pending: no contribution after them)
    recs += [{"kind": "down", "learner": "b", "t": 0.0}, {"kind": "up", "learner": "b", "t": 6.0}]
    recs += [{"kind": "step", "learner": "b", "step": s, "t0": 6.0 + s - 1, "t1": 6.0 + s} for s in (1, 2)]
    recs += [{"kind": "merge", "fragment": 0, "round": 1, "cids": ["a4"]}]
    g = compute_goodput(recs)
    assert g.useful_s == pytest.approx(4.0)
    assert g.dropped_s == pytest.approx(4.0)
    assert g.pending_s == pytest.approx(2.0)
    assert g.down_s == pytest.approx(6.0)
    assert g.goodput == pytest.approx(4.0 / (20.0 - 2.0))


def test_goodput_without_run_record_is_an_error():
    with pytest.raises(ValueError, match="no 'run' record"):
        compute_goodput([])


def _overlap_run(tau: int) -> list[dict]:
    """One learner, one fragment, 12 steps of 1 s: sends after step 4 (merged in round 1, adopted after
    step 5: one step in flight), after step 8 (merged in round 2, adopted after step 11: three in flight),
    and after step 12 (left out: round 3 merges without it, adopted after step 12)."""
    recs = [{"kind": "run", "t0": 0.0, "t1": 12.0, "learners": ["a"], "shares": [1.0], "overlap": tau}]
    recs += [{"kind": "step", "learner": "a", "step": s, "t0": s - 1.0, "t1": float(s)} for s in range(1, 13)]
    for step, cid in ((4, "a4"), (8, "a8"), (12, "a12")):
        recs.append({"kind": "contribute", "learner": "a", "fragment": 0, "step": step, "cid": cid})
    recs += [
        {"kind": "merge", "fragment": 0, "round": 1, "cids": ["a4"]},
        {"kind": "merge", "fragment": 0, "round": 2, "cids": ["a8"]},
        {"kind": "merge", "fragment": 0, "round": 3, "cids": ["b12"]},
    ]
    for step, round_ in ((5, 1), (11, 2), (12, 3)):
        recs.append(
            {"kind": "adopt", "learner": "a", "fragment": 0, "step": step, "round": round_, "kept": False}
        )
    return recs


def test_steps_overwritten_within_tau_of_a_merged_contribution_are_the_overlap():
    g = compute_goodput(_overlap_run(tau=2))
    # steps 1-4 and 6-8 reached the model through a4 and a8; step 5 (1 after a4) and steps 9-10 (1 and 2
    # after a8) are the overlap; step 11 is 3 steps after a8: late; step 12 went in a12, left out
    assert g.useful_s == pytest.approx(4 + 1 + 3 + 2)
    assert g.overlap_s == pytest.approx(3.0)
    assert g.late_s == pytest.approx(1.0)
    assert g.left_out_s == pytest.approx(1.0)  # step 12
    assert g.dropped_s == pytest.approx(2.0)
    assert g.goodput == pytest.approx(10 / 12)
    assert g.strict == pytest.approx(7 / 12)


def test_without_an_overlap_every_overwritten_step_is_dropped():
    g = compute_goodput(_overlap_run(tau=0))
    assert g.overlap_s == 0.0
    assert g.goodput == pytest.approx(g.strict) == pytest.approx(7 / 12)
    assert g.late_s == pytest.approx(4.0)  # steps 5, 9, 10, 11


def test_a_round_that_left_the_contribution_out_is_no_overlap():
    recs = _overlap_run(tau=2)
    for r in recs:  # round 1 merged someone else: the step after a4 was overwritten by a round without a4
        if r["kind"] == "merge" and r["round"] == 1:
            r["cids"] = ["b4"]
    g = compute_goodput(recs)
    assert g.overlap_s == pytest.approx(2.0)  # steps 9 and 10 only
    assert g.useful_s == pytest.approx(3 + 2)  # steps 6-8 via a8, and the overlap


def test_dropped_work_is_split_by_where_it_went():
    """Steps 1-2 are sent in c2 and merged; 3-4 in c4, which no round merges (left out); 5-6 are overwritten
    by round 2 before the learner sends them (unsent); 7-8 were never sent when its process died (killed)."""
    recs = [{"kind": "run", "t0": 0.0, "t1": 8.0, "learners": ["a"], "shares": [1.0], "overlap": 0}]
    recs += [{"kind": "step", "learner": "a", "step": s, "t0": s - 1.0, "t1": float(s)} for s in range(1, 9)]
    for step, cid in ((2, "c2"), (4, "c4")):
        recs.append({"kind": "contribute", "learner": "a", "fragment": 0, "step": step, "cid": cid})
    recs += [
        {"kind": "merge", "fragment": 0, "round": 1, "cids": ["c2"]},
        {"kind": "merge", "fragment": 0, "round": 2, "cids": ["b"]},
        {"kind": "adopt", "learner": "a", "fragment": 0, "step": 6, "round": 2, "kept": False},
        {"kind": "adopt", "learner": "a", "fragment": 0, "step": 8, "kept": False, "lost": True},
    ]
    g = compute_goodput(recs)
    assert g.useful_s == pytest.approx(2.0)
    assert (g.left_out_s, g.unsent_s, g.killed_s, g.late_s) == pytest.approx((2.0, 2.0, 2.0, 0.0))
    assert g.dropped_s == pytest.approx(g.left_out_s + g.unsent_s + g.killed_s + g.late_s)
