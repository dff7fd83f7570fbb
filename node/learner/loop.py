"""The learner thread of a node: trains without pause, hands contributions to the agent, adopts what the
agent delivers between steps (it never waits on the network)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from typing import Protocol

import torch

from node.common.priority import lower_own_thread_priority, name_own_thread
from node.learner.evaluation import ParamsModel, eval_model
from node.learner.learner import Learner
from node.learner.task import evaluate
from node.learner.unit import PAUSE, STATE, STEP, STOP
from protocol.codecs import wire_bytes
from protocol.messages import ContributionHeader, contribution_id
from protocol.schedule import (
    PHASE_EVERY,
    RATE_WINDOW,
    SlotBook,
    aligned_step,
    averaged_step_s,
    due_fragments,
    in_phase_step,
    measured_period,
    usable,
)

logger = logging.getLogger(__name__)
UNIT_CHECK_EVERY = 50  # steps between whole-model digest checks across a unit's ranks
LEARNER_THREAD = "ddiloco-learn"  # its name as the OS shows it, to tell its CPU time from the node's
RESEND_BEATS = 2  # a blocked learner re-sends what it waits for every this many heartbeats


# ------------------------------------------------------------------------------------------- its node
class _Outbox(Protocol):
    def post(self, header: ContributionHeader, encoded: object) -> None: ...  # a contribution, to send
    def resend(self, p: int) -> None: ...  # the last one of fragment p, again (a blocked learner)


class _SwarmStep(Protocol):
    def swarm_step(self) -> float | None: ...  # the swarm's inner step, from the members' records


class _Clocks(Protocol):
    def current(self) -> list: ...  # each fragment's round clock (``protocol.schedule.RoundClock``)


class _Events(Protocol):
    def emit(self, kind: str, **fields) -> None: ...


class LearnerHost(Protocol):
    """What the learner thread uses of the node that hosts it (``node.swarm.agent.Node``): its id, settings
    (``slowdown``, ``jitter``, ``threads``, ``learner_nice``, ``heartbeat_s``, ``block_timeout_s``), task,
    learner and unit, whether it blocks (the baselines), its event log, the outbox it hands contributions to,
    the swarm's step and round clocks it keeps its phase by, and a stop it asks for when it fails."""

    peer_id: str
    settings: object
    task: object
    learner: Learner
    unit: object | None
    blocking: bool
    events: _Events
    outbox: _Outbox
    view: _SwarmStep
    clocks: _Clocks

    def request_stop(self, reason: str) -> None: ...


