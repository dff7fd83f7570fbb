"""FSDP2 learner units (node.unit_fsdp): real gloo process groups, real spawned ranks, file rendezvous.

The first test runs the sharded exchange in two spawned processes: STATE, steps whose due fragments are
gathered into contributions, an adoption, a rank whose slice goes wrong (found and repaired), and a
checkpoint that a second, fresh pair of processes restores. The swarm test runs a 2-node swarm whose node 0
is ``--nproc 2 --shard`` and node 1 ``--nproc 2``, and kills node 1 with -9. The last tests check the clear
errors for what cannot be sharded.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.swarm_util import (
    Swarm,
    assert_unit_trained_and_converged,
    exit_now,
    processes_naming,
    wait_until,
)


def _setup(rank: int, init_file: str, seed: int):
    from node.learner.learner import InnerConfig, Learner
    from node.learner.task import load_task
    from node.learner.unit_fsdp import ShardedUnit
    from protocol.config import ProtocolConfig
    from tests.conftest import tiny_task_config

    torch.set_num_threads(1)
    unit = ShardedUnit(rank=rank, world=2, local_rank=rank, timeout_s=60, init_method=f"file://{init_file}")
    unit.init()
    # P = H = 2: one fragment falls due at every step; fp32 contributions decode exactly
    pcfg = ProtocolConfig(fragments=2, sync_every=2, overlap=1, codec="fp32")
    task = load_task(None, tiny_task_config())
    lrn = Learner(f"r{rank}", task, pcfg, InnerConfig(), 100, seed=seed, device=unit.model_device())
    return unit, lrn


def _whole(lrn) -> dict[str, torch.Tensor]:
    """The unit's parameters gathered whole (a collective: both ranks call it)."""
    return {n: p.full_tensor().detach().clone() for n, p in lrn.params.items()}


def _hex(tensors) -> str:
    from node.learner.unit import digest

    return digest(tensors).numpy().tobytes().hex()


def _step(unit, lrn) -> None:
    from node.learner.unit import STEP

    unit.exchange(lrn, STEP)
    res = lrn.train_step()
    if unit.lead:
        for p in res.due:
            c = lrn.book.counters[p]
            lrn.snapshot(p, (c.c_steps, c.c_tokens))
    else:
        unit.after_step(lrn, res.due)


