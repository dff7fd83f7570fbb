"""The chaos harness (``node/chaos/harness.py``): its failure plan and scoring on hand-built records, and one short
run of four real nodes in which the synchroniser of a fragment and then another learner are killed -9 and
the first comes back from its checkpoint."""

from __future__ import annotations

import json
import os

import pytest

from node.chaos.config import ChaosConfig
from node.chaos.harness import ChaosRun
from node.chaos.plan import FailureModel, Fault, draw_plan, plan_from_json, plan_to_json
from node.chaos.report import Outage, chaos_goodput, longest_gap, stalls
from node.cli.chaos import compare, render, render_comparison
from protocol.errors import ConfigError
from tests.swarm_util import TINY, fork_server


# ------------------------------------------------------------------------------------------ the plan
def test_plan_is_seeded_exponential_and_round_trips():
    model = FailureModel(mtbf_s=10.0, quiet_end_s=20.0)
    a = draw_plan(1, 3000.0, 4, 8, model)
    assert a == draw_plan(1, 3000.0, 4, 8, model) != draw_plan(2, 3000.0, 4, 8, model)
    assert all(f.at_s < 2980.0 for f in a) and [f.at_s for f in a] == sorted(f.at_s for f in a)
    gaps = [b.at_s - x.at_s for x, b in zip(a, a[1:])]
    assert 8.0 < sum(gaps) / len(gaps) < 12.0  # ~300 draws of mean 10
    kinds = {f.kind for f in a}
    assert kinds == {"kill", "kill_sync", "pause"}
    assert all(0 <= f.node < 4 and 0 <= f.fragment < 8 and f.hold_s is not None for f in a)
    assert plan_from_json(plan_to_json(a)) == a
    assert draw_plan(1, 3000.0, 4, 8, FailureModel(mtbf_s=0.0)) == []


def test_plan_errors_name_the_bad_value():
    with pytest.raises(ConfigError, match="kind='reboot'"):
        plan_from_json('[{"at_s": 1, "kind": "reboot", "node": 0}]')
    with pytest.raises(ConfigError, match="pause needs hold_s"):
        plan_from_json('[{"at_s": 1, "kind": "pause", "node": 0}]')
    with pytest.raises(ConfigError, match="pause_share"):
        draw_plan(0, 10.0, 2, 2, FailureModel(pause_share=2.0))


def test_a_cpu_quota_needs_namespaces_and_a_sane_share(tmp_path):
    from node.chaos.config import ChaosConfig

    with pytest.raises(ConfigError, match="netns_cpu=0.5 needs netns"):
        ChaosConfig(tmp_path, netns_cpu=0.5).check()
    with pytest.raises(ConfigError, match="netns_cpu=-1 is invalid"):
        ChaosConfig(tmp_path, netns=True, netns_cpu=-1).check()
    ChaosConfig(tmp_path, netns=True, netns_cpu=0.5).check()


# ------------------------------------------------------------------------------------------ the scoring
def _steps(learner: str, first: int, n: int, t: float, dur: float = 1.0) -> list[dict]:
    return [
        {"kind": "step", "learner": learner, "step": first + k, "t0": t + k * dur, "t1": t + (k + 1) * dur}
        for k in range(n)
    ]


def _contrib(learner: str, step: int, t: float, cid: str) -> dict:
    return {"kind": "contribute", "learner": learner, "fragment": 0, "step": step, "t": t, "cid": cid}


def test_a_kill_loses_uncontributed_steps_and_a_restart_repeats_step_numbers():
    run = {"kind": "run", "shares": [1.0], "t0": 0, "t1": 0, "learners": ["a"]}
    a = [{"kind": "join", "t": 0.0}, *_steps("a", 1, 4, 0.0), _contrib("a", 2, 2.0, "a1")]
    # killed at t=4.5 after steps 3 and 4 (never contributed); back at t=6 from a checkpoint at step 2,
    # then steps 3..6 again and a contribution at step 6 that merges.
    a += [{"kind": "join", "t": 6.0}, *_steps("a", 3, 4, 6.0), _contrib("a", 6, 10.0, "a2")]
    a += [{"kind": "merge", "t": 10.5, "fragment": 0, "round": 1, "cids": ["a1", "a2"], "hash": "h"}, run]
    g = chaos_goodput({0: a}, {0: "a"}, [Outage(0, "kill", 4.5)], 0.0, 12.0)
    assert g.useful_s == pytest.approx(2 + 4)  # steps 1-2, then 3-6 of the second life
    assert g.dropped_s == g.killed_s == pytest.approx(2)  # steps 3-4 of the first life, lost to the kill
    assert g.down_s == pytest.approx(1.5)
    assert g.goodput == pytest.approx(6 / 12)


