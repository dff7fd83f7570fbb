"""How many learners a round waits for (the synchroniser's quorum, ``protocol.synchroniser``), and who counts.

K (``ProtocolConfig.quorum``) where learners are trusted; a robust merge (``protocol.robust``) compares
contributions, so where members are not trusted a round on the swarm's schedule waits for most of the
learners that have been doing work, for a period at most.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

from protocol.config import ProtocolConfig


class SyncState(Protocol):
    """What these rules read of a fragment's ``protocol.synchroniser.SyncState``."""

    pending: Mapping[tuple[str, int], object]
    live: frozenset[str]
    working: frozenset[str] | None
    first_at: float | None
    due_at: float | None
    due_every: float


ROBUST_QUORUM = 3  # learners a robust merge waits for at least, when as many are live (protocol.robust)
ROBUST_SHARE = 0.75  # and the share of the live learners it waits for, when that is more
ROBUST_FLOOR = 2  # the fewest learners a robust round merges once its wait is over (fewer live: all of them)


def quorum_basis(cfg: ProtocolConfig, state: SyncState) -> frozenset[str]:
    """The live learners a round counts as "everyone": in a robust swarm (public: identities are free),
    those whose work was merged lately (``SyncState.working``) where that is known and any are live; else
    every live one. 2,000 signed membership records with no process behind them made a robust round of 3
    real nodes wait for 2,002 learners, and merge only at the end of each period."""
    if cfg.robust == "centered-clip" and state.working is not None:
        basis = state.live & state.working
        if basis:
            return basis
    return state.live


def effective_quorum(cfg: ProtocolConfig, state: SyncState) -> int:
    """K, but never more than the live learners (a dead learner leaves the membership, not the quorum). A
    robust merge (``protocol.robust``) compares contributions: a round of one is that contribution, whatever
    it holds, and in a round of 3 one liar holds a third of the weight. On the swarm's schedule it waits for
    ``ROBUST_QUORUM`` learners or ``ROBUST_SHARE`` of the live ones, whichever is more, and never for every
    live one (all but one at most: in a swarm of 3, the slowest set every round's pace, and the suite's
    swarms took up to 1.6x as long), up to ``robust_wait_over``. (5 real nodes on 2 cores, one of them
    lying, merged a quarter to a third of their rounds from 3 learners while the robust quorum was 3.)"""
    if not state.live:
        return cfg.quorum
    robust = cfg.robust == "centered-clip" and state.due_at is not None and state.due_every > 0
    live = len(quorum_basis(cfg, state))
    wanted = max(ROBUST_QUORUM, math.ceil(ROBUST_SHARE * live))
    k = max(cfg.quorum, min(wanted, live - 1)) if robust else cfg.quorum
    return max(1, min(k, live))


def robust_wait_over(cfg: ProtocolConfig, state: SyncState) -> float | None:
    """When a robust round stops waiting for its quorum and merges whoever is in, ``ROBUST_FLOOR`` live
    learners at least (K where fewer are live): a full period of the schedule after its slot, or after its
    first contribution if that came later. A live learner that stopped contributing (paused, stuck) costs
    each round a period, and does not stop the rounds. A lone contribution is not merged while another
    live learner may still join it: merged alone it is the round, whatever it holds (a liar whose
    contributions came last when every learner paused took a swarm's eval loss from 1.13 to 1.78 with its
    last two rounds). None: no such wait."""
    if (
        cfg.robust != "centered-clip"
        or state.due_at is None
        or state.due_every <= 0
        or state.first_at is None
    ):
        return None
    return max(state.first_at, state.due_at) + state.due_every


def pending_learners(state: SyncState) -> set[str]:
    """The learners with a contribution in the open round."""
    return {learner for learner, _ in state.pending}


def live_pending(state: SyncState) -> int:
    """Learners in the open round that are live (all of them when no live set is known)."""
    learners = pending_learners(state)
    return len(learners & state.live) if state.live else len(learners)


def has_quorum(cfg: ProtocolConfig, state: SyncState) -> bool:
    """The open round holds its quorum: it will merge with nothing new arriving (at its slot, at latest)."""
    return live_pending(state) >= effective_quorum(cfg, state)