def _train(rank: int, init_file: str, out_dir: str) -> None:
    from node.learner.unit import PAUSE, STATE, STOP
    from node.swarm.checkpoint import save_checkpoint
    from protocol.codecs import decode_tensors

    unit, lrn = _setup(rank, init_file, seed=10 + rank)
    if rank == 1:  # other weights on rank 1: only STATE makes the ranks agree
        with torch.no_grad():
            for p in lrn.params.values():
                p.add_(0.5)
    log: dict = {"start": _hex(lrn.params.values())}
    lrn.attach_unit(unit)
    log["sharded"] = all(p.to_local().shape[0] < p.shape[0] for p in lrn.params.values() if p.shape[0] > 1)
    unit.exchange(lrn, STATE)
    log["after_state"] = _hex(_whole(lrn).values())
    log["mismatches_state"] = unit.mismatches
    # steps: each due fragment gathered whole into a contribution, compared with base - whole theta
    contribs = []
    for _ in range(3):
        _step(unit, lrn)
        theta = _whole(lrn)
        if unit.lead:
            for (c_steps, c_tokens), p, enc in lrn.ready_contributions():
                got = decode_tensors(enc)
                want = {n: lrn.base[p][n] - theta[n].float() for n in lrn.plan.fragments[p].names}
                contribs.append(
                    {
                        "fragment": p,
                        "equal": all(torch.equal(got[n], want[n]) for n in want),
                        "nonzero": any(bool(want[n].abs().sum() > 0) for n in want),
                        "c_tokens": c_tokens,
                        "c_steps": c_steps,
                    }
                )
    log["contribs"], log["tokens_per_step"] = contribs, lrn.tokens_per_step
    # rank 0 adopts fragment 1; every rank writes its own slice of it
    names1 = lrn.plan.fragments[1].names
    g = torch.Generator().manual_seed(7)
    theta1 = {n: torch.randn(lrn.params[n].shape, generator=g) for n in names1}
    if unit.lead:
        assert lrn.adopt(1, 5, theta1)
    unit.exchange(lrn, PAUSE, adopted=[1])
    log["adopted"] = _hex(theta1[n] for n in names1)
    log["after_adopt"] = _hex(_whole(lrn)[n] for n in names1)
    log["mismatches_adopt"] = unit.mismatches
    # with carry, a round that left this learner out moves every slice by the global change, keeping
    # the unit's own progress (what it trained since the last merged contribution)
    lrn.pcfg = dataclasses.replace(lrn.pcfg, carry=True)  # every rank: the unit gathers the old values
    _step(unit, lrn)
    lrn.ready_contributions()
    before = {n: t.float() for n, t in _whole(lrn).items() if n in names1}
    if unit.lead:
        assert lrn.adopt(1, 6, {n: lrn.base[1][n] + 0.25 for n in names1}, merged=[])
    unit.exchange(lrn, PAUSE, adopted=[1])
    after = _whole(lrn)
    log["carried"] = all(torch.allclose(after[n].float(), before[n] + 0.25, atol=1e-5) for n in names1)
    log["mismatches_carry"] = unit.mismatches
    lrn.pcfg = dataclasses.replace(lrn.pcfg, carry=False)
    # rank 1's slice of the next adopted fragment goes wrong after it was written: found, then repaired
    names0 = lrn.plan.fragments[0].names
    theta0 = {n: torch.randn(lrn.params[n].shape, generator=g) for n in names0}
    if rank == 1:
        honest = unit._digest

        def drifted(learner, frags):
            unit._digest = honest
            with torch.no_grad():
                learner.params[names0[0]].to_local().add_(1.0)
            return honest(learner, frags)

        unit._digest = drifted
    if unit.lead:
        assert lrn.adopt(0, 7, theta0)
    unit.exchange(lrn, PAUSE, adopted=[0])
    log["mismatches_drift"] = unit.mismatches
    unit.exchange(lrn, PAUSE)  # carries the repair, checked again
    log["mismatches_repair"] = unit.mismatches
    log["adopted0"] = _hex(theta0[n] for n in names0)
    log["after_repair"] = _hex(_whole(lrn)[n] for n in names0)
    _step(unit, lrn)
    # a checkpoint: every rank joins the gather, rank 0 writes it
    unit.exchange(lrn, PAUSE, save=True)
    if unit.lead:
        tensors, meta = lrn.state(unit.take_saved())
        save_checkpoint(os.path.join(out_dir, "ck"), lrn.steps, tensors, meta, "t")
        log["saved_params"] = _hex(tensors[f"learner/{n}"] for n in lrn.params)
        log["opt_keys"] = sum(1 for k in tensors if k.startswith("opt/"))
    log["whole_at_save"] = _hex(_whole(lrn).values())
    unit.exchange(lrn, STOP)  # rank 0 takes the whole state and becomes a CPU learner again
    if unit.lead:
        log["unsharded"] = not lrn.sharded and _hex(lrn.params.values()) == log["saved_params"]
    log["checks"], log["steps"] = unit.checks, lrn.steps
    unit.close(lrn)
    with open(os.path.join(out_dir, f"train{rank}.json"), "w") as fh:
        json.dump(log, fh)


def _restore(rank: int, init_file: str, out_dir: str) -> None:
    from node.learner.unit import PAUSE, STATE, STOP
    from node.swarm.checkpoint import load_latest

    unit, lrn = _setup(rank, init_file, seed=20 + rank)
    log: dict = {}
    if unit.lead:
        ck = load_latest(os.path.join(out_dir, "ck"), "t")
        lrn.load_state(ck.tensors, ck.meta)
        saved = ck.tensors
    lrn.attach_unit(unit)
    unit.exchange(lrn, STATE)
    log["whole"] = _hex(_whole(lrn).values())
    log["steps"], log["mismatches"] = lrn.steps, unit.mismatches
    unit.exchange(lrn, PAUSE, save=True)
    if unit.lead:
        tensors, meta = lrn.state(unit.take_saved())
        keys = [k for k in saved if k.startswith(("learner/", "opt/", "base/"))]
        log["same_keys"] = sorted(
            k for k in tensors if k.startswith(("learner/", "opt/", "base/"))
        ) == sorted(keys)
        log["equal"] = [k for k in keys if not torch.equal(tensors[k], saved[k])]
        log["meta_steps"] = meta["steps"]
    _step(unit, lrn)  # and it trains on
    unit.exchange(lrn, STOP)
    unit.close(lrn)
    with open(os.path.join(out_dir, f"restore{rank}.json"), "w") as fh:
        json.dump(log, fh)


