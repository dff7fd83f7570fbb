"""A checkpoint that fails (a full disk) keeps nothing alive: its error's traceback held the frames that laid
the file out, and through them every replica tensor of that moment, in a cycle with the future that carried
it; left to Python's cyclic collector, a 124M node whose disk was full grew by ~300 MB a minute."""

from __future__ import annotations

import asyncio
import collections
import errno
import gc
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch

from node.learner.loop import LearnerLoop
from node.swarm import persistence
from node.swarm.checkpoint import PendingCheckpoint
from node.swarm.persistence import Persistence
from node.swarm.trust.work_book import WorkBook


class _Loop:
    """The learner's side of a checkpoint request: answered on another thread, as between two steps."""

    def __init__(self, learner) -> None:
        self.learner, self.requests, self.tokens = learner, collections.deque(), 0
        self.node = SimpleNamespace(unit=None)

    def is_alive(self) -> bool:
        return True

    def answer(self) -> None:
        asks = []
        while self.requests:
            fn, fut = self.requests.popleft()
            if fut.set_running_or_notify_cancel():
                asks.append((fn, fut))
        LearnerLoop._answer(self, asks)


def _persistence(tmp_path, alive: bool) -> Persistence:
    """A node's checkpoints over one fragment's replica and a learner that lays its state out as between two
    steps (``alive``) or is stopped; nothing else of a node (no task, no plan: no export here)."""
    replicas = [
        SimpleNamespace(theta={"w": torch.randn(256, 256)}, momentum={"w": torch.zeros(256, 256)}, lent=0)
    ]
    lstate = ({"param/w": torch.randn(64)}, {"steps": 3})
    learner = SimpleNamespace(state=lambda full=None, copy=False: lstate, sharded=False)
    loop = _Loop(learner) if alive else SimpleNamespace(is_alive=lambda: False, tokens=0)
    return Persistence(
        SimpleNamespace(swarm="s"),
        tmp_path,
        "me",
        None,
        None,
        None,
        learner,
        loop,
        replicas,
        [(0, "h", 0, 0.0)],
        [],
        [0],
        WorkBook(),
        {"checkpoints": 0},
        SimpleNamespace(emit=lambda *a, **k: None),
        lambda: set(),  # no records logged: no learner credited by them
        lambda: "h",
        lambda: 0,
        lambda: 0.0,
    )


@pytest.mark.parametrize("alive", [True, False])
def test_a_checkpoint_that_fails_on_a_full_disk_holds_no_tensor_after(tmp_path, monkeypatch, alive):
    def full(self, tensors):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PendingCheckpoint, "write", full)
    node = _persistence(tmp_path, alive)
    old = weakref.ref(node.replicas[0].theta["w"])
    logged = []
    monkeypatch.setattr(persistence.logger, "error", lambda msg, *a: logged.append(msg % a))
    answering = []

    async def main():
        node.settings.checkpoint_every_s, node.settings.checkpoint_cpu_share = 0.01, 0.0
        task = asyncio.ensure_future(node.checkpoint_loop())
        if alive:
            while not node.learner_loop.requests:
                await asyncio.sleep(0.01)
            answering.append(threading.Thread(target=node.learner_loop.answer))
            answering[0].start()
        while not logged:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    gc.disable()
    try:
        monkeypatch.setattr(persistence, "FIRST_CHECKPOINT_S", 0.0)
        asyncio.run(main())
        for th in answering:  # the learner's side of the exchange has let go of what it handed over
            th.join(30)
        node.replicas[0].theta = {"w": torch.randn(256, 256)}  # a record moved the replica on
        assert "No space left on device" in logged[0]
        assert old() is None, "a failed checkpoint still holds the replica's tensors (reference cycle)"
    finally:
        gc.enable()
