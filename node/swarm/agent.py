"""A swarm node: one learner plus its network agent (docs/design.md, section 4).

Threads and loops:
  * the DHT is hivemind's forked process (p2pd inside), created first, before any thread;
  * the learner trains in its own thread and never waits on the network: what it contributes goes into a
    queue, merged fragments come back through an inbox it drains between steps;
  * everything else runs on one asyncio loop (uvloop): membership heartbeats, the transport's ops, the
    synchroniser state machines, record application, catch-up, checkpoints and the HTTP status endpoint;
  * the periodic evaluation runs in a worker thread of that loop, on the replicas' tensors as they are.

Roles: every node keeps a replica of every global fragment. For fragment p the synchroniser of its open
round is the first of ``protocol.election.candidates`` over the eligible live members (a member that holds a
lease for the round — published in its membership record once it has begun collecting — keeps it). A learner
sends its contribution there; if that peer is dead or refuses the role it marks it suspect and tries the
next candidate, until ``failover_s``. The synchroniser merges with the pure state machine, applies its
record, and pushes the signed record to every reachable member; each applies it and checks the new hash.
Client-mode members are never pushed to or elected: they notice from the membership heads that a peer is
ahead and pull records (or a snapshot), as a node that missed a push does.
Two heads are ordered by ``protocol.election.head_key``; the losing side re-syncs from a winner."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dht.identity import Identity
from node.common.events import EventLog
from node.common.heap import release_free_memory
from node.common.lifetime import cancel_until_done
from node.common.priority import lower_network_priority, lower_own_thread_priority, paced_wait
from node.common.status_client import write_control_token
from node.learner.learner import Learner
from node.learner.loop import LearnerLoop
from node.learner.task import load_task
from node.learner.unit import Unit
from node.swarm.assembly import held_records, trust_policy, wire_running_parts
from node.swarm.catch_up import CatchUp
from node.swarm.clocks import SwarmClocks
from node.swarm.deadlines import MergeDeadlines
from node.swarm.dispatch import Dispatcher
from node.swarm.history import History
from node.swarm.intake import Intake
from node.swarm.metrics import NODE_COUNTERS
from node.swarm.persistence import Persistence
from node.swarm.record_push import RecordPush
from node.swarm.replication import Replication
from node.swarm.sender import Outbox, OwnCids, Sender
from node.swarm.server import StatusServer
from node.swarm.settings import NodeConfig, NodeSettings
from node.swarm.signed_files import SignedFiles
from node.swarm.status_p2p import StatusProtocol
from node.swarm.transport import Transport
from node.swarm.trust.audit import Auditor
from node.swarm.trust.fence import ElectionFence
from node.swarm.trust.held import HeldRecords
from node.swarm.trust.peer_scores import PeerScores
from node.swarm.trust.receipts import Receipts
from node.swarm.trust.vetting import SnapshotVetting
from node.swarm.trust.work_book import WorkBook
from node.swarm.view import SwarmView
from node.swarm.wire import SignedRecord
from protocol.agreement import AgreementBook
from protocol.config import TAPE_SETTINGS
from protocol.errors import RejectCode
from protocol.hashing import model_hash
from protocol.norms import NormBook
from protocol.replica import FragmentReplica
from protocol.synchroniser import SyncState
from protocol.systems import system_protocol

if TYPE_CHECKING:
    from dht.swarm import Membership

logger = logging.getLogger(__name__)
IMPORTED_AT = time.time()  # the start-up phase "imports" ends here (torch, hivemind and this package)


def process_start_time() -> float:
    """When this process started (wall clock), from /proc; now where /proc is not there."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


EVENTS_KEPT = 50_000  # event records held in memory (hours of a busy node); events.jsonl keeps them all
TASKS_STOP_S = 20.0  # how long a stopping node waits for its background tasks to end once cancelled
ALL_LEARNERS = 1 << 16  # the quorum of the baseline systems: every live learner
DHT_START_S = 60.0  # how long the DHT process and its p2p daemon may take to start (or rpc_timeout_s)


