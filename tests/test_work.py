"""Weights follow work the swarm can see (``protocol.work``): the counters a contribution claims
against the members' published rates."""

from dataclasses import replace

import pytest

from node.swarm.trust.work_book import WorkBook
from protocol.config import ConfigError, ProtocolConfig
from protocol.errors import ProtocolError, RejectCode
from protocol.messages import contribution_id, sender_tag
from protocol.work import VisibleWork, WorkMeasure, check_counters, visible_work

# three members at 256 tokens a step and 2 steps a second, one that publishes nothing yet
RATES = [(512.0, 2.0), (520.0, 2.0), (480.0, 2.0), (0.0, 0.0)]


def test_the_medians_need_three_members_publishing_rates():
    assert visible_work(RATES[:2] + [(0.0, 0.0)]) == VisibleWork()
    work = visible_work(RATES)
    assert work.tokens_per_step == pytest.approx(256.0) and work.steps_per_s == pytest.approx(2.0)
    # one member claiming a thousand times the rate moves no median
    assert visible_work(RATES + [(5e6, 2e3)]).tokens_per_step == pytest.approx(258.0)


def test_the_last_medians_of_three_members_outlast_a_moments_gap():
    """Seen in a loaded suite run: a node whose view held two rated members for a moment took 1e9 tokens in
    one step. ``WorkMeasure`` keeps the last medians of 3 or more for ``keep_s``; a swarm that never had 3
    rated members bounds nothing (one member's rate is no measure of mixed hardware)."""
    m = WorkMeasure(keep_s=30.0)
    liar = (1e12, 1e3)  # a member publishing the rate its lie needs
    assert m.measure([RATES[0], liar], 0.0) == VisibleWork()  # never had three: no bound
    assert m.measure(RATES, 10.0) == VisibleWork(256.0, 2.0)
    work = m.measure([RATES[0], liar], 35.0)  # a gap: the last medians still hold
    assert work == VisibleWork(256.0, 2.0)
    assert "tokens a step" in _refused(1, 10**9, 2.0, 0.0, work, 4.0, 8)
    assert "steps in" in _refused(10**6, 256 * 10**6, 2.0, 8.0, work, 4.0, 8)
    assert m.measure([RATES[0], liar], 41.0) == VisibleWork()  # 31 s after: gone
    # zero counters are refused before any bound divides by them (a suite run: internal_error, ZeroDivision)
    assert "must be positive" in _refused(0, 256, 2.0, 8.0, work, 4.0, 8)
    assert "must be positive" in _refused(8, 0, 2.0, 8.0, VisibleWork(), 4.0, 8)


def _refused(*args) -> str:
    with pytest.raises(ProtocolError) as e:
        check_counters(*args)
    assert e.value.code is RejectCode.BAD_COUNTERS
    return str(e.value)


def test_counters_over_what_the_swarm_sees_are_refused():
    work = visible_work(RATES)
    # honest: 8 steps of 256 tokens, the first heard of the sender (no time yet), and after a long while
    check_counters(8, 2048, 2.0, 0.0, work, 4.0, 8)
    check_counters(200, 200 * 256, 2.0, 30.0, work, 4.0, 8)
    # a batch 4x the median still passes (mixed hardware), 5x does not
    check_counters(8, 8 * 1024, 2.0, 0.0, work, 4.0, 8)
    assert "tokens a step" in _refused(8, 8 * 1280, 2.0, 0.0, work, 4.0, 8)
    # the attack: 1e9 tokens in one step
    assert "tokens a step" in _refused(1, 10**9, 0.0, 0.0, work, 4.0, 8)
    # steps: 4 x (rate x elapsed + sync_every); the sender's rate is capped at 4x the median
    check_counters(4 * (2 * 10 + 8), 4 * (2 * 10 + 8) * 256, 2.0, 10.0, work, 4.0, 8)
    assert "steps in" in _refused(10**6, 256 * 10**6, 2.0, 10.0, work, 4.0, 8)
    assert "steps in" in _refused(4 * (8 * 10 + 8) + 1, 256 * 400, 1e6, 10.0, work, 4.0, 8)
    # no bound: fewer than three members publish rates, or the factor is 0
    check_counters(1, 10**9, 0.0, 0.0, VisibleWork(), 4.0, 8)
    check_counters(1, 10**9, 0.0, 0.0, work, 0.0, 8)


