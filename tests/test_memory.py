"""What a node holds: no fragment copies in history, checkpoints written from the tensors,
evaluation without weights of its own, and the account of it all (``node.swarm.memory``)."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from node.learner.evaluation import ParamsModel
from node.learner.learner import InnerConfig, Learner
from node.learner.task import TaskConfig, evaluate, load_task
from node.swarm.checkpoint import CheckpointError, PendingCheckpoint, list_checkpoints, load_checkpoint
from node.swarm.memory import breakdown
from node.swarm.trust.audit_archive import AuditArchive
from node.swarm.trust.work_book import WorkBook
from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError
from protocol.replica import FragmentReplica
from protocol.synchroniser import Contribution

CFG = ProtocolConfig()


def _rounds(rep: FragmentReplica, n: int, cfg=CFG) -> list[dict[str, torch.Tensor]]:
    """Apply ``n`` rounds of random contributions; the state after each, as a reference copy."""
    states = [{k: v.clone() for k, v in rep.theta.items()}]
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        delta = {k: torch.randn(v.shape, generator=g) * 1e-2 for k, v in rep.theta.items()}
        c = Contribution("a", 0, rep.round, 4, 400, 1.0, delta, f"a:0:{i}")
        rep.apply_record(rep.make_record(rep.round + 1, [c], cfg), cfg)
        states.append({k: v.clone() for k, v in rep.theta.items()})
    return states


def _follow(maker: FragmentReplica, followers, rounds: int, cfg: ProtocolConfig) -> list:
    """``rounds`` records made by ``maker``, applied by each follower as records off the wire are (not the
    record it made itself)."""
    recs = []
    for _ in range(rounds):
        g = torch.Generator().manual_seed(200 + maker.round)
        delta = {k: torch.randn(v.shape, generator=g) * 1e-2 for k, v in maker.theta.items()}
        c = Contribution("a", 0, maker.round, 4, 400, 1.0, delta, f"a:0:{maker.round}")
        recs.append(maker.make_record(maker.round + 1, [c], cfg))
        for f in followers:
            f.apply_record(replace(recs[-1]), cfg)
        maker.apply_record(recs[-1], cfg)
    return recs


@pytest.mark.parametrize("codec", ["int4", "fp32"])
def test_a_record_steps_the_momentum_in_place_unless_it_is_lent(codec, monkeypatch):
    from node.swarm.memory import momentum_lent
    from protocol import codecs

    monkeypatch.setattr(codecs, "RANGE", 64)  # several ranges per tensor
    cfg = replace(CFG, record_codec=codec, codec_block=16)
    theta = {"w": torch.randn(37, 9), "b": torch.randn(200)}
    maker, inplace, lent = (FragmentReplica(0, theta, is_embedding=False) for _ in range(3))
    held = dict(inplace.momentum)
    _follow(maker, [inplace, lent], 2, cfg)
    with momentum_lent([lent]):
        reader = dict(lent.momentum)
        frozen = {k: v.clone() for k, v in reader.items()}
        _follow(maker, [inplace, lent], 1, cfg)
        # a reader's tensors stay as they were; the replica moved on in new ones
        assert all(torch.equal(reader[k], frozen[k]) and lent.momentum[k] is not reader[k] for k in reader)
    assert lent.lent == 0
    after = dict(lent.momentum)
    _follow(maker, [inplace, lent], 2, cfg)
    for k in held:
        # in place: the same tensors, holding bit for bit what a new tensor would (the maker's)
        assert inplace.momentum[k] is held[k] and lent.momentum[k] is after[k], k
        assert torch.equal(inplace.momentum[k], maker.momentum[k]), k
        assert torch.equal(lent.momentum[k], maker.momentum[k]), k
        assert torch.count_nonzero(maker.momentum[k]) > 0
    assert inplace.hash == lent.hash == maker.hash


def test_a_record_that_lands_elsewhere_leaves_the_momentum_as_it_was():
    theta = {"w": torch.randn(16, 8)}
    maker, follower = (
        FragmentReplica(0, theta, is_embedding=False),
        FragmentReplica(0, theta, is_embedding=False),
    )
    _follow(maker, [follower], 2, CFG)
    before = {k: v.clone() for k, v in follower.momentum.items()}
    c = Contribution("a", 0, maker.round, 4, 400, 1.0, {"w": torch.randn(16, 8) * 1e-2}, "a:0:x")
    lying = replace(maker.make_record(maker.round + 1, [c], CFG), new_hash="0" * 64)
    with pytest.raises(ProtocolError, match="lands on"):
        follower.apply_record(lying, CFG)
    assert torch.equal(follower.momentum["w"], before["w"]) and follower.round == 2


@pytest.mark.parametrize("codec", ["int4", "fp32"])
def test_an_old_base_is_rebuilt_from_the_records_not_kept(codec):
    cfg = replace(CFG, record_codec=codec, history=4)
    rep = FragmentReplica(0, {"w": torch.randn(32, 16), "b": torch.randn(16)}, False, history=4)
    states = _rounds(rep, 6, cfg)
    for back in range(5):  # the current round and the four the history holds
        r = rep.round - back
        assert rep.keeps(r)
        base = rep.base(r)
        for k in base:
            torch.testing.assert_close(base[k], states[r][k], rtol=0, atol=1e-5)
    assert not rep.keeps(rep.round - 5)
    with pytest.raises(ProtocolError):
        rep.base(rep.round - 5)
    # what it keeps for that: no tensor of the fragment's size, in any codec but fp32
    numel = sum(v.numel() for v in rep.theta.values())
    kept = sum(t.numel() * t.element_size() for t in rep.history_tensors())
    assert kept <= 4 * 4 * numel * (1.0 if codec == "fp32" else 0.2)  # int4: 0.14 plus padding


def test_a_contribution_on_an_older_base_is_anchored_as_with_a_kept_copy():
    rep = FragmentReplica(0, {"w": torch.randn(8, 8)}, False)
    states = _rounds(rep, 3)
    delta = {"w": torch.full((8, 8), 1e-3)}
    c = Contribution("b", 0, 1, 4, 400, 1.0, delta, "b:0:1")
    rec = rep.make_record(rep.round + 1, [c], replace(CFG, record_codec="fp32", merge="mean"))
    # one contributor, the mean: the merged gradient is Theta_now - theta_b = (Theta_now - Theta_1) + delta
    want = states[3]["w"] - states[1]["w"] + delta["w"]
    torch.testing.assert_close(rec.grad["w"], want, rtol=0, atol=1e-5)


def test_a_replica_built_without_copy_shares_its_tensors():
    w = torch.randn(4, 4)
    assert FragmentReplica(0, {"w": w}, False, copy=False).theta["w"] is not None
    assert FragmentReplica(0, {"w": w}, False, copy=False).theta["w"].data_ptr() == w.data_ptr()
    assert FragmentReplica(0, {"w": w}, False).theta["w"].data_ptr() != w.data_ptr()


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "learner/w": torch.randn(64, 8, generator=g),
        "opt/0/step": torch.tensor(3.0),
        "theta/0/w": torch.randn(64, 8, generator=g),
        "gen": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g),
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 3),
    }


def test_a_checkpoint_written_in_parts_loads_as_one(tmp_path):
    t = _tensors(1)
    pending = PendingCheckpoint(tmp_path, 7, t, {"note": "x"}, swarm="s")
    live = {k: v for k, v in t.items() if k.startswith(("learner/", "opt/"))}
    pending.write(live)
    for v in live.values():  # the learner's next step: what it wrote is in the file already
        v.add_(1.0)
    pending.write({k: v for k, v in t.items() if k not in live})
    path = pending.finish()
    ck = load_checkpoint(path, "s")
    assert ck.step == 7 and ck.meta == {"note": "x"}
    ref = _tensors(1)
    for k, v in ref.items():
        assert torch.equal(ck.tensors[k], v), k
    assert set(load_file(str(path))) == set(ref)  # plain safetensors
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_a_checkpoint_missing_a_tensor_is_refused_and_leaves_nothing(tmp_path):
    t = _tensors(2)
    pending = PendingCheckpoint(tmp_path, 1, t, {}, swarm="s")
    pending.write({"learner/w": t["learner/w"]})
    with pytest.raises(CheckpointError, match="never written"):
        pending.finish()
    pending.abandon()
    with pytest.raises(CheckpointError, match="not the one laid out"):
        PendingCheckpoint(tmp_path, 1, t, {}, swarm="s").write({"learner/w": torch.zeros(3)})
    assert list_checkpoints(tmp_path) == []


def test_a_checkpoint_changed_after_it_was_written_is_refused_on_load(tmp_path):
    t = _tensors(3)
    pending = PendingCheckpoint(tmp_path, 2, t, {}, swarm="s")
    pending.write(t)
    path = pending.finish()
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(path, "s")


def _learner():
    task = load_task(None, TaskConfig())
    return task, Learner("m", task, ProtocolConfig(), InnerConfig(), 10, seed=0)


@pytest.mark.slow
def test_evaluation_holds_no_weights_and_gives_the_loaded_models_loss():
    task, lrn = _learner()
    lrn.train_step()
    params = {n: p.detach().clone() for n, p in lrn.params.items()}
    ev = ParamsModel(task, lrn.model)
    assert ev.tensors() == []
    got = ev.evaluate(params)
    ref = task.new_model()
    ref.load_state_dict(params, strict=False)
    assert got == pytest.approx(evaluate(task, ref), rel=1e-6)
    assert ev.tensors() == []  # nothing of the evaluated tensors is kept
    with pytest.raises(KeyError):
        ev.evaluate({})


def test_the_account_counts_a_shared_tensor_once():
    task, lrn = _learner()
    lrn.train_step()
    reps = [
        FragmentReplica(f.index, lrn.base[f.index], f.is_embedding, copy=False) for f in lrn.plan.fragments
    ]
    kept = AuditArchive(1 << 20, None)
    node = SimpleNamespace(
        learner=lrn, replicas=reps, plan=lrn.plan, logs=[], auditor=SimpleNamespace(archive=kept)
    )
    mem = breakdown(node)
    w = mem["weights_bytes"]
    assert w == 4 * sum(p.numel() for p in lrn.params.values())
    host = mem["host"]
    assert host["learner_params"] == w and host["learner_grads"] == w
    assert host["optimizer"] >= 2 * w
    assert host["replica"] == w and host["momentum"] == w
    assert host["bases"] == 0  # the bases are the replicas' tensors
    assert mem["rss"] and mem["rss"] >= mem["host_counted"] - host["eval"]
    # a base that is a copy of its own is counted as one
    lrn.base[0] = {n: t.clone() for n, t in lrn.base[0].items()}
    assert breakdown(node)["host"]["bases"] == 4 * lrn.plan.fragments[0].numel


def test_a_fragment_snapshot_larger_than_256_mib_fits_in_one_frame():
    from node.swarm.frames import MAX_FRAME, max_frame_bytes

    def plan(*numels):
        return SimpleNamespace(fragments=[SimpleNamespace(numel=n) for n in numels])

    assert max_frame_bytes(plan(1000, 2000)) == MAX_FRAME
    # GPT-2's token embedding, 50257 x 768: its snapshot (parameters and momentum) is 309 MB
    embedding = 50257 * 768
    assert max_frame_bytes(plan(embedding, 7_000_000)) >= 8 * embedding > MAX_FRAME


def test_checkpoints_and_evaluations_come_no_more_often_than_their_cpu_share_allows():
    from node.common.priority import paced_wait

    assert paced_wait(60.0, 0.05, 0.02) == 60.0  # a small model: the period
    assert paced_wait(60.0, 6.0, 0.02) == 300.0  # 6 CPU seconds at 2% of a core: 5 minutes apart
    assert paced_wait(60.0, 6.0, 0.0) == 60.0  # share 0: the period alone


_MALLINFO = """
import ctypes, sys
from node.common.heap import steady_allocator, tune_allocator

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
"""


def _run_script(script: str, mode: str, env: dict[str, str]) -> list[str]:
    """What a fresh interpreter prints running ``script`` with argument ``mode``, split."""
    out = subprocess.run(
        [sys.executable, "-c", script, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
        cwd=Path(__file__).resolve().parent.parent,
    )
    return out.stdout.split()


_MAPPED = (
    _MALLINFO
    + """
