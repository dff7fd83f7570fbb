"""bench/parity_runner.py: how the parity bench scores the runner (goodput from the moment every learner
was up) and reads each node's pace from its step records."""

from __future__ import annotations

import pytest

from bench.parity_runner import pace, window_goodput
from protocol.goodput import compute_goodput


def _learner(i: int, t_start: float, t_end: float) -> list[dict]:
    """One step a second, each contributed and merged in a round of its own."""
    out = []
    for k, t in enumerate(range(int(t_start), int(t_end))):
        cid = f"{i}-{k}"
        out += [
            {"kind": "step", "learner": i, "step": k, "t0": float(t), "t1": t + 1.0},
            {"kind": "contribute", "learner": i, "fragment": 0, "step": k, "cid": cid},
            {"kind": "merge", "fragment": 0, "round": 100 * i + k, "cids": [cid], "learners": [i]},
        ]
    return out


def test_goodput_is_scored_from_the_last_learners_start():
    run = {"kind": "run", "t0": 0.0, "t1": 20.0, "learners": [0, 1], "shares": [1.0], "overlap": 1}
    records = [run, *_learner(0, 0, 20), {"kind": "down", "learner": 1, "t": 0.0}]
    records += [{"kind": "up", "learner": 1, "t": 8.0}, *_learner(1, 8, 20)]
    whole = compute_goodput(records)
    assert whole.down_s == pytest.approx(8.0) and whole.goodput < 0.9  # the late start, counted as down
    late = window_goodput(records, t0=8.0)
    assert late.down_s == 0.0
    assert late.allocated_s == pytest.approx(24.0)  # two learners from t = 8 to 20
    assert late.goodput == pytest.approx(1.0)


def test_a_learner_down_inside_the_window_still_counts():
    run = {"kind": "run", "t0": 0.0, "t1": 20.0, "learners": [0, 1], "shares": [1.0], "overlap": 1}
    records = [run, *_learner(0, 0, 20), *_learner(1, 0, 10), {"kind": "down", "learner": 1, "t": 10.0}]
    records += [{"kind": "up", "learner": 1, "t": 15.0}, *_learner(1, 15, 20)]
    assert window_goodput(records, t0=2.0).down_s == pytest.approx(5.0)


def test_pace_is_each_nodes_mean_step_interval_and_its_spread():
    steady = [{"kind": "step", "t0": 0.5 * k} for k in range(40)]
    uneven = [{"kind": "step", "t0": t} for t in sorted(0.3 * k + (0.1 if k % 2 else 0.0) for k in range(40))]
    few = [{"kind": "step", "t0": float(k)} for k in range(15)]
    (m0, cv0), (m1, cv1), (m2, cv2) = pace({0: steady, 1: uneven, 2: few}, 3)
    assert m0 == pytest.approx(0.5) and cv0 == pytest.approx(0.0, abs=1e-9)
    assert m1 == pytest.approx(0.3, rel=0.02) and cv1 == pytest.approx(0.1 / 0.3, rel=0.05)
    assert (m2, cv2) == (0.0, 0.0)  # too few steps past the first ten to say