def test_a_sender_is_bounded_by_its_own_record_before_three_members_publish_rates():
    """A bench run (``bench/attacks.py --attacks inflate-1e6``, 3 honest + 1): the liar's first three
    contributions, a million times its tokens a step, came before 3 members published rates and held all but
    1e-12 of their merges' weight. Its own record published 256 tokens a step: that bounds it, with or
    without the members' medians; a sender that publishes no rate yet is not bounded by it."""
    own = 256.0
    check_counters(8, 8 * 1024, 2.0, 0.0, VisibleWork(), 4.0, 8, own)  # 4x its own: passes
    assert "its sender's record" in _refused(8, 8 * 256 * 10**6, 2.0, 0.0, VisibleWork(), 4.0, 8, own)
    assert "its sender's record" in _refused(8, 8 * 1280, 2.0, 0.0, visible_work(RATES), 4.0, 8, own)
    check_counters(8, 8 * 256 * 10**6, 0.0, 0.0, VisibleWork(), 4.0, 8, 0.0)  # no rate published: no bound
    check_counters(8, 8 * 256 * 10**6, 2.0, 0.0, VisibleWork(), 0.0, 8, own)  # factor 0: no bound at all


def test_the_work_book_starts_at_first_word_and_moves_with_each_merge():
    book = WorkBook(remember=2)
    assert book.heard("a", 0, 10.0) == 10.0 and book.heard("a", 0, 50.0) == 10.0
    book.merged("a", 0, 60.0)
    assert book.heard("a", 0, 70.0) == 60.0 and book.heard("a", 1, 70.0) == 70.0
    book.heard("b", 0, 80.0)  # the oldest entry goes
    assert len(book.since) == 2 and ("a", 0) not in book.since


def test_the_workers_a_public_swarm_elects_are_those_its_chain_credits_not_those_merged_here():
    """``WorkBook.workers``: the learners credited in a record the logs hold, or in one that settled (left
    the log, or named by an installed snapshot's merged ids), once this node has watched for the window. A
    round merged here that a fork then undid (its record gone from the log) credits no one: a joiner's own
    lost round elected it in its view alone, and the swarm's views parted while it rested (CI)."""
    a, b, c = "12D3KooW" + "A" * 44, "12D3KooW" + "B" * 44, "12D3KooW" + "C" * 44
    sybil = "12D3KooW" + "S" * 44
    book = WorkBook()
    for q in (a, b, c):
        book.merged(q, 0, 100.0)  # c's round was ours, and lost a fork: its record left the log unsettled
    live = (a, b, c, sybil)
    assert book.workers(live, 101.0, 30.0, logged=[a, b]) is None  # not watched for the window: unknown
    assert book.workers(live, 140.0, 30.0, logged=[a, b]) == {a, b}
    assert book.workers(live, 140.0, 30.0) == frozenset()  # nothing on the chain: none (the caller takes all)
    book.settle([a])  # a's record left the log, history rounds deep
    assert book.workers(live, 140.0, 30.0, logged=[b]) == {a, b}
    # a snapshot's merged ids name their senders by their id's last 10 characters
    book.settle(cids=[contribution_id(c, 2, 40, 1.5)])
    assert book.workers(live, 140.0, 30.0) == {a, c}
    assert book.workers(live, 140.0, 0.0) is None  # no schedule: no window
    small = WorkBook(remember=2)
    small.settle([a, b, c])
    assert list(small.credited_tags) == [sender_tag(b), sender_tag(c)]


