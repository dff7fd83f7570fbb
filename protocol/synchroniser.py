"""The synchroniser of one fragment as a pure state machine (docs/design.md, section 1, steps 1-2 and 7).

``(state, event, now) -> Decision(state, actions, reason)``. Events: a contribution arrives, time passes
(``on_tick``), the live membership changes, the driver finished a merge (``on_merged``). The driver does
the I/O and the tensor arithmetic (``protocol.merge``); this module only decides *when* and *with whom*.

Round numbering: the global fragment after g merges is round g (round 0 is the initial model). The open
round is g + 1. A contribution names the global round it was taken against (its base); a base older than
``history`` rounds can no longer be re-anchored and is refused.

Grace window, measured from the moment quorum is reached:
    grace = gamma * (tau * xi_step - xi_quorum - xi_sync), clamped to [0, gamma * tau * xi_step]
where xi_step is the learners' reported step time, xi_quorum the time from a round's first contribution to
its quorum, xi_sync the time a merge takes to reach the learners, each an exponential moving average.
The first contributor expects the merged fragment back tau steps after it sent; grace spends a share
gamma of whatever that budget leaves after the quorum wait and the merge itself.

A round on the swarm's schedule (``due_at``, from ``protocol.schedule``): learners send it at the end of
their last step before that moment, so the round does not open before two steps ahead of it (a
contribution that comes earlier, say one left over from the round before, waits), and the grace window is
measured from the later of the quorum and ``due_at``: a learner whose step ran long is still in. The round
merges at once when every live learner's contribution to it is in (``fresh_learners``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError, RejectCode
from protocol.quorum import (  # noqa: F401 - re-exported: the synchroniser's quorum rules
    ROBUST_FLOOR,
    effective_quorum,
    has_quorum,
    live_pending,
    pending_learners,
    quorum_basis,
    robust_wait_over,
)

OPEN_STEPS = 2.0  # a scheduled round opens this many (reported) steps before its slot
BEHIND = 1  # a contribution joins a round at most this many rounds after the one it was taken against


class Phase(enum.Enum):
    COLLECTING = "collecting"  # fewer than quorum contributions in the open round
    GRACE = "grace"  # quorum reached; waiting for stragglers until the deadline
    MERGING = "merging"  # merge handed to the driver; new arrivals wait for the next round


@dataclass(frozen=True)
class Contribution:
    """One learner's fragment contribution. ``delta`` = base global - learner params: fp32 tensors, or their
    wire form (``protocol.codecs.Encoded``), which the merge decodes one tensor at a time. ``norm``: its
    global norm, measured when it was checked at receipt (None: the merge measures it)."""

    learner: str
    fragment: int
    base_round: int
    c_steps: int
    c_tokens: int
    step_time_s: float
    delta: Any  # dict[str, Tensor | Encoded]; typed loosely so the state machine never touches tensors
    cid: str = ""
    norm: float | None = None
    digest: str = ""  # sha256 of the signed message it came in (a merge record names it: protocol.audit)


@dataclass(frozen=True)
class Ema:
    value: float | None = None

    def update(self, x: float, beta: float) -> Ema:
        return Ema(x if self.value is None else beta * self.value + (1 - beta) * x)

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


@dataclass(frozen=True)
class SyncState:
    fragment: int
    global_round: int = 0
    phase: Phase = Phase.COLLECTING
    # (learner, base round) -> Contribution: in the open round, and arrived while it merges (for the next)
    pending: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    queued: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    live: frozenset[str] = frozenset()
    # the live learners whose work was merged lately (``node.swarm.trust.work_book.WorkBook.working``): what a robust
    # round's quorum and share count, so that identities with no work behind them count for nothing. None:
    # not known yet (a node that has not watched the swarm merge for long enough), every live one counts
    working: frozenset[str] | None = None
    first_at: float | None = None
    quorum_at: float | None = None
    deadline: float | None = None
    xi_step: Ema = Ema()
    xi_quorum: Ema = Ema()
    xi_sync: Ema = Ema()
    due_at: float | None = None  # when the open round is due on the swarm's schedule (None: on arrival)
    due_every: float = 0.0  # and again every this many seconds while it has not merged (0: once)
    # learners this synchroniser gave receipts to in the open round and whose contributions it lost (it renounced
    # the round: ``node.swarm.trust.receipts.Receipts.renounce``): the round does not merge here until each has
    # one pending again, which covers its receipt. (Merging without them, a node that was the only one left to
    # take the round renounced it again at every contribution, its own re-sent to itself: 76 times in 0.7 s.)
    promised: frozenset[str] = frozenset()

    @property
    def open_round(self) -> int:
        return self.global_round + 1


@dataclass(frozen=True)
class Merge:
    """Action: merge these contributions into ``round`` now."""

    round: int
    contributions: tuple[Contribution, ...]


@dataclass(frozen=True)
class WakeAt:
    """Action: call ``on_tick`` at this time (the grace deadline, or the scheduled round's opening)."""

    at: float


@dataclass(frozen=True)
class Decision:
    state: SyncState
    actions: tuple = ()
    reason: str = ""


def carried(c: Contribution, state: SyncState) -> bool:
    """Whether contribution ``c`` may still join the open round of ``state``. Its outer gradient is
    re-anchored at the current global fragment (docs/design.md, section 1, step 4), so one taken against an
    older round also undoes every round merged since. On the swarm's schedule a fragment takes one round per
    slot, so a learner on time is never more than one round behind (a straggler of the round just merged):
    anything older is left out. (A contribution held by a node that was not its round's synchroniser was
    carried from round to round, and merged, alone, 50 s later in a run's quiet period: it set the position
    embedding back to the model's first step.) With rounds on arrival (no schedule yet, or the simulator)
    a fragment can take a round per learner in one learner's period, and only ``history`` bounds it."""
    return state.due_at is None or c.base_round >= state.global_round - BEHIND


def fresh_learners(state: SyncState) -> set[str]:
    """The learners whose pending contribution was taken against the current global round. One taken
    against an older round (a straggler of the round before, carried over) holds real work and is merged,
    but it does not stand in for the learner's contribution to this round: "every live learner is in"
    waits for that one (until the grace deadline at most)."""
    return {learner for learner, base in state.pending if base == state.global_round}


def grace_window(cfg: ProtocolConfig, state: SyncState) -> float:
    if not cfg.grace:
        return 0.0
    budget = cfg.overlap * state.xi_step.get()
    spare = budget - state.xi_quorum.get() - state.xi_sync.get()
    return min(max(0.0, cfg.grace_gamma * spare), cfg.grace_gamma * budget)


def _check(cfg: ProtocolConfig, state: SyncState, c: Contribution) -> None:
    if c.fragment != state.fragment:
        raise ProtocolError(
            RejectCode.WRONG_FRAGMENT,
            f"fragment {c.fragment} sent to synchroniser of fragment {state.fragment}",
        )
    if c.c_steps <= 0 or c.c_tokens <= 0:
        raise ProtocolError(RejectCode.BAD_COUNTERS, f"c_steps={c.c_steps} c_tokens={c.c_tokens} must be > 0")
    if c.base_round > state.global_round:
        raise ProtocolError(
            RejectCode.FUTURE_BASE,
            f"base round {c.base_round} is ahead of the global round {state.global_round}",
        )
    if c.base_round <= state.global_round - cfg.history:
        raise ProtocolError(
            RejectCode.STALE_BASE,
            f"base round {c.base_round} is older than the "
            f"{cfg.history} rounds kept (global round {state.global_round})",
        )
    if not c.step_time_s > 0:
        raise ProtocolError(RejectCode.BAD_COUNTERS, f"step_time_s={c.step_time_s} must be > 0")


def taken_at(st: SyncState, now: float) -> float:
    """The moment the round ``st`` holds was taken, for its record's slot (``protocol.schedule.round_due``):
    its quorum's (a straggler of an earlier slot may have arrived first), else its first contribution's,
    else ``now``."""
    if st.quorum_at is not None:
        return st.quorum_at
    return st.first_at if st.first_at is not None else now


def on_contribution(cfg: ProtocolConfig, state: SyncState, c: Contribution, now: float) -> Decision:
    """A contribution arrived. Raises ProtocolError (state unchanged) when it breaks a rule."""
    _check(cfg, state, c)
    if not carried(c, state):
        return Decision(
            state,
            (),
            f"{c.learner}'s contribution (base {c.base_round}) is more than {BEHIND} round behind the "
            f"global round {state.global_round}: left out",
        )
    key = (c.learner, c.base_round)
    if state.phase is Phase.MERGING:
        queued = dict(state.queued)
        queued[key] = c
        return Decision(
            replace(state, queued=MappingProxyType(queued)),
            (),
            f"round {state.open_round} is merging; {c.learner} queued for round {state.open_round + 1}",
        )
    # Keyed by learner and base: a learner's second contribution against the same round counts its steps
    # since it last received the fragment, the first one's included, and replaces it; one against a newer
    # round (the learner adopted a round in between) holds other steps, and both are merged. (Keyed by
    # learner alone, a straggler of the round just merged, carried into this one, was dropped by the
    # learner's next contribution: 2.7% of the work in a chaos run, most of it 0-0.5 s late.)
    pending = dict(state.pending)
    replaced = key in pending
    pending[key] = c
    state = replace(
        state,
        pending=MappingProxyType(pending),
        xi_step=state.xi_step.update(c.step_time_s, cfg.ema_beta),
        first_at=now if state.first_at is None else state.first_at,
    )
    note = f"{c.learner} {'replaced its contribution' if replaced else 'contributed'}"
    return _evaluate(cfg, state, now, note)


def on_tick(cfg: ProtocolConfig, state: SyncState, now: float) -> Decision:
    return _evaluate(cfg, state, now, "tick")


def on_membership(
    cfg: ProtocolConfig,
    state: SyncState,
    live: frozenset[str],
    now: float,
    working: frozenset[str] | None = None,
) -> Decision:
    state = replace(state, live=frozenset(live), working=working)
    note = f"live set now {len(live)}" + ("" if working is None else f", {len(working & live)} working")
    return _evaluate(cfg, state, now, note)


def on_merged(
    cfg: ProtocolConfig,
    state: SyncState,
    now: float,
    sync_s: float,
    due: tuple[float, float] | None = None,
) -> Decision:
    """The driver applied the merge of the open round; ``sync_s`` is how long merge + hand-back took;
    ``due``: (first moment, repeat period) of the next round on the swarm's schedule (None: on arrival)."""
    if state.phase is not Phase.MERGING:
        raise ProtocolError(RejectCode.MALFORMED, f"no merge in progress for fragment {state.fragment}")
    nxt = replace(
        state,
        global_round=state.global_round + 1,
        phase=Phase.COLLECTING,
        pending=MappingProxyType({}),
        queued=MappingProxyType({}),
        first_at=None,
        quorum_at=None,
        deadline=None,
        xi_sync=state.xi_sync.update(sync_s, cfg.ema_beta),
        due_at=None if due is None else due[0],
        due_every=0.0 if due is None else due[1],
    )
    queued = MappingProxyType({k: c for k, c in state.queued.items() if carried(c, nxt)})
    nxt = replace(nxt, pending=queued, first_at=now if queued else None)
    return _evaluate(cfg, nxt, now, f"round {state.open_round} merged in {sync_s:.3f}s")


def scheduled(state: SyncState, due: tuple[float, float] | None) -> SyncState:
    """``state`` with its open round due at ``due`` (first moment, repeat period), if the round is still idle
    (nothing in it yet): a fragment with no record of its own takes the stagger's slot once another
    fragment's record gives one (``protocol.schedule.swarm_clocks``)."""
    if due is None or state.phase is not Phase.COLLECTING or state.pending or state.queued:
        return state
    return replace(state, due_at=due[0], due_every=due[1])


def slot_due(state: SyncState, now: float) -> float | None:
    """The slot of the open round nearest to ``now`` (never before its first): a round that did not merge
    at its first slot is taken again at the next (``protocol.schedule.RoundClock``)."""
    if state.due_at is None:
        return None
    if state.due_every <= 0 or now <= state.due_at:
        return state.due_at
    return state.due_at + round((now - state.due_at) / state.due_every) * state.due_every


def _evaluate(cfg: ProtocolConfig, state: SyncState, now: float, note: str) -> Decision:
    if state.phase is Phase.MERGING:
        return Decision(state, (), f"{note}; merge in progress")
    owed = state.promised - {learner for learner, _ in state.pending}
    if owed:
        return Decision(
            replace(state, phase=Phase.COLLECTING),
            (),
            f"{note}; round {state.open_round} waits for {len(owed)} receipted learner(s) to contribute again",
        )
    due_at = slot_due(state, now)
    opens = None if due_at is None else due_at - OPEN_STEPS * state.xi_step.get()
    if opens is not None and now < opens and state.quorum_at is None:
        return Decision(
            replace(state, phase=Phase.COLLECTING),
            (WakeAt(opens),) if state.pending else (),
            f"{note}; round {state.open_round} opens at {opens:.3f} (due {due_at:.3f}), "
            f"{len(state.pending)} waiting",
        )
    k = effective_quorum(cfg, state)
    # Only live learners count toward the quorum; a departed learner's contribution is still merged (its
    # work is real) but cannot stand in for a live one.
    n = live_pending(state)
    over = robust_wait_over(cfg, state) if n >= min(k, max(cfg.quorum, ROBUST_FLOOR)) else None
    if n < k and (over is None or now < over):
        return Decision(
            replace(state, phase=Phase.COLLECTING),
            () if over is None else (WakeAt(over),),
            f"{note}; waiting for quorum {n}/{k} in round {state.open_round}"
            + ("" if over is None else f" until {over:.3f}"),
        )
    if state.quorum_at is None:
        first = state.first_at if state.first_at is not None else now
        if opens is not None:
            first = max(first, opens)
        waited = max(0.0, now - first)
        state = replace(state, quorum_at=now, xi_quorum=state.xi_quorum.update(waited, cfg.ema_beta))
        grace = grace_window(cfg, state)
        start = now if due_at is None else max(now, due_at)
        state = replace(state, deadline=start + grace, phase=Phase.GRACE)
        note = (
            f"{note}; quorum {n}/{k} after {waited:.3f}s, grace {grace:.3f}s = {cfg.grace_gamma}*"
            f"({cfg.overlap}*{state.xi_step.get():.3f} - {state.xi_quorum.get():.3f} - "
            f"{state.xi_sync.get():.3f})"
            if cfg.grace
            else f"{note}; quorum {n}/{k}, no grace"
        )
    basis = quorum_basis(cfg, state)
    everyone = bool(basis) and basis <= fresh_learners(state)
    deadline = now if state.deadline is None else state.deadline
    if now >= deadline or everyone:
        why = "every live learner is in" if everyone and now < deadline else "grace over"
        merge = Merge(state.open_round, tuple(state.pending[k_] for k_ in sorted(state.pending)))
        return Decision(
            replace(state, phase=Phase.MERGING),
            (merge,),
            f"{note}; merging round {state.open_round} with {n} contributions ({why})",
        )
    return Decision(state, (WakeAt(deadline),), f"{note}; waiting for stragglers until {deadline:.3f}")


def round_share(contributions: Sequence[Contribution], cfg: ProtocolConfig, live: int) -> float:
    """The share of one full round that these contributions hold, at most 1.

    A full round is every live learner's work since its last merged contribution, about H steps each
    (with carry, the steps trained while a round is on its way back count toward the next contribution).
    When learners are out of phase (``carry``), fragment p is merged several times per H steps, each time with a few learners' work; scaling each such round by its share keeps the global's movement per H
    steps what one round of every learner would give, instead of one full outer step per contributor."""
    if live <= 0:
        return 1.0
    steps = sum(c.c_steps for c in contributions)
    full = live * cfg.sync_every
    return min(1.0, steps / full)
