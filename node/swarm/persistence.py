"""A node's files: checkpoints (periodic and at exit), resuming from one, ready.json and final.json.

``Node`` mixes this in; the state it reads and writes (replicas, heads, learner, counters) is the node's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
from pathlib import Path

from node.swarm.checkpoint import export_model, export_pretrained, load_latest, save_checkpoint
from protocol.synchroniser import SyncState

FIRST_CHECKPOINT_S = 10.0  # seconds from joining to the first periodic checkpoint

logger = logging.getLogger(__name__)


class Persistence:
    """Checkpoints and the files other tools read (``ddiloco up``, ``ddiloco status``, tests)."""

    async def _final_files(self) -> None:
        """At exit, once the learner has stopped: its last adoptions, a final evaluation, checkpoint and
        export (when the learner ran and did not fail), then final.json in any case."""
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
                params = {n: t for r in self.replicas for n, t in r.theta.items()}
                await asyncio.to_thread(export_model, out, params, {"model_hash": self.global_hash()})
                await asyncio.to_thread(export_pretrained, self.task, out, params)
            except Exception:  # noqa: BLE001 - the summary below must still be written
                logger.exception("final checkpoint or export failed")
                self.stop_reason += " (final checkpoint or export failed; see the log)"
        self._write_final()

    def _restore(self) -> bool:
        ck = load_latest(self.state_dir / "checkpoints", self.settings.swarm)
        if ck is None:
            return False
        meta = ck.meta
        if meta.get("peer_id") != self.peer_id:
            logger.warning(
                "checkpoint %s belongs to %s, not %s; ignored", ck.path, meta.get("peer_id"), self.peer_id
            )
            return False
        for p, rep in enumerate(self.replicas):
            r, h, n, w = meta["heads"][p]
            theta = {k: ck.tensors[f"theta/{p}/{k}"] for k in rep.theta}
            mom = {k: ck.tensors[f"mom/{p}/{k}"] for k in rep.theta}
            rep.load_state(int(r), theta, mom)
            if rep.hash != h:
                logger.warning("checkpoint %s: fragment %d does not land on its hash; ignored", ck.path, p)
                return False
            self.heads[p] = (int(r), h, int(n), float(w))
            self.syncs[p] = SyncState(fragment=p, global_round=int(r))
        self.merged_tokens = [int(x) for x in meta["merged_tokens"]]
        self.learner.load_state(ck.tensors, meta["learner"])
        self.learner.drop_unmerged()
        self.learner_loop.tokens = int(meta.get("tokens", 0))
        self.joined_by = f"checkpoint {ck.path.name}"
        logger.info("resumed from %s", ck.path)
        return True

    async def checkpoint(self) -> Path | None:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.learner_loop.is_alive():
            self.learner_loop.requests.append(("state", fut))
            try:
                ltensors, lmeta = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=60)
            except TimeoutError:
                logger.warning("checkpoint skipped: the learner did not hand over its state within 60 s")
                return None
        else:
            ltensors, lmeta = self.learner.state()
        tensors = dict(ltensors)
        for p, rep in enumerate(self.replicas):
            for k in rep.theta:
                tensors[f"theta/{p}/{k}"] = rep.theta[k]
                tensors[f"mom/{p}/{k}"] = rep.momentum[k]
        meta = {
            "peer_id": self.peer_id,
            "heads": [list(h) for h in self.heads],
            "learner": lmeta,
            # copies, taken with the heads and the replicas above: a record applied while the file is being
            # written must count in neither, or a restart applies it again and counts its tokens twice
            "merged_tokens": list(self.merged_tokens),
            "tokens": self.learner_loop.tokens,
        }
        path = await asyncio.to_thread(
            save_checkpoint,
            self.state_dir / "checkpoints",
            self.learner.steps,
            tensors,
            meta,
            self.settings.swarm,
        )
        self.counters["checkpoints"] += 1
        self.events.emit("checkpoint", t=time.time(), path=str(path), step=self.learner.steps)
        return path

    def _write_ready(self, name: str = "ready.json") -> None:
        doc = {
            "peer_id": self.peer_id,
            "maddrs": [f"{a}/p2p/{self.peer_id}" if "/p2p/" not in a else a for a in self._addrs],
            "status_url": self.status_server.url,
            "pid": os.getpid(),
        }
        tmp = self.state_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.state_dir / name)

    def _write_final(self) -> None:
        doc = {
            "peer_id": self.peer_id,
            "model_hash": self.global_hash(),
            "rounds_merged": self.rounds_merged(),
            "tokens_merged": self.tokens_merged(),
            "steps": self.learner.steps,
            "eval_loss": self.learner_loop.eval_loss,
            "stop_reason": self.stop_reason,
            "tokens": self.learner_loop.tokens,
            "unit": self.unit.status() if self.unit is not None else None,
        }
        (self.state_dir / "final.json").write_text(json.dumps(doc, indent=1))

    async def _checkpoint_loop(self) -> None:
        # The first soon after joining: a node killed before its first checkpoint restarts by downloading
        # the whole global state (theta and momentum, seconds over a slow link) instead of resuming from
        # its own state and catching up on the rounds it missed.
        wait = min(FIRST_CHECKPOINT_S, self.settings.checkpoint_every_s)
        while True:
            await asyncio.sleep(wait)
            wait = self.settings.checkpoint_every_s
            try:
                await self.checkpoint()
            except OSError as e:
                logger.error("checkpoint failed: %s", e)
