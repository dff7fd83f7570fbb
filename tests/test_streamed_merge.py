"""The synchroniser merges tensor by tensor from contributions kept in their wire form: the same
record, bit for bit, as the formulas written out over decoded contributions, and one decoded contribution
held at a time, not all of them."""

import json
import math
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from protocol import codecs
from protocol.codecs import decode_tensors, encode_tensors
from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError
from protocol.merge import (
    contribution_weight,
    outer_step,
    outer_theta,
    stepped_momentum,
)
from protocol.messages import ContributionHeader, decode_contribution, encode_contribution
from protocol.norms import global_norm
from protocol.replica import FragmentReplica
from protocol.synchroniser import Contribution

ROOT = Path(__file__).parent.parent


def _unit(x):
    n = torch.linalg.vector_norm(x)
    return x / n if n > 0 else torch.zeros_like(x)


def reference_record_grad(rep, contributions, cfg, live):
    """The merge as its formulas read, over whole decoded contributions (what make_record computed before it
    streamed): anchor at the current global, clip by the norm reference, RDA or the weighted mean with
    Python's ``sum``, the round's share, and the record codec's round trip."""
    weights = [contribution_weight(c.c_tokens, c.c_steps) for c in contributions]
    total = math.fsum(weights)
    ws = [w / total for w in weights]
    ref = rep.norm_reference() if cfg.clip_factor > 0 else None
    deltas = []
    for c in contributions:
        d = (
            decode_tensors(c.delta)
            if any(not isinstance(v, torch.Tensor) for v in c.delta.values())
            else c.delta
        )
        n = global_norm(d)
        if ref is not None and n > cfg.clip_factor * ref:
            d = {k: t * (cfg.clip_factor * ref / n) for k, t in d.items()}
        base = rep.base(c.base_round)
        if base is rep.theta:
            deltas.append(d)
        else:
            deltas.append({k: (rep.theta[k] - base[k]) + d[k] for k in d})
    grad = {}
    for k in rep.theta:
        ds = [d[k] for d in deltas]
        if rep.is_embedding or cfg.merge == "mean":
            grad[k] = sum(w * d for w, d in zip(ws, ds))
        else:
            radius = sum(w * torch.linalg.vector_norm(d) for w, d in zip(ws, ds))
            grad[k] = radius * _unit(sum(w * _unit(d) for w, d in zip(ws, ds)))
    steps = sum(c.c_steps for c in contributions)
    share = min(1.0, steps / (live * cfg.sync_every)) if cfg.carry and live else 1.0
    if share < 1.0:
        grad = {k: t * share for k, t in grad.items()}
    if cfg.record_codec != "fp32":
        grad = decode_tensors(encode_tensors(grad, cfg.record_codec, cfg.codec_block))
    return grad


def _replica(embedding: bool, rounds: int) -> FragmentReplica:
    g = torch.Generator().manual_seed(0)
    theta = {"w": torch.randn(24, 16, generator=g), "b": torch.randn(16, generator=g), "z": torch.zeros(5)}
    rep = FragmentReplica(0, theta, embedding, history=4)
    cfg = ProtocolConfig(record_codec="int4", merge="mean")
    for i in range(rounds):  # earlier rounds, so a contribution can be taken on an older base
        d = {k: torch.randn(v.shape, generator=g) * 1e-2 for k, v in theta.items()}
        c = Contribution(f"x{i}", 0, rep.round, 4, 400, 1.0, d, f"x:{i}")
        rep.apply_record(rep.make_record(rep.round + 1, [c], cfg), cfg)
    return rep


def _wire(delta, codec):
    """``delta`` as the synchroniser keeps it: the contribution message decoded with ``decode=False``."""
    spec = {k: tuple(v.shape) for k, v in delta.items()}
    h = ContributionHeader("l", 0, 0, 1, 1, 1.0, codec, 64, "c")
    _, enc = decode_contribution(encode_contribution(h, encode_tensors(delta, codec, 64)), spec, decode=False)
    return enc


@pytest.mark.parametrize("merge", ["rda", "mean"])
@pytest.mark.parametrize("codec", ["int4", "int8", "bf16", "fp32"])
@pytest.mark.parametrize("embedding", [False, True])
@pytest.mark.parametrize("span", [codecs.RANGE, 128])
def test_streamed_record_is_the_formulas_bit_for_bit(merge, codec, embedding, span, monkeypatch):
    """128: a tensor's merge, quantisation and outer step go over it in several ranges of two blocks."""
    monkeypatch.setattr(codecs, "RANGE", span)
    rep = _replica(embedding, rounds=2)
    record = {"int4": "int8", "int8": "int4", "bf16": "fp32", "fp32": "bf16"}[codec]  # every record codec too
    cfg = ProtocolConfig(
        merge=merge, record_codec=record, clip_factor=2.0, carry=True, sync_every=8, history=4
    )
    g = torch.Generator().manual_seed(1)
    for i in range(3):  # three learners' typical size: the clip has a reference
        rep.norms.add(f"n{i}", 1e-2)
    cs = []
    for i, (base, scale) in enumerate([(2, 1e-2), (1, 1e-2), (2, 0.5), (2, 0.0)]):  # an old base; an outlier
        exact = {k: torch.randn(v.shape, generator=g) * scale for k, v in rep.theta.items()}
        wire = _wire(exact, codec)
        n = rep.check_delta(wire)
        cs.append(Contribution(f"l{i}", 0, base, 3 + i, 100 * (i + 1), 1.0, wire, f"l{i}:0:{i}", n))
    before = {
        k: {n: {p: t.clone() for p, t in e.parts.items()} for n, e in c.delta.items()}
        for k, c in enumerate(cs)
    }
    # the reference sees the same decoded values, and the norm book as it was before the merge
    ref_rep = _replica(embedding, rounds=2)
    ref_rep.norms.rms = {k: list(v) for k, v in rep.norms.rms.items()}
    want = reference_record_grad(ref_rep, cs, cfg, live=3)
    rec = rep.make_record(rep.round + 1, cs, cfg, live=3)
    assert rec.clipped == ("l2:0:2",)
    for k in want:
        assert torch.equal(rec.grad[k], want[k]), k
    want_theta, want_mom = {}, {}
    for k, g in want.items():  # the outer step as written, over whole tensors
        want_mom[k] = cfg.outer_momentum * ref_rep.momentum[k] + g
        want_theta[k] = ref_rep.theta[k] - cfg.outer_lr * (g + cfg.outer_momentum * want_mom[k])
    rep.apply_record(rec, cfg)
    for k in want:
        assert torch.equal(rep.theta[k], want_theta[k]) and torch.equal(rep.momentum[k], want_mom[k]), k
    # the same record from decoded contributions (the in-process runner's form), norms measured in the merge
    decoded = [replace(c, delta=decode_tensors(c.delta), norm=None) for c in cs]
    again = _replica(embedding, rounds=2)
    again.norms.rms = {k: list(v) for k, v in ref_rep.norms.rms.items()}
    assert again.make_record(again.round + 1, decoded, cfg, live=3).new_hash == rec.new_hash
    # and nothing a contribution holds was written to (fp32 decodes to a view of its wire tensor)
    for k, c in enumerate(cs):
        for n, e in c.delta.items():
            for p, t in e.parts.items():
                assert torch.equal(t, before[k][n][p])


