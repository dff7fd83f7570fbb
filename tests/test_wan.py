"""The WAN comparison's parts (``bench/wan.py``): its token and eval-loss accounting on hand-built records,
and (root only) the gloo baselines' groups (data-parallel, synchronous DiLoCo) across two capped network
namespaces."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


report = _load("wan_report")


def test_a_step_is_credited_by_its_share_inside_the_window():
    steps = [(0.0, 2.0, 100), (2.0, 4.0, 100), (4.0, 6.0, 100)]
    assert report.credit(steps, 1.0, 5.0) == pytest.approx(50 + 100 + 50)
    assert report.credit(steps, 6.0, 9.0) == 0.0


def test_eval_loss_is_read_at_all_learners_tokens_and_interpolated():
    learners = [
        {"steps": [(0.0, 1.0, 10), (1.0, 2.0, 10)], "evals": [(0.5, 5.0), (2.5, 3.0)]},
        {"steps": [(0.0, 1.5, 10)], "evals": [(2.5, 3.2)]},
    ]
    # at t=0.5 nothing has ended; at t=2.5 all three steps (30 tokens) have: the two evaluations there average
    assert report.eval_curve(learners) == [(0, 5.0), (30, pytest.approx(3.1))]
    at = report.loss_at(report.eval_curve(learners), 15)
    assert at["loss"] == pytest.approx(4.05) and at["between"] == [0, 30]
    assert report.loss_at(report.eval_curve(learners), 31) is None


def test_against_dp_the_loss_is_read_on_the_reference_curve_past_the_capped_run():
    row = {
        "ours": {"tokens_per_s": 1000.0, "tokens_total": 400, "curve": [(0, 5.0), (400, 2.0)]},
        "dp-bf16": {"tokens_per_s": 100.0, "tokens_total": 40, "curve": [(0, 5.0), (40, 4.0)]},
    }
    plain = report.compare(row, "dp-bf16")
    assert plain["tokens"] == 40 and not plain["reference"]
    assert plain["ours_loss"] == pytest.approx(4.7) and plain["other_loss"] == pytest.approx(4.0)
    ref = {"curve": [(0, 5.0), (200, 2.5), (300, 1.5)], "tokens_total": 300}
    c = report.compare(row, "dp-bf16", reference=ref)
    assert c["reference"] and c["ratio"] == pytest.approx(10.0)
    # the most tokens both curves cover: the reference ends at 300
    assert (
        c["tokens"] == 300 and c["ours_loss"] == pytest.approx(2.75) and c["other_loss"] == pytest.approx(1.5)
    )
    res = {
        "config": {"nodes": 4, "duration_s": 75, "warm_s": 20, "batch_size": 16, "sync_every": 24,
                   "eval_every_s": 15, "run_dir": "/x"},
        "results": {"3mbit": {k: {**v, "steps_per_learner": 10, "step_s": 0.5, "sent_mbit_s_per_node": 1.0,
                                  "sent_B_per_step_per_node": 1e3, "outside_steps_share": 0.1,
                                  "final_loss": v["curve"][-1][1], "final_hashes": 1}
                              for k, v in row.items()}},
        "reference": {"dp-bf16": {**ref, "compared_evals": 2, "max_gap": 0.0}},
        "wall_s": 1.0,
        "cpus": 2,
    }  # fmt: skip
    text = report.render(res)
    assert "repeated 2 evaluations of the capped runs at the same steps, largest difference 0" in text
    assert (
        "[MISSED]    3mbit ours (decoupled)" in text
        and "+83.3%) (DP: uncapped reference) (ours worse)" in text
    )


# ------------------------------------------------------------------------------------------ namespaces
def _gloo_group(tmp_path, tag: str, steps: int, extra: list[str]) -> tuple[list[dict], int, int, int]:
    """Two ``bench/wan_dp.py`` workers in two namespaces on 100mbit links, until rank 0 recorded ``steps``
    steps, then stopped: (each rank's final document, bytes node 1 sent and received, the model's values)."""
    from node.learner.task import TaskConfig, load_task
    from tests.netns_util import open_lab

    wan_dp = _load("wan_dp")
    lab = open_lab(2, "100mbit", tag)
    procs = []
    try:
        procs = wan_dp.start_workers(lab, tmp_path, 29500, "fp32", 60.0, 4, 120.0, 100, 0, extra)
        deadline = time.monotonic() + 120
        ev = tmp_path / "events.jsonl"
        while not (ev.exists() and ev.read_text().count('"kind": "step"') >= steps):
            assert all(p.poll() is None for p in procs), (tmp_path / "worker-1.log").read_text()[-2000:]
            assert time.monotonic() < deadline, f"the group did not take {steps} steps within 120 s"
            time.sleep(0.5)
        wan_dp.stop_workers(procs, tmp_path, timeout_s=60)
        sent, received = lab.link_bytes(1)
    finally:
        wan_dp.kill_workers(procs)
        lab.close()
    assert [p.returncode for p in procs] == [0, 0]
    finals = [json.loads((tmp_path / f"final-{r}.json").read_text()) for r in range(2)]
    params = sum(p.numel() for p in load_task(None, TaskConfig()).new_model().parameters())
    return finals, sent, received, params


@pytest.mark.slow
def test_dp_workers_average_gradients_across_two_capped_namespaces(tmp_path):
    """Optional (root and iproute2): two DDP workers in two namespaces, 100mbit links; after a few steps on
    different data both ranks hold the same model, and the gradients' bytes crossed the link."""
    finals, sent, received, params = _gloo_group(tmp_path, "d", 3, [])
    assert finals[0]["steps"] == finals[1]["steps"] >= 3
    assert finals[0]["model_hash"] == finals[1]["model_hash"]  # different batches, one model: averaged
    # every step all-reduces the fp32 gradients: with 2 ranks each sends and receives the whole model
    assert min(sent, received) >= finals[1]["steps"] * params * 4 * 0.95


