"""A node's files: checkpoints (periodic and at exit), resuming from one, ready.json and final.json.

``Persistence`` is a part the node owns (``Node.persistence``): the node restores from it when it is made,
runs its checkpoint loop, and has it write its files when it is ready and when it stops. The state it
writes and restores (replicas, heads, the learner's) is the node's, handed to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from node.common.heap import release_free_memory
from node.common.priority import paced_wait
from node.swarm.checkpoint import PendingCheckpoint, export_model, export_pretrained, load_latest
from node.swarm.memory import momentum_lent
from node.swarm.wire import SNAPSHOT_IDS_MAX
from protocol.synchroniser import SyncState

if TYPE_CHECKING:
    from node.common.events import EventLog
    from node.learner.learner import Learner
    from node.learner.loop import LearnerLoop
    from node.learner.unit import Unit
    from node.swarm.settings import NodeSettings
    from node.swarm.trust.work_book import WorkBook
    from protocol.fragments import FragmentPlan
    from protocol.replica import FragmentReplica

FIRST_CHECKPOINT_S = 10.0  # seconds from joining to the first periodic checkpoint

logger = logging.getLogger(__name__)


def _abandon_late(fut: concurrent.futures.Future) -> None:
    """A checkpoint the learner laid out after its node stopped waiting: its file is removed."""
    if not fut.cancelled() and fut.exception() is None:
        fut.result()[0].abandon()


class Persistence:
    """Checkpoints and the files other tools read (``ddiloco up``, ``ddiloco status``, tests).

    Its collaborators: the node's settings (``swarm``, ``export``, ``checkpoint_every_s``,
    ``checkpoint_cpu_share``), state folder, peer id and unit (or None); the task and fragment plan (the
    exported model); the learner and its loop (whose state a checkpoint holds, and which lays it out); the
    node's ``replicas``, ``heads``, ``syncs`` and ``merged_tokens`` (one entry per fragment, replaced in
    place: a restore writes them) and its ``WorkBook`` (the learners credited); ``counters`` and ``events``,
    which it writes to; and of the node, ``logged_learners`` (the learners its logs name), ``global_hash``,
    ``rounds_merged`` and ``tokens_merged``."""

    def __init__(
        self,
        settings: NodeSettings,
        state_dir: Path,
        peer_id: str,
        unit: Unit | None,
        task,
        plan: FragmentPlan,
        learner: Learner,
        learner_loop: LearnerLoop,
        replicas: Sequence[FragmentReplica],
        heads: list[tuple],
        syncs: list[SyncState],
        merged_tokens: list[int],
        work: WorkBook,
        counters: dict[str, int],
        events: EventLog,
        logged_learners: Callable[[], set[str]],
        global_hash: Callable[[], str],
        rounds_merged: Callable[[], int],
        tokens_merged: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.state_dir = state_dir
        self.peer_id = peer_id
        self.unit = unit
        self.task = task
        self.plan = plan
        self.learner = learner
        self.learner_loop = learner_loop
        self.replicas = replicas
        self.heads = heads
        self.syncs = syncs
        self.merged_tokens = merged_tokens
        self.work = work
        self.counters = counters
        self.events = events
        self.logged_learners = logged_learners
        self.global_hash = global_hash
        self.rounds_merged = rounds_merged
        self.tokens_merged = tokens_merged
        self.checkpoint_cpu_s = 0.0  # CPU seconds the last checkpoint took (laying out, writing, hashing)

    async def save_final(self) -> bool:
        """At exit, once the learner has stopped: its last adoptions, a final evaluation, checkpoint and
        export (when the learner ran and did not fail). False: the checkpoint or the export failed (the
        node's final.json, ``write_final``, says so)."""
        ll = self.learner_loop
        if ll.ident is not None and ll.error is None:
            try:
                ll._service()  # adopt what arrived, so the exported model is this node's newest view
                await asyncio.to_thread(ll.evaluate)
                await self.checkpoint()
                out = (
                    Path(self.settings.export)
                    if self.settings.export
                    else self.state_dir / "model.safetensors"
                )
                params = self.plan.whole({n: t for r in self.replicas for n, t in r.theta.items()})
                await asyncio.to_thread(export_model, out, params, {"model_hash": self.global_hash()})
                await asyncio.to_thread(export_pretrained, self.task, out, params)
            except Exception:  # noqa: BLE001 - the summary below must still be written
                logger.exception("final checkpoint or export failed")
                return False
        return True

    def restore(self) -> str | None:
        """Resume from the newest checkpoint of this node in its state folder: the checkpoint's file name, or
        None (none, another node's, or one whose fragments do not land on their hashes)."""
        ck = load_latest(self.state_dir / "checkpoints", self.settings.swarm)
        if ck is None:
            return None
        meta = ck.meta
        if meta.get("peer_id") != self.peer_id:
            logger.warning(
                "checkpoint %s belongs to %s, not %s; ignored", ck.path, meta.get("peer_id"), self.peer_id
            )
            return None
        for p, rep in enumerate(self.replicas):
            r, h, n, w = meta["heads"][p]
            theta = {k: ck.tensors[f"theta/{p}/{k}"] for k in rep.theta}
            mom = {k: ck.tensors[f"mom/{p}/{k}"] for k in rep.theta}
            rep.load_state(int(r), theta, mom)
            if rep.hash != h:
                logger.warning("checkpoint %s: fragment %d does not land on its hash; ignored", ck.path, p)
                return None
            self.heads[p] = (int(r), h, int(n), float(w))
            self.syncs[p] = SyncState(fragment=p, global_round=int(r))
        self.merged_tokens[:] = [int(x) for x in meta["merged_tokens"]]
        credited = meta.get("credited", [])  # absent in an older node's checkpoint
        if isinstance(credited, list):
            self.work.settle(tags=[q for q in credited[-SNAPSHOT_IDS_MAX:] if isinstance(q, str) and q])
        self.learner.load_state(ck.tensors, meta["learner"])
        self.learner.drop_unmerged()
        self.learner_loop.tokens = int(meta.get("tokens", 0))
        logger.info("resumed from %s", ck.path)
        return ck.path.name

    async def checkpoint(self) -> Path | None:
        """Write a checkpoint with no copy of the model made for it (``PendingCheckpoint``): the learner
        writes its live parameters and optimizer state into the file between two steps; the replicas,
        bases and the rest are written from a worker thread, then the file is hashed and renamed. The
        replicas' momentum is lent to the writer until then: records step it into new tensors meanwhile."""
        with momentum_lent(self.replicas):
            return await self._checkpoint()

    async def _checkpoint(self) -> Path | None:
        # taken together on this loop, where records change them: a record applied while the file is being
        # written must count in neither, or a restart applies it again and counts its tokens twice
        fixed = {}
        for p, rep in enumerate(self.replicas):
            for k in rep.theta:
                fixed[f"theta/{p}/{k}"] = rep.theta[k]
                fixed[f"mom/{p}/{k}"] = rep.momentum[k]
        shared = {"peer_id": self.peer_id, "heads": [list(h) for h in self.heads]}
        shared["merged_tokens"] = list(self.merged_tokens)
        # whom a public swarm elects (node.swarm.view): a node back from a restart, caught up by records,
        # otherwise knew only the workers credited since, and elected past a worker that had paused
        shared["credited"] = list(self.work.credited(self.logged_learners(), SNAPSHOT_IDS_MAX))
        folder, swarm = self.state_dir / "checkpoints", self.settings.swarm

        cpu = [0.0, 0.0]  # CPU seconds of the thread that lays it out, and of the one that finishes it

        def lay_out(ltensors: dict, lmeta: dict) -> tuple[PendingCheckpoint, dict]:
            # on the learner's thread (or with the learner stopped): its live tensors go to the file now
            t0 = time.thread_time()
            meta = {**shared, "learner": lmeta, "tokens": self.learner_loop.tokens}
            pending = PendingCheckpoint(folder, int(lmeta["steps"]), {**ltensors, **fixed}, meta, swarm)
            rest = dict(fixed)
            try:
                live = {}
                for k, t in ltensors.items():
                    (rest if k.startswith("base/") or k == "gen" else live)[k] = t
                pending.write(live)
            except BaseException:
                pending.abandon()
                raise
            cpu[0] = time.thread_time() - t0
            return pending, rest

        if self.learner_loop.is_alive():
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self.learner_loop.requests.append((lay_out, fut))
            try:
                pending, rest = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=60)
            except TimeoutError:
                # the learner may still lay it out later: drop that file then
                fut.add_done_callback(_abandon_late)
                logger.warning("checkpoint skipped: the learner did not hand over its state within 60 s")
                return None
        else:
            pending, rest = await asyncio.to_thread(lambda: lay_out(*self.learner.state(copy=False)))

        def finish() -> Path:
            t0 = time.thread_time()
            try:
                pending.write(rest)
                return pending.finish()
            except BaseException:
                pending.abandon()
                raise
            finally:
                cpu[1] = time.thread_time() - t0

        path = await asyncio.to_thread(finish)
        await asyncio.to_thread(release_free_memory)
        self.counters["checkpoints"] += 1
        self.checkpoint_cpu_s = sum(cpu)
        self.events.emit(
            "checkpoint",
            t=time.time(),
            path=str(path),
            step=pending.step,
            cpu_s=round(self.checkpoint_cpu_s, 3),
        )
        return path

    def write_ready(self, addrs: list[str], status_url: str, name: str = "ready.json") -> None:
        """Where other tools find this node: its multiaddrs (``addrs``) and status endpoint, in ``name``."""
        doc = {
            "peer_id": self.peer_id,
            "maddrs": [f"{a}/p2p/{self.peer_id}" if "/p2p/" not in a else a for a in addrs],
            "status_url": status_url,
            "pid": os.getpid(),
        }
        tmp = self.state_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.state_dir / name)

    def write_final(self, stop_reason: str) -> None:
        """final.json: what this node ended on, and why it stopped."""
        doc = {
            "peer_id": self.peer_id,
            "model_hash": self.global_hash(),
            "rounds_merged": self.rounds_merged(),
            "tokens_merged": self.tokens_merged(),
            "steps": self.learner.steps,
            "eval_loss": self.learner_loop.eval_loss,
            "stop_reason": stop_reason,
            "tokens": self.learner_loop.tokens,
            "unit": self.unit.status() if self.unit is not None else None,
        }
        (self.state_dir / "final.json").write_text(json.dumps(doc, indent=1))

    async def checkpoint_loop(self) -> None:
        # The first soon after joining: a node killed before its first checkpoint restarts by downloading
        # the whole global state (theta and momentum, seconds over a slow link) instead of resuming from
        # its own state and catching up on the rounds it missed.
        wait = min(FIRST_CHECKPOINT_S, self.settings.checkpoint_every_s)
        while True:
            await asyncio.sleep(wait)
            try:
                await self.checkpoint()
            except OSError as e:
                logger.error("checkpoint failed: %s", e)
                # Its traceback holds the frames that laid the file out, and through them every replica
                # tensor of that moment, in a cycle with the future that carried it from the learner's
                # thread: left to the cyclic collector, a 124M node on a full disk grew ~300 MB a minute.
                e.with_traceback(None)
            wait = paced_wait(
                self.settings.checkpoint_every_s, self.checkpoint_cpu_s, self.settings.checkpoint_cpu_share
            )
