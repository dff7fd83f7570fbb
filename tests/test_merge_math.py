"""Oracle checks of the synchroniser's arithmetic (protocol.merge, protocol.replica)."""

import pytest
import torch

from protocol.config import ProtocolConfig
from protocol.merge import adopt, anchor, contribution_weight, merge_deltas, outer_step, rda
from protocol.replica import FragmentReplica
from protocol.synchroniser import Contribution


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def test_weight_follows_formula():
    assert contribution_weight(1000, 10) == pytest.approx(1000**2 / 10)
    # same tokens in fewer steps (bigger batches) weighs more; more tokens weighs more
    assert contribution_weight(1000, 5) > contribution_weight(1000, 10)
    assert contribution_weight(2000, 20) > contribution_weight(1000, 10)
    with pytest.raises(ValueError):
        contribution_weight(0, 3)


@pytest.mark.parametrize("method", ["rda", "mean"])
def test_identical_contributions_merge_to_themselves(method):
    d = {"a": rand(4, 5), "b": rand(7, seed=1)}
    merged = merge_deltas([d, d, d], [1.0, 3.0, 0.5], method)
    for k in d:
        torch.testing.assert_close(merged[k], d[k], rtol=1e-6, atol=1e-6)


def test_identical_contributions_change_nothing_beyond_the_outer_step():
    cfg = ProtocolConfig(fragments=1, sync_every=4, overlap=1, merge="rda", record_codec="fp32")
    theta = {"w": rand(3, 3)}
    rep = FragmentReplica(0, theta, is_embedding=False)
    learner = {"w": theta["w"] - 0.1 * rand(3, 3, seed=2)}
    delta = {"w": theta["w"] - learner["w"]}
    cs = [Contribution(f"l{i}", 0, 0, 4, 400 * (i + 1), 1.0, delta, f"c{i}") for i in range(3)]
    rec = rep.make_record(1, cs, cfg)
    rep.apply_record(rec, cfg)
    expect, _ = outer_step(theta, {"w": torch.zeros(3, 3)}, delta, cfg.outer_lr, cfg.outer_momentum)
    torch.testing.assert_close(rep.theta["w"], expect["w"], rtol=0, atol=1e-6)


def test_outer_sgd_lr1_momentum0_is_weighted_average():
    cfg = ProtocolConfig(
        fragments=1,
        sync_every=4,
        overlap=1,
        merge="mean",
        outer_lr=1.0,
        outer_momentum=0.0,
        record_codec="fp32",
    )
    theta = {"w": rand(6)}
    rep = FragmentReplica(0, theta, is_embedding=False)
    locals_ = [rand(6, seed=s) for s in (3, 4, 5)]
    counters = [(3, 300), (5, 900), (2, 100)]
    cs = [
        Contribution(f"l{i}", 0, 0, st, tok, 1.0, {"w": theta["w"] - th}, f"c{i}")
        for i, (th, (st, tok)) in enumerate(zip(locals_, counters))
    ]
    rep.apply_record(rep.make_record(1, cs, cfg), cfg)
    w = [tok**2 / st for st, tok in counters]
    expect = sum(wi * th for wi, th in zip(w, locals_)) / sum(w)
    torch.testing.assert_close(rep.theta["w"], expect, rtol=0, atol=1e-6)


def test_rda_of_equal_norm_inputs_keeps_the_norm():
    ds = [rand(50, seed=s) for s in range(5)]
    ds = [3.0 * d / d.norm() for d in ds]
    out = rda(ds, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert out.norm().item() == pytest.approx(3.0, rel=1e-6)
    # while the plain mean of spread directions shrinks
    assert (sum(ds) / 5).norm().item() < 2.0


def test_rda_of_opposite_inputs_is_zero_not_nan():
    d = rand(10)
    out = rda([d, -d], [1.0, 1.0])
    assert torch.isfinite(out).all() and out.norm().item() == 0.0


def test_outer_step_matches_torch_nesterov_sgd():
    p = torch.nn.Parameter(rand(8))
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    theta, mom = {"w": p.detach().clone()}, {"w": torch.zeros(8)}
    for s in range(5):
        g = rand(8, seed=10 + s)
        p.grad = g.clone()
        opt.step()
        theta, mom = outer_step(theta, mom, {"w": g}, 0.7, 0.9)
        torch.testing.assert_close(theta["w"], p.detach(), rtol=0, atol=1e-6)


def test_anchor_reanchors_old_base_at_current_global():
    base, now, learner = rand(5, seed=1), rand(5, seed=2), rand(5, seed=3)
    d = anchor({"w": now}, {"w": base}, {"w": base - learner})
    torch.testing.assert_close(d["w"], now - learner)


def test_adopt_overwrite_and_mix():
    local, glob = rand(4, seed=1), rand(4, seed=2)
    torch.testing.assert_close(adopt(local, glob, 0.0), glob)
    torch.testing.assert_close(adopt(local, glob, 0.25), 0.25 * local + 0.75 * glob)


def test_replica_rejects_a_record_that_lands_elsewhere():
    cfg = ProtocolConfig(fragments=1, sync_every=4, overlap=1)
    rep = FragmentReplica(0, {"w": rand(4)}, is_embedding=False)
    other = FragmentReplica(0, {"w": rand(4, seed=1)}, is_embedding=False)
    c = Contribution("a", 0, 0, 1, 10, 1.0, {"w": rand(4, seed=9)}, "c")
    rec = rep.make_record(1, [c], cfg)
    before = other.hash
    with pytest.raises(Exception, match="does not follow"):
        other.apply_record(rec, cfg)
    assert other.hash == before and other.round == 0


@pytest.mark.parametrize("codec", ["bf16", "int8", "int4"])
def test_quantised_record_steps_with_the_decoded_gradient_everywhere(codec):
    from protocol.codecs import decode_tensors, encode_tensors, get_codec

    cfg = ProtocolConfig(
        fragments=1, sync_every=4, overlap=1, merge="mean", record_codec=codec, codec_block=8
    )
    theta = {"w": rand(5, 7)}
    maker = FragmentReplica(0, theta, is_embedding=False)
    follower = FragmentReplica(0, theta, is_embedding=False)
    cs = [Contribution(f"l{i}", 0, 0, 4, 400, 1.0, {"w": rand(5, 7, seed=i + 3)}, f"c{i}") for i in range(2)]
    exact = merge_deltas([c.delta for c in cs], [1.0, 1.0], "mean")
    rec = maker.make_record(1, cs, cfg)
    assert rec.codec == codec and rec.wire is not None
    # the record carries the decoded gradient, within the codec's bound of the exact merge
    torch.testing.assert_close(
        rec.grad["w"], decode_tensors(encode_tensors(exact, codec, 8))["w"], rtol=0, atol=0
    )
    assert ((rec.grad["w"] - exact["w"]).abs() <= get_codec(codec).error_bound(exact["w"], 8)).all()
    assert not torch.equal(rec.grad["w"], exact["w"])
    # a replica that only sees the decoded gradient (a record off the wire) lands on the maker's hash
    off_wire = type(rec)(
        rec.fragment,
        rec.round,
        rec.parent_hash,
        rec.new_hash,
        rec.contributors,
        {"w": rec.grad["w"].clone()},
        rec.codec,
        rec.block,
    )
    maker.apply_record(rec, cfg)
    follower.apply_record(off_wire, cfg)
    assert follower.hash == maker.hash == rec.new_hash