changed = tune_allocator(2 << 20) if sys.argv[1] == "tune" else False
grown = []
for _ in range(3):  # a 3 MiB block made and freed three times
    before = libc.mallinfo2().hblkhd
    block = bytearray(3 << 20)
    grown.append(libc.mallinfo2().hblkhd - before)
    del block
print(changed, *grown)
"""
)


@pytest.mark.parametrize("env", [{}, {"MALLOC_MMAP_THRESHOLD_": "65536"}])
@pytest.mark.slow
def test_tune_allocator_keeps_large_blocks_out_of_the_heaps(env):
    """With the threshold fixed, every 3 MiB block gets pages of its own (mapped, handed back when freed);
    with glibc's own rule the first free raises the threshold and the next blocks land in the heap, where
    they stay resident once freed. An explicit MALLOC_MMAP_THRESHOLD_ is left alone."""

    def run(mode: str) -> list[str]:
        return _run_script(_MAPPED, mode, env)

    changed, *grown = run("tune")
    assert all(int(g) >= 3 << 20 for g in grown), grown
    if env:
        assert changed == "False"
        return
    assert changed == "True"
    _, *plain = run("plain")
    assert int(plain[0]) >= 3 << 20 and int(plain[1]) == 0 and int(plain[2]) == 0, plain


_STEADY = (
    _MALLINFO
    + """
