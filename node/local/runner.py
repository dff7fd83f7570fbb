"""The in-process runner: M real learners, the pure core, and a virtual clock
(docs/design.md, section 3, driver 2).

Learners train real models on real batches; time is virtual (a step ``step_time_s / speed`` times jitter,
a message ``latency + bytes / bandwidth``, a merge ``merge_s``). Timed events drive learners,
synchronisers and failures, deterministic for a seed. One loop runs the fragment-based systems:

  decoupled    the paper: non-blocking learners, quorum K, adaptive grace, RDA, token weights
  streaming    Streaming DiLoCo: fragments + overlap tau, every live learner, plain mean, learners block
               at tau steps after contributing until the merged fragment is back
  sync-diloco  DiLoCo: one fragment, every live learner, plain mean, learners block right after contributing
Data-parallel lives in ``node.local.dp``. Every system writes the same event records (``node.common.events``).
"""

from __future__ import annotations

import heapq
import itertools

import torch

from node.common.events import EventLog
from node.learner.learner import InnerConfig, Learner, plan_for
from node.learner.task import Task, evaluate
from node.local.dp import run_dp
from node.local.hostile import hostile_gradient
from node.local.learner_slot import LearnerSlot, align, keep_in_phase, live_set, swarm_step
from node.local.run_config import RunConfig, RunResult, jittered
from protocol.agreement import AgreementBook, merged_set
from protocol.codecs import decode_tensors, encode_tensors, wire_bytes
from protocol.config import ProtocolConfig
from protocol.errors import ProtocolError, RejectCode
from protocol.goodput import compute_goodput
from protocol.hashing import model_hash
from protocol.norms import NormBook
from protocol.replica import FragmentReplica
from protocol.schedule import (
    PHASE_EVERY,
    due_fragments,
    measured_period,
    record_timing,
    swarm_clocks,
)
from protocol.synchroniser import (
    Contribution,
    Decision,
    Merge,
    SyncState,
    WakeAt,
    on_contribution,
    on_membership,
    on_merged,
    on_tick,
    scheduled,
    taken_at,
)
from protocol.systems import system_protocol


def run_system(
    task: Task,
    run: RunConfig,
    pcfg: ProtocolConfig,
    inner: InnerConfig,
    events: EventLog | None = None,
    progress=None,
) -> RunResult:
    """Run any of ``SYSTEMS`` on ``task`` to ``run.token_budget`` tokens."""
    if run.system == "dp":
        return run_dp(task, run, inner, events, progress)
    return VirtualSwarm(task, run, pcfg, inner, events, progress).run()


