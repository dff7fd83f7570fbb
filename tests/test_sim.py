"""The goodput simulator (sim/): determinism, sanity at the extremes, the systems' order at scale, its
aggregated accounting against protocol.goodput on per-chip records, and ``ddiloco sim`` as a user runs it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from node.cli.main import main
from protocol.errors import ConfigError
from protocol.goodput import compute_goodput
from sim import DAY_S, HOUR_S, YEAR_S, SimConfig, simulate
from sim.accounting import RecordSink

ROOT = Path(__file__).resolve().parents[1]
NO_FAILURES = math.inf


def small(**kw) -> SimConfig:
    """A cluster small enough to write per-chip records, failing often enough to exercise every path."""
    base = dict(
        chips=32, learners=4, host_chips=2, mtbi_s=10 * HOUR_S, repair_s=600.0, duration_s=2 * HOUR_S, seed=3
    )
    return SimConfig(**{**base, **kw})


def test_a_run_is_deterministic_for_its_seed():
    cfg = small(system="decoupled", jitter=0.1, slow_learners=1, slow_factor=1.2, duration_s=HOUR_S)
    a, b = simulate(cfg).as_dict(), simulate(cfg).as_dict()
    c = simulate(replace(cfg, seed=4)).as_dict()
    for d in (a, b, c):
        d.pop("wall_s")
    assert a == b
    assert a != c


@pytest.mark.parametrize("system", ["dp", "elastic-dp", "decoupled"])
def test_without_failures_goodput_is_one(system):
    r = simulate(SimConfig(system=system, chips=1000, mtbi_s=NO_FAILURES, duration_s=2 * HOUR_S))
    assert r.failures == 0
    assert r.goodput.goodput == pytest.approx(1.0, abs=1e-3)
    assert r.goodput.dropped_s == 0


def test_non_elastic_dp_goodput_falls_as_chips_grow():
    g = [
        simulate(SimConfig(system="dp", chips=n, duration_s=DAY_S)).goodput.goodput
        for n in (150_000, 600_000, 2_400_000)
    ]
    assert g[0] > g[1] > g[2]
    assert g[0] < 0.9 and g[2] > 0.05  # failures matter, and the job still makes progress


def test_at_1_2m_chips_decoupled_beats_elastic_dp_beats_dp():
    cfg = SimConfig(chips=1_200_000, learners=8, duration_s=4 * HOUR_S)
    g = {s: simulate(replace(cfg, system=s)).goodput.goodput for s in ("dp", "elastic-dp", "decoupled")}
    assert g["decoupled"] > g["elastic-dp"] > g["dp"]


def test_hosts_away_for_repair_start_in_steady_state():
    """A failed chip's host is out for repair_s; chips fail only while the job runs (1 / (1 + rate *
    resize_s) of the time), so host_chips * repair_s / mtbi of the chips times that share are away, from
    the first hour on as after a week."""
    cfg = SimConfig(system="elastic-dp", chips=1_200_000, duration_s=HOUR_S)
    rate = cfg.chips / cfg.mtbi_s
    expected = cfg.host_chips * cfg.repair_s / cfg.mtbi_s / (1 + rate * cfg.resize_s)
    for days in (1 / 24, 7):
        r = simulate(replace(cfg, duration_s=days * DAY_S)).goodput
        assert r.down_s / r.allocated_s == pytest.approx(expected, rel=0.1)


CASES = {
    "dp": dict(system="dp"),
    "elastic-dp": dict(system="elastic-dp"),
    "decoupled": dict(system="decoupled"),
    "decoupled-restart": dict(system="decoupled", learner_recovery="restart"),
    "decoupled-K=M-heterogeneous": dict(
        system="decoupled", quorum=4, grace=False, slow_learners=2, slow_factor=1.18, jitter=0.1
    ),
    "elastic-dp-slowdowns": dict(
        system="elastic-dp", slow_learners=2, slow_factor=1.3, jitter=0.1, slowdown_mtbi_s=3 * HOUR_S
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_aggregated_accounting_equals_protocol_goodput_on_per_chip_records(case):
    cfg = small(**CASES[case])
    sink = RecordSink(cfg.block_chips())
    r = simulate(cfg, sink)
    want = compute_goodput(sink.records)
    assert r.failures > 0
    for name in ("goodput", "useful_s", "allocated_s", "down_s", "blocked_s", "dropped_s", "pending_s"):
        assert getattr(r.goodput, name) == pytest.approx(getattr(want, name), rel=1e-9, abs=1e-6), name
    if case in ("decoupled-restart", "decoupled-K=M-heterogeneous"):
        assert r.goodput.dropped_s > 0  # lost unsent work / replaced contributions are scored as dropped


@pytest.mark.slow
def test_heterogeneous_learners_quorum_and_grace():
    """Half the learners 18% slower with 10% jitter, no failures: K = 1 (with or without grace) wastes
    nothing; under K = M a fast learner's contribution waits for the slow learners, and its next one
    against the same round replaces it (scored as dropped by ``protocol.goodput``): the fast learners keep
    about 0.89 of their work. (Before contributions were keyed by learner and base, one against a newer
    round replaced them too, work that no other contribution held: the fast learners kept 1/1.18.)"""
    cfg = SimConfig(
        system="decoupled",
        chips=800,
        learners=4,
        slow_learners=2,
        slow_factor=1.18,
        jitter=0.1,
        mtbi_s=NO_FAILURES,
        duration_s=3 * HOUR_S,
    )
    k_m = simulate(replace(cfg, quorum=4, grace=False))
    k_1 = simulate(replace(cfg, quorum=1, grace=False))
    k_1g = simulate(replace(cfg, quorum=1, grace=True))
    assert k_1.goodput.goodput == pytest.approx(1.0, abs=2e-3)
    assert k_1g.goodput.goodput == pytest.approx(1.0, abs=2e-3)
    assert k_m.goodput.goodput < 0.95
    fast, slow = k_m.block_goodput[:2], k_m.block_goodput[2:]
    assert all(1 / 1.18 + 0.02 < f < 0.95 for f in fast), fast
    assert slow == pytest.approx([1.0] * 2, abs=5e-3)
    assert k_1.merges > k_1g.merges > k_m.merges  # grace gathers stragglers into fewer, larger rounds


def test_transient_slowdowns_stall_dp_but_not_decoupled():
    cfg = SimConfig(
        chips=8_000, learners=8, mtbi_s=NO_FAILURES, slowdown_mtbi_s=YEAR_S / 50, duration_s=3 * HOUR_S
    )
    dp = simulate(replace(cfg, system="dp")).goodput
    dec = simulate(replace(cfg, system="decoupled")).goodput
    assert dp.blocked_s > 0 and dp.goodput < 0.95
    assert dec.goodput == pytest.approx(1.0, abs=2e-3)


@pytest.mark.slow
def test_a_restarting_learner_loses_more_than_a_resizing_one():
    cfg = SimConfig(system="decoupled", chips=1_200_000, learners=8, duration_s=2 * HOUR_S)
    resize = simulate(cfg).goodput
    restart = simulate(replace(cfg, learner_recovery="restart")).goodput
    assert restart.goodput < resize.goodput
    assert restart.dropped_s > 0 and resize.dropped_s == 0


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(chips=-5), "chips=-5"),
        (dict(learners=0), "learners=0"),
        (dict(learners=4, quorum=5), "quorum=5"),
        (dict(chips=3, learners=4), "learners=4"),
        (dict(system="ring"), "system='ring'"),
        (dict(mtbi_s=0.0), "mtbi_s=0.0"),
        (dict(overlap=24), "overlap=24"),
    ],
)
def test_bad_configuration_names_the_value(kw, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        SimConfig(**kw)


@pytest.mark.slow
def test_cli_json_via_subprocess():
    cmd = [sys.executable, "-m", "node", "sim", "--system", "all", "--chips", "20000", "--learners", "4"]
    cmd += ["--days", "0.05", "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    runs = json.loads(out.stdout)["runs"]
    assert [r["system"] for r in runs] == ["dp", "elastic-dp", "decoupled"]
    for r in runs:
        for key in (
            "goodput",
            "chips",
            "learners",
            "quorum",
            "grace",
            "days",
            "failures",
            "merges",
            "wall_s",
        ):
            assert key in r
        assert 0 < r["goodput"] <= 1 and r["chips"] == 20000 and r["learners"] == 4


@pytest.mark.slow
def test_cli_bad_flag_exits_2_via_subprocess():
    cmd = [sys.executable, "-m", "node", "sim", "--chips", "-5"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "ddiloco: error: chips=-5 is invalid" in out.stderr


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--chips", "-5"], "chips=-5"),
        (["--learners", "0"], "learners=0"),
        (["--learners", "4", "--quorum", "5"], "quorum=5"),
        (["--system", "dp,ring"], "system='ring'"),
        (["--mtbi-years", "0"], "mtbi_years=0.0"),
        (["--days", "-1"], "days=-1.0"),
        (["--events", "x.jsonl"], "events='x.jsonl'"),
    ],
)
def test_cli_bad_flags_exit_2_naming_the_value(argv, needle, capsys):
    assert main(["sim", *argv]) == 2
    err = capsys.readouterr().err
    assert "ddiloco: error:" in err and needle in err
    assert "resolved configuration" not in err


def test_cli_events_file_scores_like_the_run(tmp_path, capsys):
    path = tmp_path / "ev.jsonl"
    argv = ["sim", "--chips", "16", "--learners", "4", "--host-chips", "2", "--mtbi-years", str(2 / 8760)]
    argv += ["--repair-h", "0.2", "--days", str(1 / 24), "--json", "--events", str(path)]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert res["failures"] > 0 and res["events"] == str(path)
    assert compute_goodput(records).goodput == pytest.approx(res["goodput"], rel=1e-9)