changed = steady_allocator(400 << 20) if sys.argv[1] == "steady" else False
info = libc.mallinfo2()
mapped0, arena0 = info.hblkhd, info.arena
first = bytearray(20 << 20)  # glibc's own rule maps this one, then raises its threshold when it is freed
mapped = libc.mallinfo2().hblkhd - mapped0
del first
for _ in range(2):  # steps: what one makes it frees
    blocks = [bytearray(20 << 20) for _ in range(4)]
    del blocks
print(changed, mapped, libc.mallinfo2().arena - arena0)
"""
)


@pytest.mark.parametrize("env", [{}, {"MALLOC_TRIM_THRESHOLD_": "1000000"}])
@pytest.mark.slow
def test_the_steady_allocator_keeps_what_a_step_frees_for_the_next(env):
    """Below 100M parameters a node keeps 20 MiB blocks in its heaps from the first one (glibc's own rule maps
    the first and only then raises its threshold), and the 80 MiB a step leaves free at the heap's top stays
    for the next step instead of being handed back and faulted in again. An explicit setting is left alone."""

    def run(mode: str) -> list[int | str]:
        changed, mapped, kept = _run_script(_STEADY, mode, env)
        return [changed, int(mapped), int(kept)]

    changed, mapped, kept = run("steady")
    plain = run("plain")
    assert plain[1] >= 20 << 20 and plain[2] < 20 << 20, plain  # the first block mapped; the rest handed back
    if env:
        assert changed == "False" and mapped >= 20 << 20 and kept < 20 << 20
        return
    assert changed == "True"
    # the heap grew by the 80 MiB less what free space its top already had (32 KiB short, once in CI)
    assert mapped == 0 and kept >= 64 << 20, (mapped, kept)


_THREAD_STEPS = """
import ctypes, resource, sys, threading
if sys.argv[1] == "entry":
    import node.__main__  # what `python -m node` and `ddiloco` import before anything else