# ------------------------------------------------------------------------------------------- learner thread
class LearnerLoop(threading.Thread):
    """Trains without pause; hands contributions to the agent and adopts what the agent delivers."""

    def __init__(self, node: LearnerHost, learner: Learner) -> None:
        super().__init__(name="learner", daemon=True)
        self.node, self.learner = node, learner
        self.inbox: deque = deque()  # (fragment, round, theta, force, merged)
        # (fn, concurrent Future): fn is called here, between two steps, with the learner's live state
        # (tensors, meta; valid until the next step), and its result answers (a checkpoint writer)
        self.requests: deque = deque()
        self.stop_flag = threading.Event()
        self.paused = threading.Event()
        self.idle = threading.Event()  # set while paused or stopped: no step in progress
        self.arrived = threading.Event()  # set when the agent delivers a fragment (wakes a blocked learner)
        # Baseline systems (sync-diloco, streaming): fragment -> (round contributed against, schedule step
        # before which the merge must be back); the learner waits rather than take that step.
        self.awaiting: dict[int, tuple[int, int]] = {}
        self._blocked_since: float | None = None
        self._resent_at = 0.0
        self.tokens = 0
        self.step_s: float | None = None
        self._first_step = 0  # the learner's step count when this life of it started (``run``)
        self.loss_ema: float | None = None
        self.eval_loss: float | None = None
        self.eval_cpu_s = 0.0  # CPU seconds of the last evaluation (its thread's): it paces the next
        self.eval_history: list[tuple[float, int, float]] = []
        self.error: BaseException | None = None
        # The agent's periodic evaluation and the final one share this model, which holds no weights of its
        # own: it evaluates the tensors it is handed (node.learner.evaluation).
        self._eval_model = eval_model(node.task, learner.model)
        self._eval_lock = threading.Lock()
        self._rate: deque = deque(maxlen=RATE_WINDOW)  # (time, tokens) for tokens/s; the learner appends
        self._rate_lock = (
            threading.Lock()
        )  # the agent's thread reads it (a read mid-append killed a heartbeat)
        self.slots = SlotBook()  # the schedule's slots this learner has contributed to
        self._jitter_rng = random.Random(node.learner.seed)

    def cpu_s(self) -> float | None:
        """CPU seconds this thread has used (any thread may ask; None before it starts or where the OS
        gives no per-thread clock)."""
        if self.ident is None or not self.is_alive():
            return None
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.ident))
        except (AttributeError, OSError):
            return None

    def deliver(self, p: int, round_: int, theta, force: bool, merged: list | None = None) -> None:
        """The agent hands over merged (or, with ``force``, re-synced) global fragment p (any thread);
        ``merged``: (c_steps, c_tokens) of each of this learner's contributions the round merged."""
        self.inbox.append((p, round_, theta, force, merged))
        self.arrived.set()

    def _must_wait(self) -> bool:
        """Baseline systems: True while a fragment this learner contributed is due back and is not.

        A fragment is back once the learner holds a round newer than the one it contributed against. While
        it waits, it re-sends that contribution every ``RESEND_BEATS`` heartbeats (``Node.resend``). A
        merge that never comes (``block_timeout_s``) is given up: the learner trains on, and the wait ends
        with a ``block`` record either way, which goodput counts as blocked time."""
        lrn, now = self.learner, time.time()
        for p, (base, _) in list(self.awaiting.items()):
            if lrn.book.counters[p].base_round > base:
                del self.awaiting[p]
        late = [p for p, (_, due) in self.awaiting.items() if lrn.book.step >= due]
        if late and self._blocked_since is None:
            self._blocked_since = self._resent_at = now
        if late and now - self._resent_at >= RESEND_BEATS * self.node.settings.heartbeat_s:
            self._resent_at = now
            for p in late:
                self.node.outbox.resend(p)
        if late and now - self._blocked_since > self.node.settings.block_timeout_s:
            logger.warning(
                "no merge of fragment(s) %s after %.0f s of waiting: training on",
                late,
                now - self._blocked_since,
            )
            for p in late:
                del self.awaiting[p]
            late = []
        if not late and self._blocked_since is not None:
            self.node.events.emit("block", learner=self.node.peer_id, t0=self._blocked_since, t1=now)
            self._blocked_since = None
        return bool(late)

    def _rate_now(self) -> list[tuple[float, int]]:
        """The (time, tokens) of the last steps, copied under the lock the learner's thread appends under."""
        with self._rate_lock:
            return list(self._rate)

    def tokens_per_s(self) -> float:
        rate = self._rate_now()
        if len(rate) < 2:
            return 0.0
        (t0, k0), (t1, k1) = rate[0], rate[-1]
        return (k1 - k0) / (t1 - t0) if t1 > t0 else 0.0

    def steps_per_s(self) -> float:
        """Steps per second over the last steps (``protocol.schedule.measured_period``, the runner's rule too),
        0 until enough are in: the swarm's schedule is made of these."""
        period = measured_period([t for t, _ in self._rate_now()])
        return 1.0 / period if period > 0 else 0.0

    def _align_schedule(self) -> None:
        """Put the fragment schedule in phase with the swarm's, once, after this run's first step (which
        carries the warm-up: aligning before it would leave the learner that many steps behind).

        Learners in phase contribute a fragment at about the same time, so one round merges them together:
        one merge record per fragment per H steps rather than one per learner. The phase is matched to a
        fraction of a step: the learner takes the step number the peers start next and waits (less than one
        step, once) until they start it."""
        aligned = aligned_step(self.node.view.swarm_step(), self.step_s)
        lrn = self.learner
        if aligned is None:
            return
        nxt, wait_s = aligned
        logger.info(
            "fragment schedule moved from step %d to the swarm's %d (+%.3f s)", lrn.book.step, nxt, wait_s
        )
        self.node.events.emit(
            "align", t=time.time(), learner=self.node.peer_id, before=lrn.book.step, after=nxt, wait_s=wait_s
        )
        lrn.book.step = nxt
        if wait_s > 0:
            self.stop_flag.wait(wait_s)

    def _keep_in_phase(self) -> None:
        """Every ``PHASE_EVERY`` steps: a learner that has fallen behind the swarm's schedule by half a step or more
        moves its schedule forward to it (never back, never waiting).

        Learners of different speeds drift apart after the first alignment. Out of phase, they contribute
        fragment p at different moments, each round merges one of them, and every learner adopts every
        round: adoption replaces its copy of p, overwriting what it trained on p since it last received
        it (see docs/chaos.md). Jumping the schedule only changes which fragments come due next; the
        counters still count every step a contribution holds."""
        lrn = self.learner
        after = in_phase_step(self.node.view.swarm_step(), lrn.book.step)
        if after is None:
            return
        before, lrn.book.step = lrn.book.step, after
        self.node.events.emit(
            "align", t=time.time(), learner=self.node.peer_id, before=before, after=lrn.book.step, wait_s=0.0
        )

    def _slowdown_s(self, dt: float) -> float:
        """How long to sleep after a step of ``dt`` seconds so it took ``slowdown`` (with jitter) times as long."""
        s = self.node.settings
        if s.slowdown == 1.0 and s.jitter == 0.0:
            return 0.0
        factor = s.slowdown * (1.0 + self._jitter_rng.uniform(-s.jitter, s.jitter))
        return max(0.0, factor - 1.0) * dt

    def _due_after_step(self) -> list[int]:
        """The fragments this learner takes after the step it starts now, decided before the step so that a
        unit's ranks all join the same gathers. Baselines: by the learner's own steps (they block, so they
        stay in step). Decoupled: those whose round on the swarm's schedule (``protocol.schedule``) is up
        before the step after this one ends, a slot this learner has not contributed to (before a
        fragment's first record, the stagger's slot: ``protocol.schedule.swarm_clocks``); with no schedule
        anywhere yet, by the learner's own steps."""
        lrn = self.learner
        by_steps = lrn.plan.due(lrn.book.step + 1)
        if lrn.steps == self._first_step and self.node.view.swarm_step() is not None:
            # A life's first step among peers: its schedule is put in phase with theirs after this step
            # (``_align_schedule``); what its own count makes due now is out of phase, and a round of one
            # learner's single step, merged alone, would overwrite what the others trained on it.
            by_steps = []
        if self.node.blocking:
            return by_steps
        step_s = self.step_s or 0.0
        now = time.time()
        clocks = [usable(c, now) for c in self.node.clocks.current()]
        return due_fragments(self.slots, clocks, by_steps, now + step_s, step_s)

    def _service(self) -> tuple[list[int], list]:
        """Adopt what arrived, answer state requests, evaluate when due. Returns the fragments adopted and
        the state requests left for after the unit's next exchange (a sharded learner's state is gathered
        there, with every rank)."""
        lrn = self.learner
        adopted = []
        while self.inbox:
            p, round_, theta, force, merged = self.inbox.popleft()
            if force:
                lrn.resync(p, round_, theta)
                self.slots.forget(p)
            elif not lrn.adopt(p, round_, theta, merged):
                continue
            kept = lrn.kept
            self.node.events.emit(
                "adopt",
                t=time.time(),
                learner=self.node.peer_id,
                fragment=p,
                round=round_,
                step=lrn.steps,
                kept=kept,
                **({"resync": True} if force else {}),
            )
            adopted.append(p)
        asks = []
        while self.requests:
            fn, fut = self.requests.popleft()
            if (
                fut.set_running_or_notify_cancel()
            ):  # else the asking side gave up (e.g. cancelled at shutdown)
                asks.append((fn, fut))
        if not lrn.sharded:
            self._answer(asks)
            asks = []
        return adopted, asks

    def _answer(self, asks: list) -> None:
        """Answer state requests; a sharded unit gathered the whole state in the exchange just made."""
        for fn, fut in asks:
            try:
                full = self.node.unit.take_saved() if self.learner.sharded else None
                fut.set_result(fn(*self.learner.state(full, copy=False)))
            except Exception as e:  # noqa: BLE001 - handed to the waiting side
                fut.set_exception(e)

    def _post_ready(self, wait: bool = False) -> None:
        """Hand the agent every contribution whose snapshot has reached the host (all of them with ``wait``)."""
        lrn = self.learner
        for (base_round, c_steps, c_tokens, step, t), p, enc in lrn.ready_contributions(wait):
            cid = contribution_id(self.node.peer_id, p, step, t)
            header = ContributionHeader(
                learner=self.node.peer_id,
                fragment=p,
                base_round=base_round,
                c_steps=c_steps,
                c_tokens=c_tokens,
                step_time_s=self.step_s or 0.0,
                codec=lrn.pcfg.codec,
                block=lrn.pcfg.codec_block,
                cid=cid,
            )
            self.node.events.emit(
                "contribute",
                t=t,
                learner=self.node.peer_id,
                fragment=p,
                step=step,
                cid=cid,
                bytes=wire_bytes(enc),
                c_steps=c_steps,
                c_tokens=c_tokens,
            )
            self.node.outbox.post(header, enc)

    def evaluate(self, params: dict[str, torch.Tensor] | None = None, taken_at: float | None = None) -> float:
        """Eval loss of the global model: ``params`` (a copy of the node's replicas taken at ``taken_at``,
        handed over by the agent, which evaluates off this thread so the learner never pauses for it), else
        the fragments the learner last adopted (once it has stopped). Any thread. The ``eval`` record
        carries the moment, steps and tokens of the copy, not of the end of the evaluation."""
        at = time.time() if taken_at is None else taken_at
        steps, tokens = self.learner.steps, self.tokens
        if params is None:
            params = {n: t for base in self.learner.base for n, t in base.items()}
        with self._eval_lock:
            cpu0 = time.thread_time()
            if isinstance(self._eval_model, ParamsModel):
                loss = self._eval_model.evaluate(params)
            else:
                self._eval_model.load_state_dict(self.learner.plan.whole(params), strict=False)
                loss = evaluate(self.node.task, self._eval_model)
            self.eval_cpu_s = time.thread_time() - cpu0
        self.eval_loss = loss
        self.eval_history.append((at, steps, loss))
        self.node.events.emit(
            "eval", t=at, tokens=tokens, loss=loss, step=steps, cpu_s=round(self.eval_cpu_s, 3)
        )
        return loss

    def eval_tensors(self) -> list[torch.Tensor]:
        """The tensors the evaluation model holds of its own (the node's memory account)."""
        m = self._eval_model
        return m.tensors() if isinstance(m, ParamsModel) else list(m.parameters())

    def run(self) -> None:
        s = self.node.settings
        if s.threads > 0:
            torch.set_num_threads(s.threads)
        niced = lower_own_thread_priority(s.learner_nice) if s.learner_nice > 0 else 0
        name_own_thread(LEARNER_THREAD)
        self.node.events.emit("learner", t=time.time(), learner=self.node.peer_id, niced=niced)
        lrn = self.learner
        first_step = self._first_step = lrn.steps
        unit = self.node.unit
        try:
            if unit is not None:  # the other ranks wait for rank 0: join them, then hand them the state
                unit.init()
                lrn.attach_unit(unit)
                unit.exchange(lrn, STATE)
            while not self.stop_flag.is_set():
                adopted, asks = self._service()
                if self.paused.is_set():
                    if unit is not None:
                        unit.exchange(lrn, PAUSE, adopted, save=bool(asks))
                    self._answer(asks)
                    self._post_ready()
                    self.idle.set()
                    self.stop_flag.wait(0.05)
                    continue
                if self.node.blocking and self._must_wait():
                    if unit is not None:  # the other ranks wait with it, and take what arrived meanwhile
                        unit.exchange(lrn, PAUSE, adopted, save=bool(asks))
                    self._answer(asks)
                    self._post_ready()
                    self.arrived.wait(0.05)
                    self.arrived.clear()
                    continue
                self.idle.clear()
                due = self._due_after_step()
                if unit is not None:
                    check_all = lrn.steps % UNIT_CHECK_EVERY == 0
                    unit.exchange(lrn, STEP, adopted, check_all=check_all, save=bool(asks), due=due)
                self._answer(asks)
                t0 = time.time()
                res = lrn.train_step()
                dt = time.time() - t0
                # A slower chip (--slowdown, --step-delay-s): the step ends when the sleep does, and every
                # measure of the learner's speed counts it.
                delay = s.step_delay_s + self._slowdown_s(dt)
                if delay > 0:
                    self.stop_flag.wait(delay)
                t1 = time.time()
                self.step_s = averaged_step_s(self.step_s, t1 - t0, lrn.steps == first_step + 2)
                self.loss_ema = res.loss if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * res.loss
                self.tokens += res.tokens
                with self._rate_lock:
                    self._rate.append((t1, self.tokens))
                self.node.events.emit(
                    "step", learner=self.node.peer_id, step=lrn.steps, t0=t0, t1=t1, loss=res.loss
                )
                for p in due:  # a sharded unit's other ranks join each gather (Unit.after_step)
                    c = lrn.book.counters[p]
                    lrn.snapshot(p, (c.base_round, c.c_steps, c.c_tokens, lrn.steps, t1))
                    if self.node.blocking:
                        self.awaiting[p] = (c.base_round, lrn.book.step + lrn.pcfg.overlap)
                self._post_ready()  # on a GPU, those whose copy to the host is done; on the CPU, all
                if lrn.steps == first_step + 1:
                    self._align_schedule()
                elif not self.node.blocking and (lrn.steps - first_step) % PHASE_EVERY == 0:
                    self._keep_in_phase()
        except BaseException as e:  # noqa: BLE001 - reported by the agent, which stops the node
            logger.exception("learner thread failed")
            self.error = e
            self.node.request_stop("learner thread failed")
        finally:
            try:
                self._post_ready(wait=True)
            except Exception as e:  # noqa: BLE001 - the stop below must still reach the other ranks
                logger.warning("could not hand over the last contributions: %s", e)
            if unit is not None:
                try:
                    unit.exchange(lrn, STOP)
                except Exception as e:  # noqa: BLE001 - a rank already gone: its group is broken
                    logger.warning("could not tell the unit's other ranks to stop: %s", e)
                unit.close(lrn)
            self.idle.set()