def test_a_sigstop_inside_a_step_is_not_compute_and_the_window_clips():
    run = {"kind": "run", "shares": [0.5, 0.5], "t0": 0, "t1": 0, "learners": ["a"]}
    a = [*_steps("a", 1, 2, -2.0), *_steps("a", 3, 3, 0.0, dur=2.0)]  # the first two are before the window
    a += [{**_contrib("a", 5, 6.0, "c0")}, {**_contrib("a", 5, 6.0, "c1"), "fragment": 1}, run]
    a += [{"kind": "merge", "t": 7.0, "fragment": 0, "round": 1, "cids": ["c0"], "hash": "h"}]
    g = chaos_goodput({0: a}, {0: "a"}, [Outage(0, "pause", 2.5, 3.5)], 0.0, 8.0)
    assert g.steps == 3
    assert g.useful_s == pytest.approx(0.5 * 5)  # 6 s of steps less 1 s stopped, half the parameters merged
    assert g.dropped_s == pytest.approx(0.5 * 5)
    assert g.down_s == pytest.approx(1.0)


def test_stalls_are_read_from_merges_anywhere():
    assert longest_gap([2.0, 3.0, 9.0], 0.0, 10.0) == (6.0, 3.0)
    ev = {
        0: [
            {"kind": "merge", "t": t, "fragment": t % 2, "round": t, "hash": str(t)} for t in (1, 2, 3, 7, 8)
        ],
        1: [{"kind": "merge", "t": 3.2, "fragment": 1, "round": 3, "hash": "3"}],  # the same record, later
    }
    st = stalls(ev, 0.0, 10.0)
    assert st["global_s"] == pytest.approx(4.0) and st["merges"] == 5
    assert st["fragment_s"] == pytest.approx(6.0) and st["fragment"] == 0  # fragment 0: merges at 2 and 8


# ------------------------------------------------------------------------------------------ real nodes
@pytest.mark.timeout(300)
def test_the_baseline_comparison_divides_goodput_and_tokens_of_one_plan():
    def rep(g, tokens, loss, notes):
        faults = [{"note": n} for n in notes]
        return {
            "goodput": {"goodput": g},
            "tokens_trained": tokens,
            "eval_loss_final": loss,
            "faults": faults,
        }

    ours = rep(0.8, 3000, 0.6, ["", "", "skipped: 2 running, min_alive 2"])
    base = rep(0.5, 2000, 0.7, ["", "", ""])
    c = compare(ours, base, "sync-diloco")
    assert c["goodput_ratio"] == pytest.approx(1.6) and c["tokens_ratio"] == pytest.approx(1.5)
    assert c["decoupled"]["faults_applied"] == 2 and c["sync-diloco"]["faults_applied"] == 3
    line = render_comparison(c)
    assert "80.0% vs 50.0% (1.60x)" in line and "0.600 vs 0.700" in line
    assert compare(ours, rep(None, 0, None, []), "sync-diloco")["goodput_ratio"] is None