def test_credits_handed_by_a_snapshot_or_checkpoint_are_elected_by_at_once():
    """A joiner that waited to watch a merge elected among every member, itself too, while the swarm elected
    a worker: under ``sync-diloco`` each held one learner's contribution of a round and neither merged again
    (a suite run). Credits that came whole (``settle``'s ``tags``) are the chain's: no wait."""
    a, me = "12D3KooW" + "A" * 44, "12D3KooW" + "J" * 44
    book = WorkBook()
    book.settle([a])  # credits of its own making (a log's record settling) are not handed
    assert book.workers((a, me), 0.0, 30.0) is None
    book.settle(tags=[sender_tag(a)])  # a snapshot's or a checkpoint's ``credited``
    assert book.workers((a, me), 0.0, 30.0) == {a}
    assert book.workers((a, me), 0.0, 0.0) is None  # still none without a schedule


def test_a_snapshot_credits_what_its_donors_chain_credits_and_not_our_undone_rounds():
    """``SwarmView.credit_snapshot``: installing a snapshot settles its merged ids' senders and the learners its
    donor credits (``WorkBook.credited``: settled first, then the donor's logged learners, newest last, capped);
    of the log it replaces, only records too deep for the fork it resolved to undo."""
    from types import SimpleNamespace

    from node.swarm.view import SwarmView
    from node.swarm.wire import FragmentState

    a, b, c, d, e = ("12D3KooW" + ch * 44 for ch in "ABCDE")
    donor = WorkBook()
    donor.settle([a])
    assert donor.credited([b, a], 8) == (sender_tag(a), sender_tag(b))
    assert donor.credited([b, c], 2) == (sender_tag(b), sender_tag(c)) and donor.credited([b], 0) == ()

    def rec(*learners):
        return SimpleNamespace(
            signer="s", record=SimpleNamespace(contributors=[(q, "cid", 1.0, 1, 1) for q in learners])
        )

    class _View:
        credit_snapshot = SwarmView.credit_snapshot

    view = _View()
    view.work, view.pcfg, view.peer_id = WorkBook(), SimpleNamespace(history=4), "me"
    view.logs = [{3: rec(d), 9: rec(e), 10: rec(c)}]  # round 10: ours, on the fork the snapshot resolves
    st = FragmentState(0, 10, "h", 1, 1.0, {}, {}, merged=(contribution_id(b, 0, 5, 1.0),))
    view.credit_snapshot(replace(st, credited=donor.credited([], 8)))
    assert set(view.work.credited_tags) == {
        sender_tag(q) for q in (a, b, d)
    }  # not e (round 9 > 10 - 4), not c


def test_a_negative_or_nan_work_factor_is_refused():
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="work_factor"):
            ProtocolConfig(work_factor=bad)


def test_the_window_of_the_next_contribution_starts_where_the_merged_ones_work_began():
    """A learner that has not yet seen its last contribution merged counts its steps again in the next one
    (carry): the bound runs from the start of the merged contribution's work, not from its merge. From the
    merge, a head-zero run refused an honest "44 steps in 0 s" (41 allowed at 8.28 steps/s) and scored it."""
    work = VisibleWork(tokens_per_step=256.0, steps_per_s=8.0)
    book = WorkBook()
    book.merged("a", 0, 100.0, span_s=32 / 8.0)  # its 32 steps at 8 steps/s, merged late at t = 100
    since = book.heard("a", 0, 100.3)
    check_counters(44, 44 * 256, 8.0, 100.3 - since, work, 4.0, 8)  # 32 again + 12 new: within the bound
    with pytest.raises(ProtocolError):  # from the merge, as before: refused
        check_counters(44, 44 * 256, 8.0, 0.3, work, 4.0, 8)
    with pytest.raises(ProtocolError):  # the merged work's span adds its own steps, not a blank cheque
        check_counters(400, 400 * 256, 8.0, 100.3 - since, work, 4.0, 8)
    book.merged("a", 0, 101.0)  # no rate published: from the merge
    assert book.heard("a", 0, 101.5) == 101.0
