"""The robust merge: weighted CenteredClip with capped token weights bounds what a minority
of the weight moves a merge by, whatever it sends; it is on in public swarms, off in private ones and in the
baselines."""

import math
from dataclasses import replace

import pytest
import torch

from node.local.hostile import alie_gradient, alie_z
from protocol import codecs, robust
from protocol.codecs import encode_tensors
from protocol.config import ProtocolConfig
from protocol.errors import ConfigError
from protocol.merge import weighted_mean
from protocol.record_checks import readable
from protocol.replica import FragmentReplica
from protocol.robust import capped_weights, centered_clip, weighted_median
from protocol.synchroniser import Contribution, round_share
from protocol.systems import system_protocol


def _honest(n: int, numel: int, noise: float, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(numel, generator=g)
    return mean, [mean + noise * torch.randn(numel, generator=g) for _ in range(n)]


def _cc(xs, ws, **kw):
    return centered_clip(torch.zeros_like(xs[0]), [(x, None, 1.0) for x in xs], ws, **kw)


def test_weights_are_capped_at_a_multiple_of_their_low_median():
    assert capped_weights([1.0, 1.0, 1.0, 16.0], 1.0) == [1.0, 1.0, 1.0, 1.0]
    assert capped_weights([1.0, 16.0], 1.0) == [1.0, 1.0]  # the low median of two is the smaller
    assert capped_weights([1.0, 2.0, 3.0, 100.0], 2.0) == [1.0, 2.0, 3.0, 4.0]
    assert capped_weights([1.0, 16.0], 0.0) == [1.0, 16.0]  # 0: no cap
    assert capped_weights([5.0], 1.0) == [5.0]


def test_weighted_median_is_where_half_the_weight_is_reached():
    assert weighted_median([3.0, 1.0, 2.0], [1.0, 1.0, 1.0]) == 2.0
    assert weighted_median([1.0, 2.0, 3.0], [1.0, 1.0, 5.0]) == 3.0
    assert weighted_median([1.0, 2.0], [1.0, 1.0]) == 1.0


def test_without_a_liar_centered_clip_is_the_weighted_mean():
    mean, xs = _honest(4, 20_000, noise=1.0)
    plain = weighted_mean(xs, [1.0, 2.0, 1.0, 1.0])
    got = _cc(xs, [1.0, 2.0, 1.0, 1.0])
    assert torch.linalg.vector_norm(got - plain) < 0.02 * torch.linalg.vector_norm(plain)
    same = _cc([mean, mean.clone(), mean.clone()], [1.0, 1.0, 1.0])
    assert torch.allclose(same, mean, atol=1e-6)  # every learner agrees: exactly their value


@pytest.mark.parametrize("lie", ["flip", "flip-x1000", "orthogonal-x30"])
def test_one_liar_of_five_moves_the_merge_a_bounded_amount(lie):
    mean, xs = _honest(4, 20_000, noise=1.0)
    honest = _cc(xs, [1.0] * 4)
    spread = statistics_spread(xs, honest)
    if lie == "flip":
        bad = -honest
    elif lie == "flip-x1000":
        bad = -1000 * honest
    else:
        g = torch.Generator().manual_seed(9)
        bad = 30 * torch.linalg.vector_norm(honest) * codecs_unit(torch.randn(honest.numel(), generator=g))
    robust = _cc([*xs, bad], [1.0] * 5)
    plain = weighted_mean([*xs, bad], [1.0] * 5)
    moved = float(torch.linalg.vector_norm(robust - honest))
    # a fifth of the weight, each pull clipped to the median distance: about spread * 0.2 / 0.8
    assert moved < 0.5 * spread
    assert float(torch.linalg.vector_norm(plain - honest)) > 1.5 * moved  # the plain mean is moved further
    cos = float(robust @ honest / (torch.linalg.vector_norm(robust) * torch.linalg.vector_norm(honest)))
    assert cos > 0.9


def test_a_little_is_enough_hides_inside_the_honest_spread():
    """The runner's "a little is enough" (bench/robust_merge.py): the honest mean less z of their standard
    deviations, closer to the mean than any honest update, so the robust merge takes it like an honest one; at
    the paper's z for 1 of 5 it moves the merge by a small part of the spread, each coordinate the same way."""
    assert alie_z(5, 1) == pytest.approx(0.2533, abs=1e-3) and alie_z(6, 2) == pytest.approx(0.4307, abs=1e-3)
    mean, xs = _honest(4, 20_000, noise=1.0)
    bad = alie_gradient([{"w": x} for x in xs], alie_z(5, 1))["w"]
    stack = torch.stack(xs)
    assert torch.allclose(bad, stack.mean(0) - alie_z(5, 1) * stack.std(0, correction=0), atol=1e-6)
    centre = stack.mean(0)
    assert float(torch.linalg.vector_norm(bad - centre)) < min(
        float(torch.linalg.vector_norm(x - centre)) for x in xs
    )
    honest = _cc(xs, [1.0] * 4)
    moved = _cc([*xs, bad], [1.0] * 5) - honest
    assert float(torch.linalg.vector_norm(moved)) < 0.1 * statistics_spread(xs, honest)
    assert float((moved < 0).float().mean()) > 0.9  # the same way in (nearly) every coordinate


def statistics_spread(xs, centre):
    ds = sorted(float(torch.linalg.vector_norm(x - centre)) for x in xs)
    return ds[len(ds) // 2]


def codecs_unit(x):
    return x / torch.linalg.vector_norm(x)


def _textbook_cc(xs, ws, radial=False, iters=robust.ITERS):
    """CenteredClip as the paper writes it, in float64 on whole tensors: v moved ``iters`` times by the
    weighted mean of (x_i - v), each clipped to the weighted median distance."""
    xs = [x.double() for x in xs]
    ws = [w / sum(ws) for w in ws]
    norms = [float(torch.linalg.vector_norm(x)) for x in xs]
    if radial:
        xs = [x / n if n > 0 else x for x, n in zip(xs, norms)]
    v = torch.zeros_like(xs[0])
    for _ in range(iters):
        dist = [float(torch.linalg.vector_norm(x - v)) for x in xs]
        tau = weighted_median(dist, ws)
        v = v + sum(w * min(1.0, tau / d if d > 0 else 1.0) * (x - v) for x, w, d in zip(xs, ws, dist))
    if radial:
        v = v * (weighted_median(norms, ws) / float(torch.linalg.vector_norm(v)))
    return v.float()


@pytest.mark.parametrize("radial", [False, True])
@pytest.mark.parametrize("case", ["honest", "liar-x1000", "orthogonal-liar", "zero", "unequal-weights"])
def test_centered_clip_from_inner_products_is_the_textbook_iteration(case, radial):
    """The passes run on the iterate's coefficients and the contributions' inner products (two reads of
    each contribution): the same result as moving v pass by pass over the tensors themselves."""
    mean, xs = _honest(4, 30_000, noise=0.7, seed=11)
    ws = [1.0] * 4
    if case == "liar-x1000":
        xs, ws = [*xs, -1000 * mean], ws + [1.0]
    elif case == "orthogonal-liar":
        g = torch.Generator().manual_seed(3)
        xs, ws = (
            [*xs, 40 * torch.linalg.vector_norm(mean) * codecs_unit(torch.randn(30_000, generator=g))],
            ws + [2.0],
        )
    elif case == "zero":
        xs, ws = [*xs, torch.zeros(30_000)], ws + [1.0]
    elif case == "unequal-weights":
        ws = [1.0, 3.0, 0.5, 2.0]
    want = _textbook_cc(xs, ws, radial=radial)
    got = _cc(xs, ws, radial=radial)
    assert float(torch.linalg.vector_norm(got - want)) <= 1e-5 * float(torch.linalg.vector_norm(want))
    # one pass less or more moves it: the comparison can tell the iterations apart
    fewer = _textbook_cc(xs, ws, radial=radial, iters=robust.ITERS - 1)
    if case in ("liar-x1000", "orthogonal-liar"):
        assert float(torch.linalg.vector_norm(fewer - want)) > 1e-4 * float(torch.linalg.vector_norm(want))


def test_radial_keeps_rda_radius_and_a_robust_direction():
    _, xs = _honest(4, 5_000, noise=0.5)
    norms = sorted(float(torch.linalg.vector_norm(x)) for x in xs)
    got = _cc(xs, [1.0] * 4, radial=True)
    assert math.isclose(float(torch.linalg.vector_norm(got)), norms[1], rel_tol=1e-5)  # the weighted median
    flipped = _cc([*xs, -1000 * got], [1.0] * 5, radial=True)
    cos = float(flipped @ got / (torch.linalg.vector_norm(flipped) * torch.linalg.vector_norm(got)))
    assert cos > 0.95
    assert float(torch.linalg.vector_norm(flipped)) < 1.5 * norms[-1]  # its norm is not a vote


def test_ranges_of_wire_forms_give_the_whole_tensors_values(monkeypatch):
    """Read a range at a time from int4 wire forms and re-anchored on an older base: the same as the whole
    decoded, re-anchored tensors (and the same as those held whole for the passes, ``WHOLE_BYTES``)."""
    monkeypatch.setattr(codecs, "RANGE", 256)
    monkeypatch.setattr(robust, "WHOLE_BYTES", 0)
    _, xs = _honest(3, 3_000, noise=1.0, seed=4)
    theta, base = torch.randn(3_000), torch.randn(3_000)
    wire = [encode_tensors({"w": x}, "int4", 64)["w"] for x in xs]
    decoded = [codecs.get_codec("int4").decode(w) for w in wire]
    parts = [(wire[0], None, 1.0), (wire[1], base, 1.0), (wire[2], None, 0.5)]
    got = centered_clip(theta, parts, [1.0, 1.0, 2.0])
    whole = [decoded[0], (theta - base) + decoded[1], decoded[2] * 0.5]
    monkeypatch.setattr(codecs, "RANGE", 1 << 20)
    monkeypatch.setattr(robust, "WHOLE_BYTES", 64 << 20)  # held whole for the passes
    want = centered_clip(theta, [(x, None, 1.0) for x in whole], [1.0, 1.0, 2.0])
    assert torch.allclose(got, want, atol=1e-5)


def _replica_and_contributions(liar_tokens: int):
    torch.manual_seed(0)
    theta = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    mean = {k: 0.01 * torch.randn_like(v) for k, v in theta.items()}
    cs = []
    for i in range(4):
        delta = {k: m + 0.01 * torch.randn_like(m) for k, m in mean.items()}
        cs.append(Contribution(f"h{i}", 0, 0, 8, 800, 0.1, encode_tensors(delta, "int4", 64), f"h{i}:0:8"))
    lie = {k: -m for k, m in mean.items()}
    cs.append(Contribution("liar", 0, 0, 8, liar_tokens, 0.1, encode_tensors(lie, "int4", 64), "liar:0:8"))
    return theta, mean, cs


@pytest.mark.parametrize("merge", ["rda", "mean"])
def test_a_record_of_the_robust_merge_resists_an_inflated_flipped_learner_and_applies_everywhere(merge):
    theta, _, cs = _replica_and_contributions(liar_tokens=3200)  # 16x a learner's weight
    cfg = ProtocolConfig(robust="centered-clip", merge=merge, clip_factor=0.0)
    plain_cfg = replace(cfg, robust="off")
    made = FragmentReplica(0, theta, is_embedding=False).make_record(1, cs, cfg)
    plain = FragmentReplica(0, theta, is_embedding=False).make_record(1, cs, plain_cfg)
    got = torch.cat([made.grad[k].reshape(-1) for k in ("w", "b")])
    bad = torch.cat([plain.grad[k].reshape(-1) for k in ("w", "b")])
    fair = FragmentReplica(0, theta, is_embedding=False).make_record(1, cs[:4], plain_cfg)  # no liar
    want = torch.cat([fair.grad[k].reshape(-1) for k in ("w", "b")])

    def cos(a, b):
        return float(a @ b / (torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)))

    assert cos(got, want) > 0.9
    assert cos(bad, want) < 0  # the same contributions, merged plainly, go the liar's way
    # the record carries the uncapped weights its counters give (every replica checks them) and lands alike
    other = FragmentReplica(0, theta, is_embedding=False)
    other.check_record(made, cfg)
    other.apply_record(made, cfg)
    assert other.hash == made.new_hash


def test_auto_is_robust_in_a_public_swarm_only_and_never_in_the_baselines():
    cfg = ProtocolConfig()
    assert cfg.robust == "auto"
    assert system_protocol("decoupled", cfg, 4, trusted=False)[0].robust == "centered-clip"
    assert system_protocol("decoupled", cfg, 4, trusted=True)[0].robust == "off"
    for baseline in ("streaming", "sync-diloco"):
        assert system_protocol(baseline, cfg, 4, trusted=False)[0].robust == "off"
    forced = replace(cfg, robust="centered-clip")
    assert system_protocol("decoupled", forced, 4, trusted=True)[0].robust == "centered-clip"
    with pytest.raises(ConfigError, match="robust"):
        ProtocolConfig(robust="median")
    with pytest.raises(ConfigError, match="share_cap"):
        ProtocolConfig(share_cap=float("nan"))


def test_a_robust_round_waits_a_period_for_its_quorum_then_merges_whoever_is_in():
    """A round of one contribution is that contribution, whatever it holds: on the swarm's schedule the robust
    merge waits for a majority to compare it with (real nodes on a loaded machine merged a fifth of their
    rounds from one or two learners, and a flipped learner's own rounds went through whole), three quarters
    of the live learners where that is more than 3 (one liar of 5 held a third of the rounds of 3), but
    only for a period: a live learner that stopped contributing must not stop the rounds."""
    from protocol.synchroniser import Merge, SyncState, effective_quorum, on_contribution, on_tick

    robust, plain = ProtocolConfig(robust="centered-clip"), ProtocolConfig(robust="off")
    five = frozenset("abcde")
    sched = SyncState(0, live=five, due_at=10.0, due_every=4.0)
    assert effective_quorum(robust, sched) == 4  # three quarters of 5, rounded up
    assert effective_quorum(robust, replace(sched, live=frozenset("abcdef"))) == 5
    assert effective_quorum(robust, replace(sched, live=frozenset("abcdefghijkl"))) == 9
    assert effective_quorum(robust, replace(sched, live=frozenset("abc"))) == 2  # never every live learner
    assert effective_quorum(robust, replace(sched, live=frozenset("abcd"))) == 3
    assert effective_quorum(robust, replace(sched, live=frozenset("ab"))) == 1
    assert effective_quorum(replace(robust, quorum=4), sched) == 4
    assert effective_quorum(plain, sched) == 1
    assert effective_quorum(robust, SyncState(0, live=five)) == 1  # no schedule yet: K

    def contrib(learner):
        return Contribution(learner, 0, 0, 8, 800, 0.1, None, f"{learner}:0:8")

    four = replace(sched, live=frozenset("abcd"))  # K = 3
    st = four
    for learner, t in (("a", 9.9), ("b", 10.0)):
        d = on_contribution(robust, st, contrib(learner), t)
        st = d.state
    assert not any(isinstance(a, Merge) for a in d.actions) and "waiting for quorum 2/3" in d.reason
    assert not any(isinstance(a, Merge) for a in on_tick(robust, st, 13.9).actions)
    late = on_tick(robust, st, 14.0)  # a period after its slot: whoever is in
    assert any(isinstance(a, Merge) for a in late.actions) or late.state.quorum_at is not None, late.reason
    alone = on_contribution(robust, four, contrib("a"), 9.9).state
    for t in (14.0, 30.0):  # one contribution is never merged alone while other live learners may join it
        assert not any(isinstance(a, Merge) for a in on_tick(robust, alone, t).actions)
    three = on_contribution(robust, st, contrib("c"), 10.1)
    assert three.state.quorum_at is not None  # the third learner: quorum at once
    st = sched  # five live: K = 4
    for learner, t in (("a", 9.9), ("b", 10.0), ("c", 10.1)):
        st = on_contribution(robust, st, contrib(learner), t).state
    assert st.quorum_at is None
    assert on_contribution(robust, st, contrib("d"), 10.2).state.quorum_at is not None
    assert on_contribution(plain, sched, contrib("a"), 9.9).state.quorum_at is not None  # plain: K = 1


def test_identities_with_no_merged_work_count_for_nothing_in_a_robust_round():
    """Identities are free in a public swarm: a robust round's quorum and share count the live learners whose
    work was merged lately, not membership records. 3 real nodes beside 2,000 signed records with no process
    behind them waited for 1,503 learners each round (a period each), and would have scaled every round's
    share down by 2,003; a node that has not watched the swarm merge for long enough counts every record."""
    from node.swarm.trust.work_book import WorkBook
    from protocol.synchroniser import (
        Merge,
        SyncState,
        effective_quorum,
        on_contribution,
        on_membership,
        quorum_basis,
    )

    robust, plain = ProtocolConfig(robust="centered-clip"), ProtocolConfig(robust="off")
    real, crowd = frozenset("abcd"), frozenset(f"sybil{i}" for i in range(2000))
    book = WorkBook()
    assert book.working(real | crowd, 100.0, 30.0) is None  # nothing merged yet: unknown
    for learner in "abc":
        book.merged(learner, 0, 100.0)
    assert book.working(real | crowd, 110.0, 30.0) is None  # watched for 10 s of a 30 s window: unknown
    book.merged("d", 1, 125.0)
    assert book.working(real | crowd, 130.0, 30.0) == real
    assert book.working(real | crowd, 140.0, 30.0) == frozenset("d")  # a, b, c last merged 40 s ago
    assert book.working(real | crowd, 130.0, 0.0) is None  # no schedule: no window
    # watched once for a whole window, a node still knows its workers when the window grows with the rounds'
    # period (a loaded machine): 45 s watched of a 60 s window, after a 30 s one was met
    assert book.working(real | crowd, 145.0, 60.0) == real
    assert WorkBook().working(real, 145.0, 60.0) is None  # nothing merged: unknown, whatever the window

    sched = SyncState(0, due_at=10.0, due_every=4.0)
    crowded = on_membership(robust, sched, real | crowd, 0.0).state
    assert effective_quorum(robust, crowded) == 1503  # the records counted: three quarters of 2,004
    counted = on_membership(robust, sched, real | crowd, 0.0, book.working(real | crowd, 130.0, 30.0)).state
    assert quorum_basis(robust, counted) == real and effective_quorum(robust, counted) == 3
    assert quorum_basis(plain, counted) == real | crowd  # a private swarm counts its members as before
    # a working learner that left the view does not count: the basis is the live ones among the workers
    gone = on_membership(robust, counted, frozenset("abc") | crowd, 0.0, counted.working).state
    assert quorum_basis(robust, gone) == frozenset("abc") and effective_quorum(robust, gone) == 2
    # no worker live: every live one counts (never a quorum of none)
    none = on_membership(robust, counted, crowd, 0.0, frozenset("abcd")).state
    assert quorum_basis(robust, none) == crowd

    def contrib(learner):
        return Contribution(learner, 0, 0, 8, 800, 0.1, None, f"{learner}:0:8")

    st = counted
    for learner, t in (("a", 9.9), ("b", 10.0)):
        st = on_contribution(robust, st, contrib(learner), t).state
    assert st.quorum_at is None
    d = on_contribution(robust, st, contrib("c"), 10.1)  # 3 of the 4 workers, past the slot: merged
    merge = next(a for a in d.actions if isinstance(a, Merge))
    share = round_share(merge.contributions, robust, len(quorum_basis(robust, d.state)))
    assert share == pytest.approx(3 * 8 / (4 * robust.sync_every))  # 3 of 4 workers' rounds, not 3 of 2,004


@pytest.mark.parametrize("merge", ["rda", "mean"])
def test_a_robust_round_of_one_contribution_is_that_contribution_without_the_passes(merge, monkeypatch):
    """CenteredClip of one contribution is the contribution (its passes are skipped): the record is the plain
    mean's, and what the passes give up to the record codec's rounding."""
    theta, _, cs = _replica_and_contributions(liar_tokens=800)
    cfg = ProtocolConfig(robust="centered-clip", merge=merge, clip_factor=0.0)
    calls = []
    monkeypatch.setattr(robust, "centered_clip", lambda *a, **k: calls.append(1) or centered_clip(*a, **k))
    one = FragmentReplica(0, theta, is_embedding=False).make_record(1, cs[:1], cfg)
    assert calls == []
    plain = FragmentReplica(0, theta, is_embedding=False).make_record(1, cs[:1], replace(cfg, robust="off"))
    if merge == "mean":  # the same code path: the same record (RDA's plain path rounds apart by ulps)
        assert one.new_hash == plain.new_hash
    got = readable(one.grad)
    for k in ("w", "b"):
        passes = centered_clip(theta[k], [(cs[0].delta[k], None, 1.0)], [1.0], radial=merge == "rda")
        mine = codecs.read_range(got[k], 0, passes.numel())
        err = torch.linalg.vector_norm(mine - passes.reshape(-1)) / torch.linalg.vector_norm(passes)
        assert err < 0.02, (k, float(err))  # the record codec's rounding, nothing more
    two = FragmentReplica(0, theta, is_embedding=False).make_record(1, cs[:2], cfg)
    assert calls and two.new_hash != plain.new_hash
