"""A finished run, re-decided in virtual time: ``ddiloco replay`` (docs/replay.md).

The tape of a real run (every node's ``events.jsonl``) says what the run was made of — when each learner's
steps began and ended, when its node was out of the swarm, how long a contribution took to reach its
synchroniser and a merge record to reach the others — and what the protocol decided on top of it: the
slots, the rounds, who was merged, what each learner adopted. ``Replay`` keeps the first part and decides
the second again, with the run's own settings or with others (a quorum, the grace window, H, the codec,
more learners), through the same pure rules the node runs:

- the learners step exactly when the tape says they did (an alternative setting does not change a learner's
  speed: Decoupled DiLoCo's learners never wait for the swarm);
- at the end of each step a learner sends the fragments whose slot is up (``protocol.schedule.due_fragments``
  on every fragment's clock, ``swarm_clocks`` before a fragment's first record, its own step count before
  any), counted from its last contribution or overwriting adoption of that fragment;
- a contribution reaches fragment p's synchroniser as long after the step that made it as the same
  contribution of the run took (its ``accept`` against its ``contribute``), or as its learner's took on the
  median where the run made no such contribution (another H, say)
  (``protocol.synchroniser``, one ``SyncState`` a fragment, decides when and with whom), a merge's record is
  written on the node's rule (``record_timing``: the round's slot and the swarm's period) and reaches each
  learner as long after as one of the run's records reached that learner's node (a draw from its
  measured delays, seeded: one replay gives one answer), and each adopts it at its next step end;
- a learner whose node was out longer than a membership record lives (``ttl_s``) leaves the live sets, and
  is waited for on fragment p again from its first contribution of p (as ``sim.decoupled`` does); a killed
  learner's next life starts its schedule and counters afresh.

What comes out is the tape's records of the decided part — ``contribute``, ``adopt`` and ``merge`` — in the
node's format, so the caller scores them with the steps and outages of the real run exactly as it scores
the real run (``protocol.goodput``), and counts of the synchroniser's decisions, so a difference between
two replays can be read as what the synchronisers did differently. Pure: no clock, no I/O, no tensors.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError
from protocol.fragments import FragmentPlan, plan_fragments
from protocol.schedule import (
    RATE_WINDOW,
    RoundClock,
    SlotBook,
    averaged_step_s,
    due_fragments,
    measured_period,
    next_clock,
    record_timing,
    swarm_clocks,
)
from protocol.synchroniser import (
    Contribution,
    Decision,
    Merge,
    Phase,
    SyncState,
    carried,
    on_contribution,
    on_membership,
    on_merged,
    on_tick,
    scheduled,
    taken_at,
)


@dataclass(frozen=True)
class LearnerTape:
    """One learner's part of a run, as its node's tape recorded it."""

    name: str
    steps: tuple[tuple[int, float, float], ...]
    """(step number, start, end), in time order; a restarted life may repeat step numbers"""
    outages: tuple[tuple[float, float], ...] = ()
    """(from, to): its node out of the swarm (killed until its restart joined, or stopped)"""
    kills: tuple[float, ...] = ()
    """moments its process died: the next step after one starts a new life"""
    tokens_per_step: int = 1


@dataclass(frozen=True)
class Links:
    """How long the swarm's messages took, as measured on the tape (seconds)."""

    contrib_s: float
    """a step's end to its contribution's arrival at the synchroniser, the merge's own work included"""
    fanout_s: float
    """a merge to its record's arrival at the other nodes"""
    floor_s: float = 0.0
    """the fixed part of both (round trips, signing): the rest is taken as bytes in transit"""
    merge_s: float = 0.0
    """a merge's own work: from the synchroniser's decision to its record"""
    delays: dict = field(default_factory=dict)
    """(learner, fragment, step) -> seconds from that contribution's step end to its acceptance, as measured"""
    by_learner: dict = field(default_factory=dict)
    """learner -> its contributions' delays, measured (one is drawn for a contribution the run did not make)"""
    fanout_by: dict = field(default_factory=dict)
    """learner -> how long after its signer's each record of others reached its node (one is drawn a record)"""


