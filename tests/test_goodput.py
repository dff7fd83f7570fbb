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