def _worker(rank: int, out_dir: str) -> None:
    # file rendezvous: no TCP port picked in advance that another process could take first
    _train(rank, os.path.join(out_dir, "rendezvous-train"), out_dir)
    # a fresh unit (new process group, new learner) restores what the first one saved
    _restore(rank, os.path.join(out_dir, "rendezvous-restore"), out_dir)
    exit_now()


@pytest.mark.slow
def test_sharded_exchange_contributes_adopts_repairs_and_round_trips_its_state(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    t0, t1 = (json.loads((tmp_path / f"train{r}.json").read_text()) for r in (0, 1))
    assert t0["sharded"] and t1["sharded"]
    assert t0["start"] != t1["start"]  # the ranks began from different weights...
    assert t0["after_state"] == t1["after_state"] == t0["start"]  # ...and STATE gave both rank 0's
    assert t0["mismatches_state"] == 0
    # contributions: base - whole theta after the step that made them due, the unit's tokens
    cs = t0["contribs"]
    assert len(cs) == 3 and {c["fragment"] for c in cs} == {0, 1}
    assert all(c["equal"] and c["nonzero"] for c in cs)
    assert all(c["c_tokens"] == c["c_steps"] * t0["tokens_per_step"] for c in cs)
    assert t0["tokens_per_step"] == 2 * 4 * 32  # 2 ranks x batch 4 x 32 tokens
    # adoption: the gathered fragment is the adopted values on every rank
    assert t0["after_adopt"] == t1["after_adopt"] == t0["adopted"]
    assert t0["mismatches_adopt"] == 0
    assert t0["carried"] and t1["carried"] and t0["mismatches_carry"] == 0
    # a wrong slice on rank 1 is found once, and the repair holds
    assert t0["mismatches_drift"] == 1 and t0["mismatches_repair"] == 1
    assert t0["after_repair"] == t1["after_repair"] == t0["adopted0"]
    assert t0["checks"] == 5  # STATE, the adoption, the carried one, the drift, the repair
    assert t0["whole_at_save"] == t1["whole_at_save"] and t0["unsharded"]
    assert t0["opt_keys"] > 0 and t0["steps"] == t1["steps"] == 5
    # restore into a fresh unit: same parameters, optimizer state, base and step
    r0, r1 = (json.loads((tmp_path / f"restore{r}.json").read_text()) for r in (0, 1))
    assert r0["whole"] == r1["whole"] == t0["whole_at_save"]
    assert r0["same_keys"] and r0["equal"] == [] and r0["meta_steps"] == 5
    assert r0["steps"] == r1["steps"] == 5 and r0["mismatches"] == 0


# ------------------------------------------------------------------------------------------- the swarm
@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.slow
def test_a_sharded_unit_and_a_ddp_unit_train_in_a_swarm_converge_and_a_kill_leaves_no_rank(swarm):
    """Node 0 is a sharded unit (``--nproc 2 --shard``), node 1 a DDP unit (``--nproc 2``): both merge, the
    swarm converges, a kill -9 of node 1 leaves none of its processes behind (torchrun and both ranks), and
    node 0 then stops cleanly with its final checkpoint and export."""
    swarm.start_many(2, extra={0: ["--nproc", "2", "--shard"], 1: ["--nproc", "2"]})
    unit_peer, other = swarm.children[0].peer_id, swarm.children[1].peer_id

    def both_merged():
        st = swarm.status()[0]
        return (
            {unit_peer, other} <= swarm.merged_contributors(1)
            and st["learner"]["unit"]["checks"] >= 3
            and st["counters"]["checkpoints"] >= 1
        )

    wait_until(both_merged, 120, "both nodes' contributions merged, adoptions checked, a checkpoint written")
    st = swarm.status()
    unit = st[0]["learner"]["unit"]
    assert unit["world"] == 2 and unit["mode"] == "fsdp" and unit["mismatches"] == 0
    assert st[1]["learner"]["unit"]["world"] == 2 and st[1]["learner"]["unit"]["mode"] != "fsdp"
    # a unit's step counts both ranks' tokens: 2 x batch 8 x 32 tokens (tests.swarm_util.TINY)
    assert st[0]["learner"]["tokens_per_step"] == st[1]["learner"]["tokens_per_step"] == 2 * 8 * 32
    assert_unit_trained_and_converged(swarm, st[0]["learner"]["tokens_per_step"])
    # kill -9 of a unit node's process group: no rank outlives it
    state = str(swarm.children[1].state_dir)
    assert len(processes_naming(state)) >= 3, "torchrun and both ranks of node 1 running"
    swarm.kill9(1)
    wait_until(lambda: not processes_naming(state), 30, "every process of the killed unit node to be gone")
    del swarm.children[1]
    swarm.stop()
    assert swarm.children[0].proc.returncode == 0, swarm.children[0].tail(80)
    done = json.loads((swarm.children[0].state_dir / "final.json").read_text())
    assert done["unit"]["mode"] == "fsdp" and done["unit"]["mismatches"] == 0
    assert done["stop_reason"] and "failed" not in done["stop_reason"]  # final checkpoint and export made
    assert (swarm.children[0].state_dir / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.slow
def test_shard_without_a_multi_process_unit_is_refused(tmp_path, capsys):
    from node.cli.main import main

    assert main(["node", "--shard", "--state-dir", str(tmp_path / "s")]) == 2
    assert "shard=True is invalid for a single-process learner" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # refused before anything started


def test_models_fsdp_cannot_shard_are_named():
    from node.learner.unit_fsdp import check_shardable, shard_blocks
    from protocol.errors import ConfigError

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(4, 4)
            self.temperature = nn.Parameter(torch.tensor(1.0))

    with pytest.raises(ConfigError, match="0-dim parameters \\(temperature\\)"):
        check_shardable(Scalar())
    with pytest.raises(ConfigError, match="float32, torch.float64"):
        check_shardable(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double()))
    with pytest.raises(ConfigError, match="no parameters"):
        check_shardable(nn.ReLU())
    from node.learner.model import ModelConfig, TinyGPT

    m = TinyGPT(ModelConfig(dim=32, layers=3, heads=2, seq_len=32))
    check_shardable(m)
    assert shard_blocks(m) == list(reversed(m.blocks))  # the transformer blocks, then the root


def test_a_plan_that_cuts_the_embedding_by_rows_is_refused_by_a_sharded_unit():
    from node.learner.unit_fsdp import check_plan
    from protocol.errors import ConfigError
    from protocol.fragments import plan_fragments

    shapes = {"emb": 1000, "a": 500, "b": 400, "c": 300}
    check_plan(plan_fragments(shapes, 4, 8, embedding="emb", embedding_rows=10, embedding_cuts=1))
    with pytest.raises(ConfigError, match="--embedding-cuts 1"):
        check_plan(plan_fragments(shapes, 4, 8, embedding="emb", embedding_rows=10, embedding_cuts=2))


def test_a_snapshot_is_measured_from_the_step_that_made_it_due(tiny_task):
    """An adoption that lands while a fragment's snapshot is in flight changes neither the parameters the
    contribution measures nor the base it measures them against (the CPU run of the GPU path's logic)."""
    from node.learner.learner import InnerConfig, Learner
    from protocol.codecs import decode_tensors
    from protocol.config import ProtocolConfig

    lrn = Learner(
        "a",
        tiny_task,
        ProtocolConfig(fragments=2, sync_every=2, overlap=1, codec="fp32"),
        InnerConfig(),
        10,
        0,
    )
    lrn.train_step()
    names = lrn.plan.fragments[0].names
    theta = {n: lrn.params[n].detach().clone() for n in names}
    base = lrn.base[0]
    lrn.snapshot(0, "tag")
    assert lrn.adopt(0, 1, {n: torch.zeros_like(t) for n, t in theta.items()})  # lands before collection
    ((tag, p, enc),) = lrn.ready_contributions()
    got = decode_tensors(enc)
    assert tag == "tag" and p == 0
    assert all(torch.equal(got[n], base[n] - theta[n]) for n in names)
    assert all(bool(lrn.params[n].abs().sum() == 0) for n in names)  # the adoption itself did happen
    assert lrn.ready_contributions() == []
