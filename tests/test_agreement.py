"""Issue 32, item 2: learners whose outer gradients oppose the rest, found over many rounds
(``protocol.agreement``) from the cosines the robust merge measures (``protocol.robust.agreements``)."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import torch

from protocol.agreement import FLOOR, MIN_ROUNDS, PROBATION, RECENT, AgreementBook, merged_set
from protocol.config import ProtocolConfig
from protocol.replica import FragmentReplica
from protocol.robust import agreements
from protocol.synchroniser import Contribution


def _gram(xs: list[torch.Tensor]) -> torch.Tensor:
    m = torch.stack(xs).double()
    return m @ m.T


def test_the_cosine_of_each_contribution_with_the_sum_of_the_others_directions():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(50, generator=g) * (i + 1) for i in range(4)]
    got = agreements(_gram(xs))
    for i, x in enumerate(xs):
        rest = sum(xs[j] / xs[j].norm() for j in range(4) if j != i)
        assert math.isclose(
            got[i], float(torch.nn.functional.cosine_similarity(x, rest, dim=0)), abs_tol=1e-6
        )
    assert all(math.isnan(a) for a in agreements(_gram([xs[0]])))  # one: no others
    assert math.isnan(agreements(_gram([torch.zeros(50), xs[1]]))[0])  # a zero contribution: no direction


def test_a_learner_that_negates_a_weak_signal_is_distrusted_and_honest_noisy_ones_are_not():
    """Signal a tenth of the noise: one round's cosines do not tell the negated learner apart; a few dozen
    merges do, and no honest learner is judged in the same run."""
    g = torch.Generator().manual_seed(1)
    signal = torch.randn(4000, generator=g) * 0.1
    book, turned_at = AgreementBook(), None
    for r in range(64):
        xs = [signal + torch.randn(4000, generator=g) for _ in range(4)]
        xs.append(-(signal + torch.randn(4000, generator=g)))  # the liar, at honest size
        turned = book.add(["h0", "h1", "h2", "h3", "liar"], agreements(_gram(xs)))
        if turned and turned_at is None:
            assert turned == ["liar"]
            turned_at = r
    assert turned_at is not None and turned_at >= MIN_ROUNDS - 1, turned_at
    assert book.status()["distrusted"] == ["liar"]
    cs = [SimpleNamespace(learner=x) for x in ("h0", "liar", "h1")]
    assert [c.learner for c in book.keep_trusted(cs)] == ["h0", "h1"]
    # on probation: one of its contributions in PROBATION is merged anyway (and measured again); the rest
    # are left out, for as long as its cosines convict it
    merged = [len(book.keep_trusted(cs)) == 3 for _ in range(4 * PROBATION - 1)]  # 1: above
    assert sum(merged) == 4 and all(merged[k * PROBATION - 2] for k in range(1, 5)), merged
    assert book.distrusted("liar")
    # at a node a contribution is judged when it comes (``refuse``) and again at the merge: the one taken on
    # probation is not refused the second time
    took = [not book.refuse("liar") for _ in range(PROBATION)]
    assert sum(took) == 1 and took[-1]
    assert [c.learner for c in book.keep_trusted(cs)] == ["h0", "liar", "h1"]
    assert [c.learner for c in book.keep_trusted(cs)] == ["h0", "h1"]  # probation used
    # one that turned honest earns its way back with the cosines of the rounds it is let into
    turned_back = 0
    while book.distrusted("liar"):
        book.add(["h0", "liar", "h1"], [0.5, 0.5, 0.5])
        turned_back += 1
    assert 0 < turned_back < 64 and book.keep_trusted(cs) == tuple(cs)


def _random_learners_run(signal_scale: float, rounds: int = 64) -> tuple[AgreementBook, list[float]]:
    """4 honest learners (a shared signal plus noise) and 2 that send a random direction at 3x their size."""
    g = torch.Generator().manual_seed(5)
    book = AgreementBook()
    for _ in range(rounds):
        signal = torch.randn(4000, generator=g) * signal_scale
        xs = [signal + torch.randn(4000, generator=g) for _ in range(4)]
        xs += [3.0 * torch.randn(4000, generator=g) for _ in range(2)]
        book.add(["h0", "h1", "h2", "h3", "r0", "r1"], agreements(_gram(xs)))
    return book, [book.mean(x) for x in ("h0", "h1", "h2", "h3", "r0", "r1")]


def test_a_learner_that_sends_a_random_direction_is_distrusted_where_the_swarm_has_a_direction():
    """A random direction reads about 0 round after round; the honest learners read well above: under the
    floor (a quarter of the median learner's mean) the random ones are told apart, as a floor of zero never
    did. Where the honest cosines are themselves small (a signal a tenth of the noise: late in training),
    the floor is small too and no honest learner is judged."""
    book, means = _random_learners_run(1.0)
    assert all(m > 0.3 for m in means[:4]) and all(abs(m) < 0.05 for m in means[4:]), means
    assert book.status()["distrusted"] == ["r0", "r1"]
    assert FLOOR * statistics.median(means) > 0.05  # what a floor of zero would have missed
    weak, means = _random_learners_run(0.1)
    assert not set(weak.status()["distrusted"]) & {"h0", "h1", "h2", "h3"}, (weak.status(), means)


def test_liars_that_outweigh_the_honest_in_size_still_read_below_zero_and_the_honest_above():
    """2 of 6 negate at 2.5x honest size: against the plain sum of the others, each honest learner's
    "others" point the liars' way (3 honest units against 5), and the honest read below 0 too. Against the
    sum of directions, each learner is one vote."""
    g = torch.Generator().manual_seed(4)
    signal = torch.randn(4000, generator=g)
    honest = [signal + torch.randn(4000, generator=g) for _ in range(4)]
    liars = [-2.5 * (signal + torch.randn(4000, generator=g)) for _ in range(2)]
    xs = honest + liars
    got = agreements(_gram(xs))
    assert all(a > 0.1 for a in got[:4]) and all(a < -0.3 for a in got[4:]), got
    plain = [
        float(torch.nn.functional.cosine_similarity(x, sum(xs[j] for j in range(6) if j != i), dim=0))
        for i, x in enumerate(xs)
    ]
    assert all(a < 0 for a in plain), plain  # what the sum as sent read: nobody told apart


def test_bad_cosines_are_ignored_and_few_rounds_judge_nobody():
    book = AgreementBook()
    book.add(["a", "b", "c"], [math.nan, 7.0, -math.inf])
    assert not book.seen
    for _ in range(MIN_ROUNDS - 1):
        book.add(["a", "b", "c"], [-0.9, 0.5, 0.4])
    assert not book.distrusted("a")
    book.add(["a", "b", "c"], [-0.9, 0.5, 0.4])
    assert book.distrusted("a")


def test_a_book_in_which_half_the_learners_oppose_the_rest_distrusts_nobody():
    """A node whose merges were mostly the liars' reads the honest learners as opposing: it judges only
    while fewer than half of the learners it judged (recently merged ones) fall below zero."""
    book = AgreementBook()
    for _ in range(MIN_ROUNDS):
        book.add(["h0", "h1", "h2", "l0", "l1"], [-0.5, -0.4, -0.45, 0.3, 0.35])
    assert book.status()["distrusted"] == []  # 3 of 5 below zero: the book, not they, is wrong
    for _ in range(2 * MIN_ROUNDS):
        book.add(["h0", "l0", "l1", "h3", "h4", "h5", "h6"], [-0.5, 0.3, 0.35, 0.5, 0.4, 0.45, 0.5])
    # its merges mostly honest again: h1 and h2 still below, but not merged lately, so not judged
    for _ in range(RECENT):
        book.add(["h0", "l0", "l1", "h3", "h4", "h5", "h6"], [-0.5, 0.3, 0.35, 0.5, 0.4, 0.45, 0.5])
    assert book.status()["distrusted"] == ["h0"]  # 1 of 7 judged
    assert book.refuse("h0") and not book.refuse("l0")


def test_a_robust_record_carries_each_contributors_cosine_and_a_plain_one_none():
    theta = {"w": torch.zeros(64, 32), "b": torch.zeros(32)}
    g = torch.Generator().manual_seed(2)
    sig = {k: torch.randn(v.shape, generator=g) for k, v in theta.items()}
    deltas = [
        {k: sig[k] + 0.3 * torch.randn(v.shape, generator=g) for k, v in theta.items()} for _ in range(3)
    ]
    deltas.append({k: -v for k, v in deltas[0].items()})
    cs = [Contribution(f"l{i}", 0, 0, 8, 800, 0.1, d, f"l{i}:0:8") for i, d in enumerate(deltas)]
    robust = ProtocolConfig(robust="centered-clip", clip_factor=0.0)
    rec = FragmentReplica(0, theta, is_embedding=False).make_record(1, cs, robust)
    assert len(rec.agreement) == 4
    assert all(a > 0.2 for a in rec.agreement[1:3]) and rec.agreement[3] < -0.2, rec.agreement
    plain = FragmentReplica(0, theta, is_embedding=False).make_record(1, cs, ProtocolConfig(robust="off"))
    assert plain.agreement == ()


def test_the_cosines_leave_out_the_anchoring_that_stale_contributions_share():
    """Contributions taken a round back are re-anchored by the global's last outer step, the same vector for
    each of them: measured on anchored gradients, a negated learner on that base agreed with the others
    through it. The cosines are of the learners' own outer gradients."""
    theta = {"w": torch.zeros(64, 32)}
    g = torch.Generator().manual_seed(3)
    robust = ProtocolConfig(robust="centered-clip", clip_factor=0.0)
    rep = FragmentReplica(0, theta, is_embedding=False)
    big = {"w": 5.0 * torch.randn(64, 32, generator=g)}  # a large first round: a large anchor after it
    first = [Contribution(f"x{i}", 0, 0, 8, 800, 0.1, big, f"x{i}:0:8") for i in range(2)]
    rep.apply_record(rep.make_record(1, first, robust), robust)
    sig = torch.randn(64, 32, generator=g)
    deltas = [{"w": sig + 0.5 * torch.randn(64, 32, generator=g)} for _ in range(3)]
    deltas.append({"w": -deltas[0]["w"]})
    cs = [Contribution(f"l{i}", 0, 0, 8, 800, 0.1, d, f"l{i}:0:9") for i, d in enumerate(deltas)]  # base 0
    rec = rep.make_record(2, cs, robust)
    assert all(a > 0.2 for a in rec.agreement[1:3]) and rec.agreement[3] < -0.2, rec.agreement


def test_the_merged_set_is_one_rule_for_the_node_and_the_runner():
    """``merged_set``: everything with distrust off; with it, the distrusted learner's contribution left out
    unless its id was promised (a receipt given), and the promise asked only where one is left out."""
    book = AgreementBook()
    for _ in range(MIN_ROUNDS):
        book.add(["h0", "h1", "liar"], [0.5, 0.4, -0.6])
    assert book.distrusted("liar")
    cs = tuple(SimpleNamespace(learner=x, cid=f"{x}:1") for x in ("h0", "liar", "h1"))
    asked = []

    def promised(ids):
        return lambda: asked.append(ids) or set(ids)

    assert merged_set(book, cs, False, promised(["x"])) is cs and asked == []
    assert [c.learner for c in merged_set(book, cs, True)] == ["h0", "h1"]
    assert [c.learner for c in merged_set(book, cs, True, promised(["liar:1"]))] == ["h0", "liar", "h1"]
    assert asked == [["liar:1"]]
    assert [c.learner for c in merged_set(book, cs[::2], True, promised(["y"]))] == ["h0", "h1"]
    assert asked == [["liar:1"]]  # nobody left out: no promise asked
