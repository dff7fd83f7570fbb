"""A small golden run: 3 learners, tiny model, fixed seeds, compared to a stored fixture.

The fixture changes only on purpose: ``DDILOCO_REGEN_GOLDEN=1 pytest tests/test_golden.py`` rewrites it, and
the diff shows in review. Losses are compared with a tolerance that absorbs BLAS differences between CPUs
but not a change in the algorithm.
"""

import json
import os
from pathlib import Path

import pytest

from node.common.events import EventLog
from node.learner.learner import InnerConfig
from node.local.run_config import LearnerPlan, RunConfig
from node.local.runner import run_system
from protocol.config import ProtocolConfig

FIXTURE = Path(__file__).parent / "golden" / "decoupled_tiny.json"


def golden_run(task) -> dict:
    pcfg = ProtocolConfig(fragments=4, sync_every=8, overlap=2, quorum=1, grace=True)
    plans = (LearnerPlan(), LearnerPlan(jitter=0.1), LearnerPlan(speed=0.8, down=((10.0, 18.0),)))
    ev = EventLog()
    res = run_system(
        task,
        RunConfig(
            learners=3, token_budget=3 * 40 * task.tokens_per_batch, eval_points=4, seed=7, plans=plans
        ),
        pcfg,
        InnerConfig(),
        ev,
    )
    merges = ev.of("merge")
    return {
        "eval_losses": [round(e[2], 5) for e in res.evals],
        "merges": len(merges),
        "contributors_per_merge": [len(m["cids"]) for m in merges],
        "rounds_per_fragment": [sum(1 for m in merges if m["fragment"] == p) for p in range(4)],
        "goodput": round(res.goodput, 5),
    }


def test_golden_run_matches_fixture(tiny_task):
    got = golden_run(tiny_task)
    if os.environ.get("DDILOCO_REGEN_GOLDEN") == "1" or not FIXTURE.exists():
        FIXTURE.write_text(json.dumps(got, indent=1) + "\n")
        if os.environ.get("DDILOCO_REGEN_GOLDEN") != "1":
            pytest.fail(f"no fixture at {FIXTURE}; wrote one, check it in")
    want = json.loads(FIXTURE.read_text())
    assert got["merges"] == want["merges"]
    assert got["contributors_per_merge"] == want["contributors_per_merge"]
    assert got["rounds_per_fragment"] == want["rounds_per_fragment"]
    assert got["goodput"] == pytest.approx(want["goodput"], abs=1e-6)
    assert got["eval_losses"] == pytest.approx(want["eval_losses"], abs=2e-3)