@pytest.mark.slow
def test_sync_diloco_workers_meet_every_h_steps_in_an_all_reduce_across_two_capped_namespaces(tmp_path):
    """Optional (root and iproute2): ``--mode diloco`` with H = 3 in two namespaces. Both ranks end on one
    model after rounds on different data; the link carried each round's fp32 outer gradient, and H times
    fewer bytes than DP's all-reduce of every step's gradients would have."""
    finals, sent, received, params = _gloo_group(tmp_path, "s", 7, ["--mode", "diloco", "--sync-every", "3"])
    assert finals[0]["steps"] == finals[1]["steps"] == 3 * finals[0]["rounds"] and finals[0]["rounds"] >= 3
    assert finals[0]["model_hash"] == finals[1]["model_hash"]  # different batches, one global model
    rounds = finals[1]["rounds"]
    assert rounds * params * 4 * 0.95 <= min(sent, received)
    assert max(sent, received) < finals[1]["steps"] * params * 4 * 0.5


def test_the_outer_step_of_sync_diloco_is_nesterov_sgd_on_the_averaged_outer_gradient(tmp_path):
    """``OuterSync.round`` in a group of one: the global model moves by lr (g + mu g) on its first round
    (Nesterov, momentum from zero) with g = global - local, and the model is set to it; the second round
    carries the momentum."""
    import torch
    import torch.distributed as dist

    wan_dp = _load("wan_dp")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 2)
        start = [p.detach().clone() for p in model.parameters()]
        sync = wan_dp.OuterSync(model, lr=0.7, momentum=0.9, world=1)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1)  # H inner steps moved every parameter by -0.1: g = +0.1
        sync.round()
        for p, p0 in zip(model.parameters(), start):
            torch.testing.assert_close(p.detach(), p0 - 0.7 * (0.1 + 0.9 * 0.1))
        after = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1)
        sync.round()  # momentum 0.9 * 0.1 + 0.1 = 0.19; Nesterov: g + mu * m = 0.1 + 0.171
        for p, p1 in zip(model.parameters(), after):
            torch.testing.assert_close(p.detach(), p1 - 0.7 * (0.1 + 0.9 * 0.19))
        assert sync.rounds == 2
    finally:
        dist.destroy_process_group()