@pytest.mark.slow
def test_kill_the_synchroniser_then_another_learner_restart_one_and_agree(tmp_path):
    plan = [
        Fault(at_s=5.0, kind="kill_sync", node=1, fragment=0, hold_s=12.0),
        Fault(at_s=12.0, kind="kill", node=3, hold_s=None),
    ]
    cfg = ChaosConfig(
        run_dir=tmp_path / "chaos",
        nodes=4,
        duration_s=32.0,
        plan=plan,
        node_flags=TINY,
        quiet=True,
        forks=fork_server(),
    )
    run = ChaosRun(cfg)
    rep = run.run()

    # Every process of every life is gone: the node, its DHT process and its p2pd (one process group).
    for slot in run.slots.values():
        for child in slot.lives:
            assert child.proc.returncode is not None
            with pytest.raises(ProcessLookupError):
                os.killpg(child.proc.pid, 0)

    sync_kill, other_kill = rep["faults"]
    assert sync_kill["node"] is not None and other_kill["node"] not in (None, sync_kill["node"])
    assert sync_kill["fragment_merged_again_s"] is not None  # the fragment's next round found a synchroniser
    first, second = rep["outages"]
    assert first["back"] and not second["back"]
    for w in (first, second):  # training went on while each was down: merges, and every survivor stepped
        assert w["merges_meanwhile"] > 0, w
        assert w["steps_meanwhile"] and all(n > 0 for n in w["steps_meanwhile"].values()), w
    lives = {n["node"]: n["lives"] for n in rep["per_node"]}
    assert lives[sync_kill["node"]] == 2 and lives[other_kill["node"]] == 1
    # Co-located nodes: each node's learner thread ran niced (ChaosConfig.learner_nice).
    for i in range(4):
        recs = [json.loads(x) for x in (tmp_path / "chaos" / f"node-{i}" / "events.jsonl").open()]
        starts = [r for r in recs if r.get("kind") == "learner"]
        assert starts and all(r["niced"] == 10 for r in starts), (i, starts)

    # After the quiet period the three live nodes hold one model; goodput is a share of the allocated time.
    assert rep["settled"] and rep["equal_hashes"], rep["hashes"]
    assert sorted(rep["survivors"]) == sorted(set(range(4)) - {other_kill["node"]})
    assert 0.0 < rep["goodput"]["goodput"] <= 1.0
    assert rep["rounds_merged"] > 0 and rep["tokens_merged"] > 0
    text = render(rep)
    assert "goodput" in text and "one model hash across 3 survivors" in text

    # The folder replays (ddiloco replay): chaos.json gives the window and the kills, the real run scores as
    # this report did, and the node killed for good (no 'run' record) is read as killed, not as cut short.
    from node.chaos.replay import real_figures, replay
    from node.chaos.tape import read_run

    folder = read_run(tmp_path / "chaos")
    assert [o.kind for o in folder.outages] == ["kill", "kill"]
    assert real_figures(folder)["goodput"] == pytest.approx(rep["goodput"]["goodput"], abs=1e-4)
    own = replay(folder)
    assert own["rounds_merged"] > 0 and 0.0 < own["goodput"] <= 1.0


# ------------------------------------------------------------------------------------------ namespaces
def test_netns_lab_links_nodes_partitions_and_leaves_nothing_behind():
    """Optional (root and iproute2): two node namespaces on a bridge, a partition and a heal, then gone."""
    import socket
    import subprocess

    from tests.netns_util import open_lab

    lab = open_lab(2, "100mbit", "t")
    try:

        def serve() -> socket.socket:
            s = socket.create_server((lab.addr(0), 0))
            s.settimeout(5)
            return s

        def dial(port: int) -> bool:
            try:
                socket.create_connection((lab.addr(0), port), timeout=1).close()
                return True
            except OSError:
                return False

        srv = lab.inside(0, serve)
        port = srv.getsockname()[1]
        assert lab.inside(1, lambda: dial(port))
        lab.partition({1})
        assert not lab.inside(1, lambda: dial(port))
        lab.heal()
        assert lab.inside(1, lambda: dial(port))
        srv.close()
        qdisc = subprocess.run(
            ["tc", "-n", lab.ns(0), "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        )
        assert "tbf" in qdisc.stdout and "100Mbit" in qdisc.stdout
    finally:
        lab.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lab.ns(0) not in listed and lab.hub not in listed


def test_a_merge_that_lost_a_fork_does_not_count():
    run = {"kind": "run", "shares": [1.0], "t0": 0, "t1": 0, "learners": ["a", "b"]}
    a = [{"kind": "join", "t": 0.0}, *_steps("a", 1, 2, 0.0), _contrib("a", 2, 2.0, "a1"), run]
    b = [{"kind": "join", "t": 0.0}, *_steps("b", 1, 2, 0.0), _contrib("b", 2, 2.0, "b1")]
    # a and b each merged round 1 of fragment 0 with their own contribution; b's record won the fork
    a += [{"kind": "merge", "t": 2.5, "fragment": 0, "round": 1, "cids": ["a1"], "hash": "ha"}]
    b += [{"kind": "merge", "t": 2.5, "fragment": 0, "round": 1, "cids": ["b1"], "hash": "hb"}]
    a += [
        {
            "kind": "fork",
            "t": 2.6,
            "fragment": 0,
            "round": 1,
            "ours": "ha",
            "theirs": "hb",
            "winner": "theirs",
        }
    ]
    g = chaos_goodput({0: a, 1: b}, {0: "a", 1: "b"}, [], 0.0, 4.0)
    assert g.useful_s == pytest.approx(2.0)  # b's two steps
    assert g.dropped_s == pytest.approx(2.0)  # a's, merged only on the chain the swarm dropped