# ------------------------------------------------------------------------------------------- the node
class Node(Replication):
    def __init__(self, cfg: NodeConfig, unit: Unit | None = None) -> None:
        self.cfg = cfg
        self.unit = unit  # this node's learner spans a torch.distributed unit; this process is its rank 0
        self.settings = s = cfg.node
        # A baseline system is the same core with other settings (node.runner.system_protocol): every live
        # learner is the quorum (K above any swarm's size waits for min(K, live)), and the learners block.
        pcfg, self.blocking = system_protocol(s.system, cfg.protocol, ALL_LEARNERS, trusted=s.trusted)
        self.cfg = cfg = replace(cfg, protocol=pcfg)
        self.pcfg = pcfg
        self.state_dir = Path(s.state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        id_path = Path(s.identity) if s.identity else self.state_dir / "identity.key"
        self.identity = Identity.load_or_create(id_path)
        self.identity_path = id_path
        self.peer_id = self.identity.peer_id
        self.admission = None
        if s.authority:
            from dht.admission import Admission

            self.admission = Admission.from_settings(s)
            self.admission.check_own(self.peer_id)
        # The DHT process starts (p2pd, bootstrap) while this process builds the model and loads its state.
        self._dht_launch = self._launch_dht()
        try:
            self._init_rest(cfg, unit)
        except BaseException:
            self._dht_launch.dht.shutdown()
            raise

    def _launch_dht(self):
        """Fork the DHT process (before any thread starts: hivemind forks it); ``run`` waits for it."""
        from dht.launch import launch_dht

        s = self.settings
        if s.client_mode and s.announce_maddrs:
            logger.warning(
                "client_mode: announce_maddrs is ignored (the node accepts no inbound connections)"
            )
        return launch_dht(
            self.identity_path,
            [] if s.client_mode else NodeSettings.split(s.host_maddrs),
            NodeSettings.split(s.initial_peers),
            None if s.client_mode else (NodeSettings.split(s.announce_maddrs) or None),
            client_mode=s.client_mode,
            # its own daemons' start alone took over 30 s on a 2-core host busy training (a suite run)
            timeout_s=max(DHT_START_S, s.rpc_timeout_s),
            swarm=s.swarm,
            admission=self.admission,
        )

    def _init_rest(self, cfg: NodeConfig, unit: Unit | None) -> None:
        s = self.settings
        if s.threads > 0:
            # Before any torch work on this thread: the merges and hashes on the event loop must not run
            # (and leave spinning) a second OpenMP pool next to the learner's.
            torch.set_num_threads(s.threads)
        self.task = load_task(None, cfg.task_config())
        seed = (
            s.data_seed
            if s.data_seed >= 0
            else int.from_bytes(hashlib.sha256(self.peer_id.encode()).digest()[:4], "little")
        )
        self.learner = Learner(
            self.peer_id,
            self.task,
            self.pcfg,
            cfg.inner,
            s.steps,
            seed=seed,
            device=unit.model_device() if unit is not None else None,
        )
        self.plan = self.learner.plan
        # The swarm's size is not known up front: a quorum K above the live learners waits for min(K, live).
        self.cfg.protocol.check_swarm(max(1, self.pcfg.quorum), len(self.learner.params))
        self.spec = {
            f.index: {n: tuple(self.learner.tensor(n).shape) for n in f.names} for f in self.plan.fragments
        }
        self.shares = [f.numel / self.plan.total_numel for f in self.plan.fragments]
        base = self.learner.base
        P = len(self.plan.fragments)
        norms = NormBook()  # one robust-merge reference for all fragments; they start on the learner's bases
        self.replicas = [
            FragmentReplica(f.index, base[f.index], f.is_embedding, self.pcfg.history, norms, copy=False)
            for f in self.plan.fragments
        ]
        self.heads: list[tuple[int, str, int, float]] = [(0, r.hash, 0, 0.0) for r in self.replicas]
        self.merged_tokens = [0] * P
        self.logs: list[OrderedDict[int, SignedRecord]] = [OrderedDict() for _ in range(P)]
        self.signed_files = SignedFiles(self.state_dir / "records")  # the logs' signed bytes, on disk
        self.syncs = [SyncState(fragment=p) for p in range(P)]
        # each fragment's round clock, and when its open round is due on this node's loop (node.swarm.clocks)
        self.clocks = SwarmClocks(self.replicas, self.plan, self.syncs, lambda: self.loop.time())
        self.leases: dict[int, int] = {}
        self.last_contribution: dict[int, tuple] = {}  # fragment -> (header, encoded) last posted
        self.suspect: dict[str, float] = {}
        # records held for one more try (node.swarm.trust.held), made when the node runs: refused by the
        # election fence, and pushed out of turn while nobody is credited yet
        self.unelected_held: HeldRecords | None = None
        self.turn_held: HeldRecords | None = None
        self.evaluate_now: asyncio.Event | None = None  # set by POST /control "evaluate": the next one is now
        self.lagging_since: dict[int, float] = {}
        self.peer_scores = PeerScores(ban_after=s.ban_after, ban_s=s.ban_s)
        self.work = WorkBook()  # since when each learner's counters must fit (protocol.work)
        self.agreement = (
            AgreementBook()
        )  # learners whose outer gradients oppose the rest (protocol.agreement)
        self.syncing: set[int] = set()
        self._tasks: set[asyncio.Task] = set()
        self.events = EventLog(self.state_dir / "events.jsonl", flush=True, append=True, keep=EVENTS_KEPT)
        self.counters = dict.fromkeys(NODE_COUNTERS, 0)  # node.swarm.metrics
        self.own_cids = OwnCids(self.peer_id)  # what this node sent, to refute records that claim otherwise
        self.outbox = Outbox(self.own_cids, self.last_contribution)  # from the learner thread to the sender
        self.joining = False  # no heads published until this node has a state (``_enter``)
        self.learner_loop = LearnerLoop(self, self.learner)
        # its view of the swarm: members, heads, election (node.swarm.view)
        self.view = SwarmView(
            s,
            self.pcfg,
            self.peer_id,
            self.admission,
            self.replicas,
            self.heads,
            self.logs,
            self.leases,
            self.syncs,
            self.suspect,
            self.peer_scores,
            self.work,
            self.agreement,
            self.learner,
            self.learner_loop,
            self.events,
            joining=lambda: self.joining,
            renounced=lambda: self.receipts.renounced_now(),
            decide=self.decide,
            spawn=self.spawn,
            request_stop=self.request_stop,
        )
        # whom a record's signer could be, and the election fence (node.swarm.trust.fence)
        self.fence = ElectionFence(
            s, self.peer_id, self.admission, self.work, self.syncs, self.own_cids, self.view
        )
        # the audits this node makes, and the convictions it hands on (node.swarm.trust.audit)
        self.auditor = Auditor(
            s,
            self.pcfg,
            self.peer_id,
            self.spec,
            self.plan.total_numel,
            self.replicas,
            self.logs,
            self.heads,
            self.signed_files,
            self.peer_scores,
            self.suspect,
            self.counters,
            self.events,
            self.learner_loop,
            call=lambda peer, op, body: self.transport.call(peer, op, body),
            live_members=self.view.live_members,
            learner_only=self.view.learner_only,
            agreed=lambda rec, cosines: self.trust.agreed(rec, cosines),
            reset_sync=self.reset_sync,
            spawn=self.spawn,
        )
        # the receipts this node gives as a synchroniser and checks as a sender (node.swarm.trust.receipts)
        self.receipts = Receipts(
            s,
            self.identity,
            self.state_dir,
            self.replicas,
            self.syncs,
            self.spec,
            self.peer_scores,
            self.suspect,
            self.counters,
            self.events,
            self.last_contribution,
            self.outbox.send_again,
            self.reset_sync,
            self.auditor.ban_and_hand_on,
        )
        # what the accepting, merging and applying paths ask of trust (node.swarm.trust.policy)
        self.trust = trust_policy(self)  # node.swarm.assembly
        self.started_at = time.time()
        t0 = process_start_time()
        self.startup: dict[str, float] = {
            "imports": round(IMPORTED_AT - t0, 3),
            "init": round(self.started_at - t0, 3),
        }
        self.joined_by = "fresh"
        self.stop_reason = ""
        self.dht = None
        # made when the node runs (``_main``), on its event loop
        self.membership: Membership | None = None
        self.status_p2p: StatusProtocol | None = None
        self.status_server: StatusServer | None = None
        self.transport: Transport | None = None
        self.record_push: RecordPush | None = None  # new records to the members that need them first
        self.deadlines: MergeDeadlines | None = None  # the rounds that took our contributions
        self.vetting: SnapshotVetting | None = None  # whether a donor's head and snapshot are to be believed
        self.catch_up: CatchUp | None = None  # joining, and following heads that beat ours
        self.intake: Intake | None = None  # contributions taken as a synchroniser
        self.sender: Sender | None = None  # our contributions routed to their synchronisers
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        # its checkpoints, the state it resumes from, and the files other tools read (node.swarm.persistence)
        self.persistence = Persistence(
            s,
            self.state_dir,
            self.peer_id,
            self.unit,
            self.task,
            self.plan,
            self.learner,
            self.learner_loop,
            self.replicas,
            self.heads,
            self.syncs,
            self.merged_tokens,
            self.work,
            self.counters,
            self.events,
            self.view.logged_learners,
            self.global_hash,
            self.rounds_merged,
            self.tokens_merged,
        )
        restored = self.persistence.restore()  # the checkpoint's file name, or None
        self._restored = restored is not None
        if restored is not None:
            self.joined_by = f"checkpoint {restored}"
        self._phase("restore")

    def _phase(self, name: str) -> None:
        """Seconds from the process start to the end of a start-up phase (in the ``join`` record)."""
        self.startup[name] = round(time.time() - process_start_time(), 3)

    # ---------------------------------------------------------------- derived views
    def global_hash(self) -> str:
        return model_hash([r.hash for r in self.replicas])

    def rounds_merged(self) -> int:
        return sum(r.round for r in self.replicas)

    def tokens_merged(self) -> float:
        return sum(t * s for t, s in zip(self.merged_tokens, self.shares))

    def penalise(self, peer: str, code: RejectCode, signed: bool = False) -> None:
        """Score a refused request against ``peer`` (``PeerScores``); a ban it brings is an event."""
        if self.peer_scores.penalise(peer, code, time.monotonic(), signed):
            self.events.emit("ban", t=time.time(), peer=peer, seconds=self.peer_scores.ban_s, last=code.value)

    # ---------------------------------------------------------------- lifecycle
    def request_stop(self, why: str) -> None:
        if self.loop is not None and self._stop is not None:
            self.stop_reason = self.stop_reason or why
            self.loop.call_soon_threadsafe(self._stop.set)

    def run(self) -> int:
        """Wait for the DHT launched in ``__init__``, then run the loop until stopped."""
        self.dht = self._dht_launch.wait()
        self._phase("dht")
        try:
            import uvloop

            return uvloop.run(self._main())
        finally:
            self.dht.shutdown()

    async def _main(self) -> int:
        from dht.swarm import Membership

        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.evaluate_now = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread (tests)
                self.loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        s = self.settings
        self.deadlines = MergeDeadlines(
            s,
            self.pcfg,
            self.replicas,
            self.clocks,
            self.loop,
            self.peer_scores,
            self.suspect,
            self.counters,
            self.events,
            self.view.live_members,
            self.view.rounds_behind,
            self.receipts.watched_round,
            self.receipts.check_omission,
            self.outbox.send_again,
            lambda peer, n: self.transport.link_s(peer, n) if self.transport is not None else 0.0,
        )
        addrs = [] if s.client_mode else [str(a) for a in self.dht.get_visible_maddrs()]
        self.turn_held, self.unelected_held = held_records(self)  # node.swarm.assembly
        self.membership = Membership(
            self.dht, s.swarm, self.identity, timeout_s=s.rpc_timeout_s, admission=self.admission
        )
        p2p = await self.dht.replicate_p2p()
        handlers = wire_running_parts(self, p2p, addrs)  # node.swarm.assembly
        Dispatcher(self.view.known, self.penalise, handlers).register(self.transport)
        await self.transport.start()
        self.status_p2p = StatusProtocol(self, p2p)  # ddiloco status --peer, through libp2p
        await self.status_p2p.start()
        self._phase("transport")
        history = History(self.learner.tokens_per_step)  # the dashboard's curves, fed by the events
        self.status_server = StatusServer(self, write_control_token(self.state_dir), history=history)
        self.events.subscribe(history.on_event)
        self.events.subscribe(self.status_server.on_event)  # metrics, and the cached document marked stale
        await self.status_server.start(s.status_host, s.status_port)
        # where ddiloco doctor finds a node that is still joining
        self.persistence.write_ready(addrs, self.status_server.url, "starting.json")
        self.outbox.start(self.loop)
        try:
            if not await self._until_stopped(self._enter()):
                logger.info("stopping before it joined: %s", self.stop_reason)
                return 0
            self.learner_loop.start()
            if s.agent_nice > 0:
                n = lower_network_priority(s.agent_nice, keep={self.learner_loop.native_id})
                logger.info(
                    "network side niced by %d (%d threads); the learner keeps its priority", s.agent_nice, n
                )
            self.persistence.write_ready(addrs, self.status_server.url)
            self.spawn(self.view.heartbeat_loop())
            self.spawn(self.outbox.drain(self.sender.send, self.spawn))
            self.spawn(self._eval_loop())
            if s.checkpoint_every_s > 0:
                self.spawn(self.persistence.checkpoint_loop())
            if s.duration > 0:
                self.loop.call_later(s.duration, self.request_stop, f"duration {s.duration:g}s reached")
            await self._stop.wait()
            logger.info("stopping: %s", self.stop_reason)
        finally:
            await self._shutdown()
        return 1 if self.learner_loop.error is not None else 0

    async def _enter(self) -> None:
        """Into the swarm: its record published, then the state it trains from (downloaded, or caught up
        from its checkpoint's rounds)."""
        # A node with no state publishes no heads until it has one (``SwarmView.self_member``): set before
        # its first heartbeat.
        self.joining = not self._restored
        await self.view.heartbeat()
        self._phase("membership")
        if not self._restored:
            try:
                self.joined_by = await self.catch_up.join() or self.joined_by
            finally:
                self.joining = False
        else:
            await self.catch_up.catch_up_restored()
        self._phase("state")
        self.events.emit(
            "join",
            t=time.time(),
            learner=self.peer_id,
            how=self.joined_by,
            rounds=[r.round for r in self.replicas],
            startup=self.startup,
            credited=len(self.work.credited_tags),  # learners credited by its checkpoint or snapshot (elect)
            swarm=self.settings.swarm,
            settings=self.tape_settings(),
        )

    def tape_settings(self) -> dict:
        """What ``ddiloco replay`` needs to re-decide this node's rounds: the schedule and quorum rules, the
        codecs, and how long a silent member stays live."""
        p, s = self.pcfg, self.settings
        return {
            **{k: getattr(p, k) for k in TAPE_SETTINGS},
            "fragments": len(self.shares),
            "system": s.system,
            "ttl_s": s.ttl_s,
            "heartbeat_s": s.heartbeat_s,
        }

    async def _until_stopped(self, work) -> bool:
        """Run ``work`` unless a stop is asked for first: then it is cancelled and False returned. A stop asked
        for while joining waited for the join's own deadlines (a download from a donor that never answers
        held the node for its whole ``rpc_timeout_s``); nothing of a join is kept that a stop cuts short (no
        learner ran, so no checkpoint is written)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if task.cancelled():
            return False
        task.result()  # its error, if it failed
        return True

    async def _shutdown(self) -> None:
        ll = self.learner_loop
        ll.stop_flag.set()
        if ll.is_alive():
            await asyncio.to_thread(ll.join, 120)
        await cancel_until_done(self._tasks, TASKS_STOP_S)
        try:
            if not await self.persistence.save_final():
                self.stop_reason += " (final checkpoint or export failed; see the log)"
            self.persistence.write_final(self.stop_reason)
        finally:
            self.events.emit(
                "run",
                t0=self.started_at,
                t1=time.time(),
                learners=[self.peer_id],
                shares=self.shares,
                overlap=self.pcfg.overlap,
                system="decoupled",
            )
            self.events.close()
            with contextlib.suppress(Exception):
                await self.status_server.stop()
            with contextlib.suppress(Exception):
                await self.status_p2p.stop()
            if self.transport is not None:
                with contextlib.suppress(Exception):
                    await self.transport.stop()
                with contextlib.suppress(Exception):
                    await self.transport.p2p.shutdown()

    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)

        def done(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                logger.error("task failed: %r", task.exception(), exc_info=task.exception())

        t.add_done_callback(done)
        return t

    # ---------------------------------------------------------------- background loops
    async def _eval_loop(self) -> None:
        """Evaluate the global model now and every ``eval_every_s``, from the replicas' tensors as they
        are when taken on this loop (a merge makes new ones, never writes to these), in a thread of its own
        niced as the learner is (``learner_nice``): the learner never pauses for it. (At the default priority
        an evaluation took the CPU from the niced learner and stretched its steps 2-4x in a parity run; at
        nice 19 it starved and the learners made 7% fewer steps.)"""
        s, nice = self.settings, self.settings.learner_nice
        pool = ThreadPoolExecutor(1, "eval", initializer=lower_own_thread_priority, initargs=(nice,))
        loop = asyncio.get_running_loop()
        try:
            while True:
                params = {n: t for r in self.replicas for n, t in r.theta.items()}  # cuts stay cut
                await loop.run_in_executor(pool, self.learner_loop.evaluate, params, time.time())
                del params
                await loop.run_in_executor(pool, release_free_memory)
                wait_s = paced_wait(s.eval_every_s, self.learner_loop.eval_cpu_s, s.eval_cpu_share)
                with contextlib.suppress(TimeoutError):  # or sooner, when asked (POST /control "evaluate")
                    await asyncio.wait_for(self.evaluate_now.wait(), wait_s)
                self.evaluate_now.clear()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