def test_a_cpu_quota_holds_each_node_and_every_process_it_starts():
    """Optional (root, iproute2, cgroup v1's cpu controller): ``NetLab(cpu=...)`` puts each node's command,
    and the processes it starts, in a cgroup of its own with that quota, and removes the groups on close."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    import subprocess

    from node.chaos.netns import CPU_CGROUPS, NetLab, NetnsError
    from protocol.errors import ConfigError

    try:
        lab = NetLab(2, tag=f"q{os.getpid() % 100000}", cpu=0.5)
        lab.open()
    except (ConfigError, NetnsError) as e:
        pytest.skip(f"no namespaces or cpu cgroups here: {e}")
    groups = [CPU_CGROUPS / lab.ns(i) for i in range(2)]
    try:
        for i, group in enumerate(groups):
            period = int((group / "cpu.cfs_period_us").read_text())
            assert int((group / "cpu.cfs_quota_us").read_text()) == period // 2
            # a grandchild: the shell the node's command starts, then cat
            out = subprocess.run(lab.command(i, ["sh", "-c", "cat /proc/self/cgroup"]), capture_output=True,
                                 text=True, timeout=30, check=True).stdout  # fmt: skip
            cpu_line = next(line for line in out.splitlines() if line.split(":")[1].split(",")[0] == "cpu")
            assert cpu_line.endswith(f"/{lab.ns(i)}")
    finally:
        lab.close()
    assert not any(g.exists() for g in groups)
    with pytest.raises(ConfigError, match="cores per node"):
        NetLab(1, cpu=-1)


@pytest.mark.slow
def test_a_contribution_several_times_the_request_deadline_on_a_capped_link_merges_with_no_failover(tmp_path):
    """Optional (root and iproute2): two real nodes of synchronous DiLoCo in two namespaces, links capped at
    10 Mbit/s, a request deadline of 1 s (``--rpc-timeout-s``). The contribution that crosses the link is the
    whole model in fp32 (3.6 MB: about 3 s on the link), so it runs past any fixed deadline of that size; it
    arrives within its bytes' allowance (``node.swarm.links``), rounds merge both learners, and no
    contribution fails over or is dropped."""
    from node.common.events import read_events
    from node.common.status_client import fetch_status
    from node.local.launcher import kill_group, wait_ready
    from tests.netns_util import open_lab

    lab = open_lab(2, "10mbit", "c")
    flags = ["--threads", "1", "--swarm", f"capped-{os.getpid()}", "--system", "sync-diloco"]
    flags += ["--sync-every", "6", "--rpc-timeout-s", "1"]
    children = []
    try:
        children.append(lab.start(0, tmp_path, flags, []))
        wait_ready(children, 90)
        children.append(lab.start(1, tmp_path, flags, children[0].maddrs))
        wait_ready(children[1:], 90)
        learners = {c.peer_id for c in children}

        def merged_both() -> list[dict]:
            return [
                r
                for c in children
                for r in read_events(c.state_dir / "events.jsonl")
                if r["kind"] == "merge" and set(r.get("learners", [])) == learners
            ]

        deadline = time.monotonic() + 150
        while len(merged_both()) < 2:
            assert all(c.proc.poll() is None for c in children), children[0].tail()
            assert time.monotonic() < deadline, "two rounds merging both learners: not within 150 s"
            time.sleep(1.0)
        docs = [lab.inside(c.index, lambda c=c: fetch_status(c.url, timeout_s=5)) for c in children]
        stopped = (
            time.time()
        )  # a contribution in flight when its synchroniser is killed fails over: not counted
    finally:
        for c in children:
            kill_group(c)
        lab.close()
    events = [r for c in children for r in read_events(c.state_dir / "events.jsonl")]
    assert [r for r in events if r["kind"] in ("failover", "drop", "stall") and r["t"] < stopped] == []
    sent = [
        call
        for d in docs
        for call in d["transfers"]["recent"]
        if call["op"] == "contribute" and call["outcome"] == "ok"
    ]
    assert sent, [d["transfers"]["recent"] for d in docs]
    # the model's fp32 weights crossed the link, a call well past the 1 s deadline
    assert max(call["seconds"] for call in sent) > 2.0, sent
    by_op = [d["transfers"]["by_op"].get("contribute", {}) for d in docs]
    assert max(row.get("sent", 0) for row in by_op) > 3_000_000, by_op