from node.common.heap import steady_allocator

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
steady_allocator(400 << 20)
faults = []

def learner():  # three steps, each writing 80 MiB of 20 MiB blocks and freeing them
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [libc.malloc(20 << 20) for _ in range(4)]
        for b in blocks:
            ctypes.memset(b, 1, 20 << 20)
        for b in blocks:
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

t = threading.Thread(target=learner)
t.start()
t.join()
print(*faults)
"""


@pytest.mark.slow
def test_a_node_process_keeps_one_heap_so_a_learner_thread_reuses_what_its_step_freed():
    """A thread of its own gets a glibc arena of 64 MiB heaps, unmapped when wholly free whatever the trim
    threshold: each step after the first faults part of its memory in again (seen in a 2-node 85M swarm:
    21,900 faults a second in one learner). The node's entry (``node.__main__``) keeps every thread on the
    main heap, where the steady allocator keeps a step's memory for the next: no faults after the first."""
    entry = [int(x) for x in _run_script(_THREAD_STEPS, "entry", {})]
    plain = [int(x) for x in _run_script(_THREAD_STEPS, "plain", {})]
    assert entry[0] > 15_000 and plain[0] > 15_000  # the first step faults its 80 MiB in either way
    assert max(entry[1:]) < 200, entry
    assert min(plain[1:]) > 2_000, plain  # the premise: without one heap, a thread's later steps fault
    given = [int(x) for x in _run_script(_THREAD_STEPS, "entry", {"MALLOC_ARENA_MAX": "4"})]
    assert min(given[1:]) > 2_000, given  # an explicit MALLOC_ARENA_MAX is left alone


def test_a_checkpoint_and_a_snapshot_hold_the_momentum_lent_while_other_threads_read_it(monkeypatch):
    """The node's two readers of the momentum off its loop lend it for as long as they read: a record
    applied meanwhile does not write into what they are writing out."""
    import asyncio
    import json

    from node.swarm import catch_up
    from node.swarm.limits import TokenBucket
    from node.swarm.persistence import Persistence
    from tests.test_catch_up import fake_catch_up

    reps = [FragmentReplica(p, {"w": torch.randn(4)}, is_embedding=False) for p in range(2)]
    seen = []

    async def write():
        seen.append(("checkpoint", [r.lent for r in reps]))

    asyncio.run(Persistence.checkpoint(SimpleNamespace(replicas=reps, _checkpoint=write)))

    def encode(states):
        seen.append(("snapshot", [r.lent for r in reps]))
        return b"body"

    async def known(_caller):
        return True

    monkeypatch.setattr(catch_up, "encode_snapshot", encode)
    node = fake_catch_up(
        spec={0: {"w": (4,)}, 1: {"w": (4,)}},
        replicas=reps,
        heads=[(0, r.hash, 1, 1.0) for r in reps],
        logs=[{}, {}],
        merged_tokens=[0, 0],
        work=WorkBook(),
    )
    node.snapshots = TokenBucket(8, 1)
    reply = asyncio.run(node.on_snapshot("peer", json.dumps({"fragments": [1]}).encode()))
    assert reply.ok and seen == [("checkpoint", [1, 1]), ("snapshot", [0, 1])]
    assert [r.lent for r in reps] == [0, 0]
