"""The merge-latency book (``node.swarm.trust.lateness``): a synchroniser that holds its rounds to just before the
stall deadline is judged slow against the others; honest spread, a swarm slow as a whole, and too few samples
judge no one."""

from __future__ import annotations

import math

from node.swarm.trust.lateness import KEEP, MIN_SAMPLES, SIGNERS, MergeLatency


def _fill(book: MergeLatency, signer: str, xs) -> list[bool]:
    return [book.add(signer, x) for x in xs]


def test_a_signer_that_holds_its_rounds_to_the_deadline_is_slow_against_the_others():
    book = MergeLatency()
    _fill(book, "a", [0.2, 0.3, 0.25, 0.4])
    _fill(book, "b", [0.3, 0.2, 0.35])
    got = _fill(book, "late", [1.6, 1.6, 1.6, 1.6])  # 0.8 of two round periods, every round
    assert got == [False] * (MIN_SAMPLES - 1) + [True]  # judged once it has enough samples
    assert not book.slow("a") and not book.slow("b")
    assert book.medians()["late"] == 1.6


def test_honest_spread_a_slow_swarm_and_few_samples_judge_no_one():
    book = MergeLatency()
    # a slower machine among honest ones: twice as slow is not three times
    _fill(book, "a", [0.3] * 6)
    assert not any(_fill(book, "slower", [0.6] * 6))
    # a swarm whose rounds all take long (a thin link): nobody stands out
    book = MergeLatency()
    for q in "abc":
        assert not any(_fill(book, q, [1.5, 1.7, 1.6, 1.8]))
    # three times the others' but within the margin (rounds merged on arrival, near zero latency)
    book = MergeLatency()
    _fill(book, "a", [0.02] * 5)
    assert not any(_fill(book, "b", [0.08] * 5))
    # too few samples of the others: no judgement
    book = MergeLatency()
    _fill(book, "a", [0.1, 0.1])
    assert not any(_fill(book, "late", [2.0] * 6))


def test_bad_samples_are_ignored_and_the_book_stays_bounded():
    book = MergeLatency()
    assert not book.add("a", math.nan) and not book.add("a", -1.0) and "a" not in book.samples
    _fill(book, "a", [0.1] * (KEEP + 5))
    assert len(book.samples["a"]) == KEEP
    for i in range(SIGNERS + 10):
        book.add(f"q{i}", 0.1)
    assert len(book.samples) == SIGNERS and "a" not in book.samples  # the oldest forgotten first
