"""Learner units that span processes (node.unit): real gloo process groups on loopback.

The first test runs the unit's exchange in two spawned processes and checks it against a rank that diverges;
the second runs a 2-node swarm in which one node is a 2-process unit launched through torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.swarm_util import Swarm, assert_unit_trained_and_converged, exit_now, wait_until


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from node.learner.learner import InnerConfig, Learner
    from node.learner.task import load_task
    from node.learner.unit import PAUSE, STATE, STEP, STOP, Unit
    from protocol.config import ProtocolConfig
    from tests.conftest import tiny_task_config

    torch.set_num_threads(1)
    # a file rendezvous: no TCP port picked in advance that another process could take first
    unit = Unit(rank=rank, world=2, local_rank=rank, timeout_s=60, init_method=f"file://{init_file}")
    unit.init()
    task = load_task(None, tiny_task_config())
    pcfg = ProtocolConfig(fragments=2, sync_every=4, overlap=1)
    # different seeds: each rank draws its own batches, so only the exchange keeps the ranks identical
    lrn = Learner(f"r{rank}", task, pcfg, InnerConfig(), 100, seed=10 + rank)
    lrn.attach_unit(unit)
    log = {}
    unit.exchange(lrn, STATE)
    for _ in range(3):  # lockstep steps keep the ranks identical
        unit.exchange(lrn, STEP)
        lrn.train_step()
    unit.exchange(lrn, PAUSE, check_all=True)
    log["after_steps"] = unit.mismatches
    # rank 0 adopts a merged fragment; the others only see it through the exchange
    if rank == 0:
        theta = {n: torch.randn_like(lrn.params[n]) for n in lrn.plan.fragments[1].names}
        assert lrn.adopt(1, 5, theta)
    unit.exchange(lrn, STEP, adopted=[1])
    lrn.train_step()
    log["after_adopt"] = unit.mismatches
    # a rank whose parameters drift (a broken broadcast would do this) is caught and repaired
    if rank == 1:
        with torch.no_grad():
            lrn.params[lrn.plan.fragments[0].names[0]].add_(1.0)
    unit.exchange(lrn, PAUSE, check_all=True)
    log["after_drift"] = unit.mismatches
    unit.exchange(lrn, PAUSE)  # carries the repair
    unit.exchange(lrn, STOP)  # checks the whole model
    log["after_repair"] = unit.mismatches
    log["checks"] = unit.checks
    log["digest"] = unit._digest(lrn, [0, 1]).tolist()
    log["steps"] = lrn.steps
    unit.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(log, fh)
    exit_now()


@pytest.mark.slow
def test_unit_exchange_keeps_ranks_identical_and_repairs_a_rank_that_drifts(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["after_steps"] == 0 and r0["after_adopt"] == 0
    assert r0["after_drift"] == 1  # rank 1 found different
    assert r0["after_repair"] == 1  # and no new mismatch once repaired
    assert r0["checks"] == 6  # STATE, the check_all pause, the adoption, the drift check, the repair, STOP
    assert r0["digest"] == r1["digest"] and r0["steps"] == r1["steps"] == 4


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.slow
def test_two_process_unit_trains_in_a_swarm_and_the_swarm_converges(swarm):
    swarm.start_many(2, extra={0: ["--nproc", "2"]})
    unit_peer, other = swarm.children[0].peer_id, swarm.children[1].peer_id

    def both_merged():
        return {unit_peer, other} <= swarm.merged_contributors(1) and swarm.status()[0]["learner"]["unit"][
            "checks"
        ] >= 10

    wait_until(both_merged, 120, "both nodes' contributions merged and the unit's ranks checked")
    st = swarm.status()
    unit = st[0]["learner"]["unit"]
    assert unit["world"] == 2 and unit["backend"] == "gloo" and unit["mismatches"] == 0
    # the unit's steps count both ranks' tokens; the single-process node's count its own
    assert st[0]["learner"]["tokens_per_step"] == 2 * st[1]["learner"]["tokens_per_step"]
    shown = subprocess.run(
        [sys.executable, "-m", "node", "status", "--url", swarm.children[0].url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0 and "learner unit: 2 processes (gloo)" in shown.stdout, shown.stderr
    assert_unit_trained_and_converged(swarm, st[0]["learner"]["tokens_per_step"])
    t_stop = time.monotonic()
    swarm.stop()
    stop_s = time.monotonic() - t_stop
    for c in swarm.children.values():
        assert c.proc.returncode == 0, (c.index, c.proc.returncode, f"stop took {stop_s:.0f} s", c.tail(80))
    done = json.loads((swarm.children[0].state_dir / "final.json").read_text())
    assert done["unit"]["mismatches"] == 0 and done["unit"]["checks"] > unit["checks"]


def _state(pid: int) -> str:
    """The process's state letter ('' once it is gone); a killed orphan may stay a zombie ('Z')."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _maps(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return fh.read()
    except OSError:
        return ""


def test_a_rank_dies_with_its_launcher_even_during_its_imports(tmp_path):
    """``python -m node`` under torchrun asks the kernel for SIGKILL on its parent's death before its
    imports: a rank whose launcher was killed during its seconds of imports (the node's process group,
    kill -9) lived on, waiting on a rendezvous with peers that were gone."""

    from node.common.lifetime import started_by_torchrun

    assert started_by_torchrun({"WORLD_SIZE": "2", "RANK": "1"})
    assert not started_by_torchrun({"WORLD_SIZE": "1", "RANK": "0"}) and not started_by_torchrun({})
    launcher = (
        "import os, subprocess, sys, time\n"
        "env = dict(os.environ, WORLD_SIZE='2', RANK='1', LOCAL_RANK='1', MASTER_ADDR='127.0.0.1',"
        " MASTER_PORT='9')\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'node', 'node', '--state-dir', {str(tmp_path)!r}], env=env)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    rank = int(parent.stdout.readline())
    try:
        wait_until(lambda: "libtorch" in _maps(rank), 60, "the rank importing torch")
        parent.kill()
        parent.wait(timeout=30)
        wait_until(lambda: _state(rank) in ("", "Z"), 10, "the rank gone with its launcher")
    finally:
        parent.kill()
        parent.wait(timeout=30)
        if _state(rank) not in ("", "Z"):
            os.kill(rank, 9)
