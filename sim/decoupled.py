"""Decoupled DiLoCo in virtual time: M learners and the real synchroniser state machines (docs/design.md,
sections 1 and 3).

Each learner is a block of chips (``sim.blocks``) that steps on its own clock and never waits for peers.
After step k it contributes the fragments the schedule makes due (``protocol.fragments``: fragment p when
k = offset(p) mod H); the contribution reaches fragment p's synchroniser ``contrib_s`` later. The
synchroniser is ``protocol.synchroniser`` itself, one ``SyncState`` per fragment, fed with
``on_contribution`` / ``on_tick`` / ``on_membership`` / ``on_merged`` in virtual time, exactly as the
in-process runner (``node.local.runner``) and the real node drive it; only the tensors are absent (a contribution's
delta is None, and nothing in the state machine looks at it). A merge reaches the learners ``sync_s`` after
it is decided; a learner adopts it at its next step boundary, and its next contribution of that fragment is
based on it.

Failures: a failure of one of a learner's chips aborts that learner's step and stops it for its recovery
(``sim.model``). A learner that resizes keeps its node, so it stays in every fragment's live set (a quorum of
K = M waits for it); a learner that restarts drops out of the live sets, and when it is back it is waited
for on fragment p only from its first contribution of p, as in the runner, so rounds under way never stall
for it. The other learners train on; with quorum K the synchroniser merges whoever is in.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable

from protocol.errors import ProtocolError
from protocol.fragments import plan_fragments
from protocol.synchroniser import (
    Contribution,
    Decision,
    Merge,
    Phase,
    SyncState,
    on_contribution,
    on_membership,
    on_merged,
    on_tick,
)
from sim.accounting import RecordSink, Tally
from sim.blocks import (
    Counts,
    advance_slowdowns,
    fail_host,
    failure_in,
    make_blocks,
    pause,
    pick_host,
    return_hosts,
    seed_repairs,
    spend,
    step_factor,
)
from sim.model import SimConfig

# event kinds, in a heap of (time, sequence, kind, payload); the sequence keeps equal times first-in first-out
_STEP, _ARRIVE, _WAKE, _MERGED, _FAIL, _BACK = range(6)


class DecoupledDriver:
    def __init__(self, cfg: SimConfig, rng: random.Random, rec: RecordSink | None = None) -> None:
        self.cfg, self.rng, self.rec = cfg, rng, rec
        self.pcfg = cfg.protocol()
        m_count, p_count, h = cfg.learners, cfg.fragments, cfg.sync_every
        # Equal fragments: the schedule is protocol.fragments' (offsets p*H//P), the shares are 1/P each.
        plan = plan_fragments({f"t{p}": 1 for p in range(p_count)}, p_count, h)
        self.due = [tuple(plan.due(r if r else h)) for r in range(h)]
        self.shares = [f.numel / plan.total_numel for f in plan.fragments]
        self.tally = Tally(m_count, self.shares)
        self.blocks = make_blocks(cfg, rng)
        if cfg.learner_recovery == "resize":
            for blk in self.blocks:
                seed_repairs(cfg, rng, blk, rec, blk.chips)
        self.counts = Counts()
        self.names = [f"L{m}" for m in range(m_count)]
        everyone = frozenset(self.names)
        self.syncs = [SyncState(fragment=p, live=everyone) for p in range(p_count)]
        self.up = [True] * m_count
        self.members = [set(range(p_count)) for _ in range(m_count)]  # fragments whose rounds count on m
        self.steps = [0] * m_count
        self.last_step = [[0] * p_count for _ in range(m_count)]  # step of m's last contribution of p
        self.at_learners = [0] * p_count  # newest merged round of p that has reached the learners
        self.wake_at: list[float | None] = [None] * p_count
        self.heap: list = []
        self.seq = itertools.count()

    def _push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, payload))

    def run(self, progress: Callable[[float], None] | None = None) -> None:
        for m in range(self.cfg.learners):
            self._push(0.0, _STEP, m)
        handlers = (self._step, self._arrive, self._wake, self._merged, self._fail, self._back)
        heap, pop = self.heap, heapq.heappop
        n, end = 0, self.cfg.duration_s
        while heap:
            t, _, kind, payload = pop(heap)
            handlers[kind](t, payload)
            n += 1
            if progress is not None and not n & 0xFFFF:
                progress(min(1.0, t / end))
        if progress is not None:
            progress(1.0)

    # ---- learners
    def _step(self, t: float, m: int) -> None:
        cfg, blk = self.cfg, self.blocks[m]
        if t >= cfg.duration_s:
            return
        if blk.returns and blk.returns[0][0] <= t:
            return_hosts(blk, t, self.tally, self.rec)
        present = blk.present
        if present == 0:  # every chip of this learner is away: it resumes with its first replacement
            self._push(blk.returns[0][0], _STEP, m)
            return
        d = cfg.step_s * step_factor(cfg, self.rng, blk, t)
        t1 = t + d
        if t1 > cfg.duration_s:
            return
        tf = failure_in(cfg, blk.hazard, present, t, d)
        if tf is not None:
            blk.hazard = self.rng.expovariate(1.0)
            self.tally.lost_s += present * (tf - t)
            self._push(tf, _FAIL, m)
            return
        blk.hazard = spend(cfg, blk.hazard, present, d)
        advance_slowdowns(cfg, self.rng, blk, t, d)
        k = self.steps[m] = self.steps[m] + 1
        self.counts.steps += 1
        self.tally.step(m, present * d)
        rec = self.rec
        if rec is not None:
            rec.step(m, k, t, t1, t1, blk.away_slots())
        last = self.last_step[m]
        arrive = t1 + cfg.contrib_s
        for p in self.due[k % cfg.sync_every]:
            cid = f"{m}:{p}:{k}"
            c_steps = k - last[p]
            last[p] = k
            self.tally.contribute(m, p, cid)
            if rec is not None:
                rec.contribute(m, p, k, cid)
            # based on the newest merge that reached the learner by this step's start
            self._push(arrive, _ARRIVE, (m, p, self.at_learners[p], c_steps, c_steps * present, d, cid))
        self._push(t1, _STEP, m)

    def _fail(self, t: float, m: int) -> None:
        cfg, blk, rec = self.cfg, self.blocks[m], self.rec
        self.counts.failures += 1
        host = pick_host(self.rng, blk)
        if cfg.learner_recovery == "resize":
            back = t + cfg.resize_s
            fail_host(blk, host, t, t + cfg.repair_s, rec)
        else:  # a restart is scheduled onto a spare host, so the learner comes back at full size
            back = t + cfg.spare_s + cfg.restart_s
            fail_host(blk, host, t, back, rec)
            self._lose_unsent(m)
        pause(blk, t, min(back, cfg.duration_s), self.tally, rec)
        if cfg.learner_recovery == "restart":
            # The learner's node restarts: its membership record expires and the synchronisers stop
            # counting on it. A resizing learner's node stays up and keeps its record fresh, so it stays
            # live (a quorum of K = M waits for it) while its unit re-forms.
            self.up[m] = False
            for p in range(cfg.fragments):
                if self.names[m] in self.syncs[p].live:
                    self._update_live(p, t)
        self._push(back, _BACK, m)

    def _lose_unsent(self, m: int) -> None:
        """A restarting learner reloads the global model: what it had not yet contributed is dropped."""
        k, last = self.steps[m], self.last_step[m]
        for p in range(self.cfg.fragments):
            if k > last[p]:
                cid = f"{m}:{p}:{k}:lost"
                last[p] = k
                self.tally.contribute(m, p, cid)
                if self.rec is not None:
                    self.rec.contribute(m, p, k, cid, lost=True)

    def _back(self, t: float, m: int) -> None:
        if t >= self.cfg.duration_s:
            return
        if not self.up[m]:
            self.up[m] = True
            self.members[m] = set()
        self._step(t, m)

    # ---- synchronisers
    def _arrive(self, t: float, payload: tuple) -> None:
        m, p, base, c_steps, c_tokens, step_s, cid = payload
        c = Contribution(self.names[m], p, base, c_steps, c_tokens, step_s, None, cid)
        try:
            self._decide(p, on_contribution(self.pcfg, self.syncs[p], c, t), t)
        except ProtocolError:
            self.counts.rejected += 1  # never merged, so dropped
            return
        if self.up[m] and p not in self.members[m]:
            self.members[m].add(p)
            self._update_live(p, t)

    def _update_live(self, p: int, t: float) -> None:
        live = frozenset(n for n, up, mem in zip(self.names, self.up, self.members) if up and p in mem)
        if live != self.syncs[p].live:
            self._decide(p, on_membership(self.pcfg, self.syncs[p], live, t), t)

    def _wake(self, t: float, p: int) -> None:
        st = self.syncs[p]
        if self.wake_at[p] == t:
            self.wake_at[p] = None
        if st.phase is Phase.GRACE and st.deadline is not None and t >= st.deadline:
            self._decide(p, on_tick(self.pcfg, st, t), t)

    def _merged(self, t: float, payload: tuple[int, int]) -> None:
        p, round_ = payload
        self.at_learners[p] = round_
        self._decide(p, on_merged(self.pcfg, self.syncs[p], t, self.cfg.sync_s), t)

    def _decide(self, p: int, d: Decision, t: float) -> None:
        self.syncs[p] = d.state
        for a in d.actions:
            if isinstance(a, Merge):
                self.counts.merges += 1
                cids = [c.cid for c in a.contributions]
                for cid in cids:
                    self.tally.merged(cid)
                if self.rec is not None:
                    self.rec.merge(p, a.round, cids, t)
                self._push(t + self.cfg.sync_s, _MERGED, (p, a.round))
            elif self.wake_at[p] != a.at:  # WakeAt: one pending wake per fragment and deadline
                self.wake_at[p] = a.at
                self._push(a.at, _WAKE, p)