@dataclass(frozen=True)
class ReplayConfig:
    protocol: ProtocolConfig
    shares: tuple[float, ...]
    t0: float
    t1: float
    links: Links
    ttl_s: float = 8.0
    bytes_scale: float = 1.0
    """the contributions' and records' bytes against the run's (a codec what-if); the part of each latency
    above ``links.floor_s`` scales with it"""
    start: tuple[tuple[int, float, float] | None, ...] = ()
    """per fragment, the newest record the run had merged at ``t0``: (round, due, period); the replay
    decides from there (what came before is outside the window, and was made by fewer nodes)"""


@dataclass
class Decisions:
    """What the synchronisers decided, counted: the 'why' of a replay's figures."""

    merged_all_in: int = 0  # a round merged as soon as every live learner was in
    merged_grace_over: int = 0  # ... when its grace window (0 without grace) ran out
    left_out_behind: int = 0  # a contribution more than a round behind the open one
    queued: int = 0  # arrived while its fragment was merging: held for the next round
    replaced: int = 0  # a learner's second contribution against the same round replaced its first
    refused: Counter = field(default_factory=Counter)  # by refusal code (e.g. a base older than history)

    def as_dict(self) -> dict:
        return {**{k: v for k, v in vars(self).items() if k != "refused"}, "refused": dict(self.refused)}


@dataclass
class ReplayResult:
    records: dict[str, list[dict]]  # learner -> its contribute and adopt records, in time order
    merges: list[dict]  # one merge record each, in time order
    decisions: Decisions


def _after_last_step(lt: LearnerTape) -> tuple[int, float, float]:
    """(its last step, when it ended, when its node next went out): the span in which the learner steps
    no more and its node still reads the swarm's records."""
    if not lt.steps:
        return 0, math.inf, math.inf
    step, _, end = lt.steps[-1]
    out = [a for a, _ in lt.outages if a >= end] + [k for k in lt.kills if k >= end]
    return step, end, min(out, default=math.inf)


_START, _STEP, _ARRIVE, _WAKE, _MERGED, _RECORD, _MEMBERS = range(7)