class VirtualSwarm:
    """Runs one fragment-based system to a token budget. See the module docstring."""

    def __init__(
        self,
        task: Task,
        run: RunConfig,
        pcfg: ProtocolConfig,
        inner: InnerConfig,
        events: EventLog | None = None,
        progress=None,
    ) -> None:
        self.task, self.run_cfg, self.inner = task, run, inner
        self.cfg, self.blocking = system_protocol(run.system, pcfg, run.learners)
        self.events = events or EventLog()
        self.progress = progress
        probe = task.new_model()
        self.cfg.check_swarm(run.learners, len(list(probe.parameters())))
        self.plan = plan_for(task, probe, self.cfg)
        speeds = [run.plan(m).speed for m in range(run.learners)]
        self.slots = []
        for m in range(run.learners):
            share = speeds[m] / sum(speeds)
            steps = run.lr_steps or max(1, int(run.token_budget * share / task.tokens_per_batch))
            seed = run.seed * 1000 + m + 1
            # learner m of M reads part m/M of the user's data: disjoint from the others'
            lrn = Learner(
                f"L{m}", task, self.cfg, inner, steps, seed, plan=self.plan, data_part=(m, run.learners)
            )
            self.slots.append(LearnerSlot(lrn, run.plan(m), seed=run.seed * 7919 + m))
        base = self.slots[0].learner.base
        norms = NormBook()  # one robust-merge reference for all fragments
        self.replicas = [
            FragmentReplica(f.index, base[f.index], f.is_embedding, self.cfg.history, norms)
            for f in self.plan.fragments
        ]
        for s in self.slots:
            s.members_of = {f.index for f in self.plan.fragments}
        self._index = {s.learner.name: m for m, s in enumerate(self.slots)}
        names = frozenset(self._index)
        self.syncs = [SyncState(fragment=f.index, live=names) for f in self.plan.fragments]
        self.eval_model = task.new_model()
        self._heap: list = []
        self._seq = itertools.count()
        self.tokens = 0
        self._last_step_end = 0.0
        self.bytes_sent = 0
        self.rejected = 0
        self.merges, self.agreement = 0, AgreementBook()  # one book: the node's each see 1/N of the merges
        self.evals: list[tuple[int, float, float]] = []

    # ---- plumbing
    def _push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def global_params(self) -> dict[str, torch.Tensor]:
        return self.plan.whole({n: t for r in self.replicas for n, t in r.theta.items()})

    def global_hash(self) -> str:
        return model_hash([r.hash for r in self.replicas])

    def eval_global(self) -> float:
        self.eval_model.load_state_dict(self.global_params(), strict=False)
        return evaluate(self.task, self.eval_model)

    # ---- the loop
    def run(self) -> RunResult:
        run = self.run_cfg
        for m, s in enumerate(self.slots):
            # A node started late is away until then; pushed before the first step, so that step finds it away.
            late = ((0.0, s.plan.start_s),) if s.plan.start_s > 0 else ()
            for crash, back in late + s.plan.down:
                self._push(crash, "down", m)
                self._push(back, "up", m)
            self._push(0.0, "step", m)
        thresholds = run.eval_thresholds()
        now = 0.0
        self.evals.append((0, 0.0, self.eval_global()))
        self.events.emit("eval", t=0.0, tokens=0, loss=self.evals[-1][2])
        while self.tokens < run.token_budget:
            if not self._heap:
                raise RuntimeError(
                    "every learner is blocked or down and nothing is in flight; "
                    "the schedule cannot make progress"
                )
            now, _, kind, payload = heapq.heappop(self._heap)
            getattr(self, f"_on_{kind.replace('-', '_')}")(now, payload)
            while thresholds and self.tokens >= thresholds[0]:
                thresholds.pop(0)
                loss = self.eval_global()
                self.evals.append((self.tokens, now, loss))
                self.events.emit("eval", t=now, tokens=self.tokens, loss=loss)
                if self.progress:
                    self.progress(self.tokens, run.token_budget, loss)
        self._drain()
        final = self.eval_global()
        if self.evals[-1][0] == self.tokens:
            self.evals[-1] = (self.tokens, now, final)
        shares = [f.numel / self.plan.total_numel for f in self.plan.fragments]
        now = max(now, self._last_step_end)
        self.events.emit(
            "run",
            system=run.system,
            t0=0.0,
            t1=now,
            shares=shares,
            overlap=self.cfg.overlap,
            learners=[s.learner.name for s in self.slots],
        )
        g = compute_goodput(self.events.records)
        return RunResult(
            run.system,
            self.evals[-1][2],
            self.evals,
            g.goodput,
            now,
            self.tokens,
            self.merges,
            self.bytes_sent,
            g.steps,
            self.global_hash(),
            rejected=self.rejected,
            final_params=self.global_params(),
        )

    def _drain(self) -> None:
        """The budget is spent and learners stop; deliver what is in flight and finish due merges."""
        while self._heap:
            now, _, kind, payload = heapq.heappop(self._heap)
            if kind in ("contrib", "wake", "merged"):
                getattr(self, f"_on_{kind}")(now, payload)

    def _on_step(self, now: float, m: int) -> None:
        s = self.slots[m]
        lrn = s.learner
        if s.down or s.blocked_since is not None:
            return
        for p, round_, theta, mine in s.inbox:
            if lrn.adopt(p, round_, theta, mine):
                self.events.emit(
                    "adopt", t=now, learner=lrn.name, fragment=p, round=round_, step=lrn.steps, kept=lrn.kept
                )
        s.inbox.clear()
        if any(lrn.book.step >= deadline for _, deadline in s.awaiting.values()):
            s.blocked_since = now
            return
        res = lrn.train_step()
        self.tokens += res.tokens
        dur = jittered(s.rng, s.plan, self.run_cfg.step_time_s, lrn.steps - 1)
        s.measure(now, now + dur)
        self.events.emit("step", learner=lrn.name, step=lrn.steps, t0=now, t1=now + dur, loss=res.loss)
        self._last_step_end = max(self._last_step_end, now + dur)
        # The node's rule (node.learner.loop): slots of the swarm's schedule before the next step's end
        # (as long as its steps have taken on average), else (no record yet) the learner's own steps.
        due = res.due
        if (
            lrn.steps == s.first_step + 1 and swarm_step(self.slots, s, now) is not None
        ):  # decided at its start
            due = []  # the node's rule: a life's first step among peers takes nothing by its own count
        if not self.blocking:
            due = due_fragments(s.slots, self._clocks(now), due, now + dur, s.step_s or 0.0)
        for p in due:
            c = lrn.book.counters[p]
            enc = lrn.contribution(p)
            if s.plan.hostile:
                enc = encode_tensors(hostile_gradient(self.slots, s, p), self.cfg.codec, self.cfg.codec_block)
            nbytes = wire_bytes(enc)
            self.bytes_sent += nbytes
            cid = f"{lrn.name}:{p}:{lrn.steps}"
            self.events.emit(
                "contribute",
                t=now + dur,
                learner=lrn.name,
                fragment=p,
                step=lrn.steps,
                cid=cid,
                bytes=nbytes,
                c_steps=c.c_steps,
                c_tokens=c.c_tokens,
            )
            tokens = c.c_tokens * s.plan.inflate
            contrib = (lrn.name, p, c.base_round, c.c_steps, tokens, s.step_s or 0.0, enc, cid)
            self._push(now + dur + self.run_cfg.net.transfer_s(nbytes), "contrib", contrib)
            if self.blocking:
                s.awaiting[p] = (cid, lrn.book.step + self.cfg.overlap)
        wait = 0.0
        if lrn.steps == s.first_step + 1:
            wait = align(self.slots, s, now + dur, self.events)
        elif not self.blocking and (lrn.steps - s.first_step) % PHASE_EVERY == 0:
            keep_in_phase(self.slots, s, now + dur, self.events)
        self._push(now + dur + wait, "step", m)

    def _on_contrib(self, now: float, payload) -> None:
        name, p, base_round, c_steps, c_tokens, step_s, enc, cid = payload
        try:
            if self.cfg.distrust and self.agreement.refuse(name):  # as a node does (protocol.agreement)
                raise ProtocolError(RejectCode.DISTRUSTED, f"{name}'s outer gradients oppose the rest")
            delta = decode_tensors(enc)
            n = self.replicas[p].check_delta(delta, self.cfg, name)
            c = Contribution(name, p, base_round, c_steps, c_tokens, step_s, delta, cid, n)
            self._decide(p, on_contribution(self.cfg, self.syncs[p], c, now), now)
            slot = self.slots[self._index[name]]
            if p not in slot.members_of and not slot.down:
                slot.members_of.add(p)
                self._membership(now, [p])
        except ProtocolError as e:
            self.rejected += 1
            self.events.emit(
                "reject", t=now, learner=name, fragment=p, cid=cid, code=e.code.value, why=str(e)
            )
            m = self._index[name]
            if self.slots[m].awaiting.get(p, ("",))[0] == cid:
                del self.slots[m].awaiting[p]
                self._maybe_unblock(m, now)

    def _on_wake(self, now: float, p: int) -> None:
        self._decide(p, on_tick(self.cfg, self.syncs[p], now), now)

    def _decide(self, p: int, d: Decision, now: float) -> None:
        self.syncs[p] = d.state
        for a in d.actions:
            if isinstance(a, WakeAt):
                self._push(a.at, "wake", p)
            elif isinstance(a, Merge):
                self._merge(p, a, now)

    def _clocks(self, now: float) -> list:  # the node's rule: own clocks, the stagger's before a first record
        reps = self.replicas
        return swarm_clocks([r.clock for r in reps], [r.round for r in reps], self.plan, now)

    def _merge(self, p: int, a: Merge, now: float) -> None:
        rep, st, clocks = self.replicas[p], self.syncs[p], self._clocks(now)
        kept = merged_set(
            self.agreement, a.contributions, self.cfg.distrust
        )  # the node's rule: no receipts here
        if not kept:  # the round starts over without them, as on a node (``Replication._merge``)
            self.syncs[p] = SyncState(p, rep.round, live=st.live, working=st.working, due_at=st.due_at,
                                      due_every=st.due_every)  # fmt: skip
            return  # the round starts over without them
        a = Merge(a.round, kept)
        live = [measured_period(s.ends) for s in self.slots if s.learner.name in st.live]
        reported = [c.step_time_s for c in a.contributions]
        due, period = record_timing(
            p, clocks, taken_at(st, now), live, reported, self.cfg.sync_every, self.plan
        )
        rec = rep.make_record(a.round, a.contributions, self.cfg, live=len(st.live), due=due, period=period)
        rep.apply_record(rec, self.cfg)
        was = self.agreement.out
        self.agreement.add([c[0] for c in rec.contributors], rec.agreement if self.cfg.distrust else ())
        if self.agreement.out != was:  # one refused leaves the quorum's basis; trusted again, it is back
            self._membership(now)
        for q, c in enumerate(self._clocks(now)):  # idle rounds with no clock of their own take the stagger's
            if self.replicas[q].clock is None and c is not None:
                self.syncs[q] = scheduled(self.syncs[q], (c.first, c.every))
        self.merges += 1
        cids = [c.cid for c in a.contributions]
        self.events.emit(
            "merge",
            t=now,
            fragment=p,
            round=a.round,
            cids=cids,
            hash=rec.new_hash,
            learners=[c.learner for c in a.contributions],
            weights=[c[2] for c in rec.contributors],
            due=rec.due,
            period=rec.period,
        )
        nbytes = sum(t.numel() * 4 for t in rep.theta.values())
        arrive = now + self.run_cfg.net.merge_s + self.run_cfg.net.transfer_s(nbytes)
        for m, s in enumerate(self.slots):
            if not s.down:
                mine = [(c.c_steps, c.c_tokens) for c in a.contributions if c.learner == s.learner.name]
                self._push(arrive, "arrive", (m, p, a.round, rep.theta, frozenset(cids), mine))
        self._push(arrive, "merged", (p, arrive - now))

    def _on_merged(self, now: float, payload) -> None:
        p, sync_s = payload
        c = self.replicas[p].clock
        due = None if c is None else (c.first, c.every)
        self._decide(p, on_merged(self.cfg, self.syncs[p], now, sync_s, due), now)

    def _on_arrive(self, now: float, payload) -> None:
        m, p, round_, theta, cids, mine = payload
        s = self.slots[m]
        if s.down:
            return
        s.inbox.append((p, round_, theta, mine))
        if p in s.awaiting and s.awaiting[p][0] in cids:
            del s.awaiting[p]
        self._maybe_unblock(m, now)

    def _maybe_unblock(self, m: int, now: float) -> None:
        s = self.slots[m]
        step = s.learner.book.step
        if s.blocked_since is not None and not any(step >= d for _, d in s.awaiting.values()):
            self.events.emit("block", learner=s.learner.name, t0=s.blocked_since, t1=now)
            s.blocked_since = None
            self._push(now, "step", m)

    def _on_down(self, now: float, m: int) -> None:
        s = self.slots[m]
        s.down, s.inbox, s.awaiting = True, [], {}
        if s.blocked_since is not None:
            self.events.emit("block", learner=s.learner.name, t0=s.blocked_since, t1=now)
            s.blocked_since = None
        self.events.emit("down", t=now, learner=s.learner.name)
        self._membership(now)

    def _on_up(self, now: float, m: int) -> None:
        """The learner is back: it downloads the global model (which takes time), then trains on."""
        nbytes = sum(t.numel() * 4 for t in self.global_params().values())
        self._push(now + self.run_cfg.net.transfer_s(nbytes), "rejoin", m)

    def _on_rejoin(self, now: float, m: int) -> None:
        s = self.slots[m]
        s.down = False
        s.fresh_process()
        rounds = [r.round for r in self.replicas]
        if s.learner.steps == 0:
            # Started late, as a node: the global model (if any round merged), step 0 of its own schedule
            # (aligned after its first step), a member of every fragment's rounds from its start.
            if any(r > 0 for r in rounds):
                s.learner.join(rounds, [r.theta for r in self.replicas])
            s.members_of = {f.index for f in self.plan.fragments}
        else:
            # Back after a failure: a donor's step, and waited for on fragment p only from its first
            # contribution of p (blocking systems' learners deadlocked without: docs/algorithm.md).
            donors = [x.learner.book.step for x in self.slots if not x.down and x is not s]
            s.learner.join(rounds, [r.theta for r in self.replicas], max(donors, default=s.learner.book.step))
            s.members_of = set()
            gone = dict(t=now, learner=s.learner.name, step=s.learner.steps, kept=False)
            for p, r in enumerate(rounds):  # what it had not contributed before it went down is gone
                self.events.emit("adopt", fragment=p, round=r, **gone)
        self.events.emit("up", t=now, learner=s.learner.name)
        self._membership(now)
        self._push(now, "step", m)

    def _membership(self, now: float, fragments: list[int] | None = None) -> None:
        out = self.agreement.out if self.cfg.distrust else frozenset()
        for p in range(len(self.syncs)) if fragments is None else fragments:
            live = live_set(self.slots, p)
            working = live - out if out else None  # as a node: no quorum waits for a learner it refuses
            if live != self.syncs[p].live or working != self.syncs[p].working:
                self._decide(p, on_membership(self.cfg, self.syncs[p], live, now, working), now)