def test_outer_step_in_place_is_the_formula_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    theta, mom, grad = (torch.randn(1000, generator=g) for _ in range(3))
    lr, mu = 0.7, 0.9
    v = mu * mom + grad
    want_theta = theta - lr * (grad + mu * v)
    t2, m2 = outer_step({"a": theta}, {"a": mom}, {"a": grad}, lr, mu)
    assert torch.equal(t2["a"], want_theta) and torch.equal(m2["a"], v)
    # the parameters alone, then the momentum (new, or in place): the same values
    assert torch.equal(outer_theta({"a": theta}, {"a": mom}, {"a": grad}, lr, mu)["a"], want_theta)
    fresh = stepped_momentum({"a": mom}, {"a": grad}, mu, in_place=False)["a"]
    assert torch.equal(fresh, v) and fresh.data_ptr() != mom.data_ptr()
    own = mom.clone()
    assert stepped_momentum({"a": own}, {"a": grad}, mu, in_place=True)["a"] is own and torch.equal(own, v)


def test_a_wire_form_contribution_with_nan_is_refused_at_its_check():
    """Not finite on the wire (a value, or a block's scale, NaN or inf): refused when checked at receipt,
    before a merge decodes it again."""
    rep = _replica(False, rounds=0)
    for codec, part in (("fp32", "v"), ("bf16", "v"), ("int8", "s"), ("int4", "s")):
        for bad in (float("nan"), float("inf")):
            wire = _wire({k: torch.full(v.shape, 1e-3) for k, v in rep.theta.items()}, codec)
            wire["b"].parts[part][0] = bad
            with pytest.raises(ProtocolError, match="NaN or inf"):
                rep.check_delta(wire)


PEAK_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from protocol.codecs import encode_tensors
    from protocol.config import ProtocolConfig
    from protocol.messages import ContributionHeader, decode_contribution, encode_contribution
    from protocol.replica import FragmentReplica
    from protocol.synchroniser import Contribution
    torch.set_num_threads(1)
    N, K, decode = 4 << 20, int(sys.argv[1]), sys.argv[2] == "decoded"  # one tensor of 16 MiB in fp32
    rep = FragmentReplica(0, {"w": torch.randn(N)}, True)
    cfg = ProtocolConfig(record_codec="int4", merge="mean")
    raws = []  # the K messages as they arrive
    for i in range(K):
        h = ContributionHeader(f"l{i}", 0, 0, 4, 400, 1.0, "int4", 64, f"l{i}")
        raws.append(encode_contribution(h, encode_tensors({"w": torch.randn(N) * 1e-2}, "int4", 64)))
    def hwm():
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM"))
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak starts again from what is resident now
    before = hwm()
    cs = []
    while raws:  # received, checked and held as the synchroniser does (node.swarm.intake)
        h, delta = decode_contribution(raws.pop(), {"w": (N,)}, decode=decode)
        n = rep.check_delta(delta, cfg)
        cs.append(Contribution(h.learner, 0, 0, 4, 400, 1.0, delta, h.cid, n))
    rep.apply_record(rep.make_record(1, cs, cfg), cfg)
    print(json.dumps({"peak": hwm() - before, "fragment": 4 * N}))
    """
)


def _merge_peak(k: int, how: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD, str(k), how],
        env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    return doc["peak"] / doc["fragment"]


@pytest.mark.slow
def test_a_synchroniser_holds_one_decoded_contribution_at_a_time():
    """From the contributions' receipt to the merged state: with every large block given pages of its own
    (handed back when freed), the resident peak is what is held at once. Contributions kept in their wire
    form: the accumulator, one decoded contribution, the record's gradient and the new state, however many
    contributions came; decoded on receipt (as before), a whole fragment more per contribution."""
    wire = {k: _merge_peak(k, "wire") for k in (2, 10)}
    assert wire[10] <= 4.0, wire  # in fragments' worth: the new state (2), wire forms, ranges
    assert wire[10] - wire[2] < 1.5, wire  # 8 more contributions: their wire bytes (1/7 each), not 8 copies
    decoded = _merge_peak(10, "decoded")
    assert decoded > wire[10] + 5, (decoded, wire)  # the check has teeth: what the old way holds