class Replay:
    def __init__(self, cfg: ReplayConfig, learners: list[LearnerTape]) -> None:
        self.cfg, self.learners = cfg, learners
        pc = cfg.protocol
        n_frag = len(cfg.shares)
        self.plan: FragmentPlan = plan_fragments(
            {f"f{p}": max(1, round(s * 1e9)) for p, s in enumerate(cfg.shares)}, n_frag, pc.sync_every
        )
        scale = cfg.bytes_scale
        lk = cfg.links
        self.scale = scale
        self.contrib_s = self._scaled(lk.contrib_s)
        self.fanout_s = self._scaled(lk.fanout_s)
        self.merge_s = lk.merge_s
        self.rng = random.Random(0)  # the draws of measured delays: one replay, one answer
        names = [lt.name for lt in learners]
        self.syncs = [SyncState(fragment=p, live=frozenset()) for p in range(n_frag)]
        self.clocks: list[RoundClock | None] = [None] * n_frag
        self.rounds = [0] * n_frag
        self.wake_at: list[float | None] = [None] * n_frag
        self.up = dict.fromkeys(names, True)
        self.members = {n: set() for n in names}  # fragments whose rounds wait for n (since its life began)
        self.slots = {n: SlotBook() for n in names}
        self.ends: dict[str, deque] = {n: deque(maxlen=RATE_WINDOW) for n in names}
        self.step_s: dict[str, float | None] = dict.fromkeys(names)
        self.life = dict.fromkeys(names, 0)  # how many of its process's deaths lie behind it
        self.last = {n: [None] * n_frag for n in names}  # step of the last contribution or overwrite of p
        self.based = {n: [0] * n_frag for n in names}  # the round of p each learner's copy is based on
        self.arrived = {n: [0] * n_frag for n in names}  # newest round of p whose record reached it
        self.decisions = Decisions()
        self.out = ReplayResult({n: [] for n in names}, [], self.decisions)
        self.heap: list = []
        self.seq = itertools.count()
        self.started = not cfg.start  # with no start state, the replay decides from the tapes' first step
        self.idle = {lt.name: _after_last_step(lt) for lt in learners}

    def _scaled(self, s: float) -> float:
        floor = self.cfg.links.floor_s
        return min(s, floor) + max(0.0, s - floor) * self.scale

    def _delay(self, name: str, p: int, step: int) -> float:
        lk = self.cfg.links
        d = lk.delays.get((name, p, step))
        if d is None and lk.by_learner.get(name):
            d = self.rng.choice(lk.by_learner[name])
        return self.contrib_s if d is None else self._scaled(d)

    def _push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    def run(self) -> ReplayResult:
        for lt in self.learners:
            kills = sorted(lt.kills)
            for s, a, b in lt.steps:
                life = sum(1 for k in kills if k <= a)
                self._push(b, _STEP, (lt.name, s, a, b, life))
            for a, b in lt.outages:
                if b - a > self.cfg.ttl_s:  # its membership record expired while it was out
                    self._push(a + self.cfg.ttl_s, _MEMBERS, (lt.name, False))
                    if math.isfinite(b):
                        self._push(b, _MEMBERS, (lt.name, True))
        if not self.started:
            self._push(self.cfg.t0, _START, None)
        handlers = (self._start, self._step, self._arrive, self._wake, self._merged, self._record,
                    self._membership)  # fmt: skip
        while self.heap:
            t, _, kind, payload = heapq.heappop(self.heap)
            handlers[kind](t, payload)
        return self.out

    def _start(self, t: float, _) -> None:
        """The window opens: every fragment at the run's newest record, every learner on it, in every live
        set, with the slots before now taken (a learner of the real run sent them)."""
        pc, n_frag = self.cfg.protocol, len(self.cfg.shares)
        self.started = True
        for p, st in enumerate(self.cfg.start[:n_frag]):
            if st is None:
                continue
            round_, due, period = st
            self.rounds[p] = round_
            self.clocks[p] = next_clock(round_, due, period, pc.sync_every)
            self.syncs[p] = SyncState(fragment=p, global_round=round_, live=self.syncs[p].live)
        clocks = self._clocks(t)
        for p, c in enumerate(clocks):
            if c is not None:
                self.syncs[p] = scheduled(self.syncs[p], (c.first, c.every))
        for name in self.members:
            self.arrived[name] = list(self.rounds)
            self.based[name] = list(self.rounds)
            self.last[name] = [None] * n_frag
            self.members[name] = set(range(n_frag)) if self.up[name] else set()
            for p, c in enumerate(clocks):
                self.slots[name].due(p, c, t, 0.0)
        self._update_live_all(t)

    # ---- learners
    def _measure(self, name: str, a: float, b: float) -> None:
        """A step from ``a`` to ``b``: the learner's reported step time and its measured pace, as on a node."""
        self.step_s[name] = averaged_step_s(self.step_s[name], b - a, restart=len(self.ends[name]) == 1)
        self.ends[name].append(b)

    def _step(self, t: float, payload) -> None:
        name, step, a, b, life = payload
        n_frag = len(self.cfg.shares)
        if not self.started:  # before the window: only the learner's pace is measured
            self._measure(name, a, b)
            self.life[name] = life
            return
        last = self.last[name]
        if life != self.life[name]:  # a new life, from its checkpoint: its schedule and counters afresh
            self.life[name] = life
            self.slots[name].reset()
            self.ends[name].clear()
            self.step_s[name] = None
            last[:] = [None] * n_frag
            self.based[name] = list(self.arrived[name])  # it joined on the swarm's newest rounds
            self.members[name] = set()
            self._update_live_all(t)
        for p in range(n_frag):
            if last[p] is None:
                last[p] = step - 1
        self._measure(name, a, b)
        step_s = self.step_s[name] or (b - a)
        due = due_fragments(self.slots[name], self._clocks(b), self.plan.due(step), b, step_s)
        rec = self.out.records[name]
        for p in due:
            c_steps = step - last[p]
            if c_steps <= 0:
                continue
            last[p] = step
            cid = f"{name}:{p}:{step}:{len(rec)}"
            rec.append(
                {"kind": "contribute", "t": b, "learner": name, "fragment": p, "step": step, "cid": cid,
                 "c_steps": c_steps}
            )  # fmt: skip
            c = Contribution(name, p, self.based[name][p], c_steps, c_steps, step_s, None, cid)
            self._push(b + self._delay(name, p, step), _ARRIVE, c)
        self._adopt(name, b, step)  # then what reached it during the step: adopted at this step's end

    def _adopt(self, name: str, t: float, step: int) -> None:
        pc = self.cfg.protocol
        for p in range(len(self.cfg.shares)):
            r = self.arrived[name][p]
            if r > self.based[name][p]:
                self.based[name][p] = r
                self.out.records[name].append(
                    {"kind": "adopt", "t": t, "learner": name, "fragment": p, "round": r, "step": step,
                     "kept": pc.carry}
                )  # fmt: skip
                if not pc.carry:
                    self.last[name][p] = step

    def _record(self, t: float, payload) -> None:
        p, round_, name = payload  # a stopped node reads it when it wakes, a restarted one on joining
        self.arrived[name][p] = max(self.arrived[name][p], round_)
        step, since, until = self.idle[name]
        if self.started and since <= t < until:  # its learner has stepped for the last time: the node
            self._adopt(name, t, step)  # adopts what comes as it comes, as a paused learner's node does

    def _membership(self, t: float, payload) -> None:
        name, up = payload
        self.up[name] = up
        if not up:
            self.members[name] = set()
        self._update_live_all(t)

    # ---- synchronisers
    def _clocks(self, now: float) -> list[RoundClock | None]:
        return swarm_clocks(self.clocks, self.rounds, self.plan, now)

    def _update_live_all(self, t: float) -> None:
        for p in range(len(self.syncs)):
            self._update_live(p, t)

    def _update_live(self, p: int, t: float) -> None:
        live = frozenset(n for n, mem in self.members.items() if self.up[n] and p in mem)
        if live != self.syncs[p].live:
            self._decide(p, on_membership(self.cfg.protocol, self.syncs[p], live, t), t)

    def _arrive(self, t: float, c: Contribution) -> None:
        p = c.fragment
        if self.up[c.learner] and p not in self.members[c.learner]:  # waited for from now on
            self.members[c.learner].add(p)
            self._update_live(p, t)
        st = self.syncs[p]
        try:
            d = on_contribution(self.cfg.protocol, st, c, t)
        except ProtocolError as e:
            self.decisions.refused[e.code.value] += 1
            return
        if not carried(c, st):
            self.decisions.left_out_behind += 1
        elif st.phase is Phase.MERGING:
            self.decisions.queued += 1
        elif (c.learner, c.base_round) in st.pending:
            self.decisions.replaced += 1
        self._decide(p, d, t)

    def _wake(self, t: float, p: int) -> None:
        st = self.syncs[p]
        if self.wake_at[p] == t:
            self.wake_at[p] = None
        self._decide(p, on_tick(self.cfg.protocol, st, t), t)

    def _merged(self, t: float, p: int) -> None:
        c = self.clocks[p]
        due = None if c is None else (c.first, c.every)
        sync_s = self.merge_s + self.fanout_s
        self._decide(p, on_merged(self.cfg.protocol, self.syncs[p], t, sync_s, due), t)

    def _decide(self, p: int, d: Decision, t: float) -> None:
        before = self.syncs[p]
        self.syncs[p] = d.state
        for a in d.actions:
            if isinstance(a, Merge):
                self._merge(p, a, before, t)
            elif self.wake_at[p] != a.at:
                self.wake_at[p] = a.at
                self._push(a.at, _WAKE, p)

    def _merge(self, p: int, a: Merge, st: SyncState, t: float) -> None:
        pc = self.cfg.protocol
        if st.deadline is not None and t < st.deadline:
            self.decisions.merged_all_in += 1
        else:
            self.decisions.merged_grace_over += 1
        clocks = self._clocks(t)
        live = [measured_period(self.ends[n]) for n in st.live]
        reported = [c.step_time_s for c in a.contributions]
        due, period = record_timing(p, clocks, taken_at(st, t), live, reported, pc.sync_every, self.plan)
        self.clocks[p] = next_clock(a.round, due, period, pc.sync_every, self.clocks[p])
        self.rounds[p] = a.round
        for q, c in enumerate(self._clocks(t)):  # idle rounds with no clock of their own take the stagger's
            if self.clocks[q] is None and c is not None:
                self.syncs[q] = scheduled(self.syncs[q], (c.first, c.every))
        self.out.merges.append(
            {
                "kind": "merge",
                "t": t + self.merge_s,
                "fragment": p,
                "round": a.round,
                "hash": f"replay:{p}:{a.round}",
                "cids": [c.cid for c in a.contributions],
                "learners": sorted({c.learner for c in a.contributions}),
                "due": due,
                "period": period,
            }
        )
        fan = self.cfg.links.fanout_by
        for name in self.arrived:
            way = self._scaled(self.rng.choice(fan[name])) if fan.get(name) else self.fanout_s
            self._push(t + self.merge_s + way, _RECORD, (p, a.round, name))
        self._push(t + self.merge_s, _MERGED, p)  # as the node: its round is over once its record is made
