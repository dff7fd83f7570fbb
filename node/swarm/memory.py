"""What a node holds in memory, by part
(docs/design.md, section 4, "What a node holds, and its cost").

``breakdown(node)`` walks the tensors of each part of a running node and counts every storage once, in the
first part that names it (a learner's base that is the replica's own tensor costs nothing of its own). It
sets the total against the process's resident memory (now and at its peak) and against the size of the
model's weights in fp32, so ``ddiloco status`` and ``/metrics`` can say "7.9x the weights, of which ...".

The parts, in the order they are counted:

- ``learner_params``, ``learner_grads``, ``optimizer``: the learner's own state, on its device;
- ``replica``, ``momentum``: the global fragments and their outer momentum;
- ``bases``: the global fragment each learner last received, where it is not the replica's tensor;
- ``history``: what re-anchors an old contribution and serves catch-up (the record log);
- ``snapshots``: contributions on their way from the learner to the host;
- ``carry``: contributions a carrying learner keeps until they merge;
- ``feedback``: what the contributions' codec dropped, owed to the next contribution (error feedback);
- ``eval``: the evaluation model's own tensors.

Whatever the process holds beyond these (the interpreter, torch's libraries, activations, the allocator's
free lists) is ``other``: resident memory less the host-side parts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from node.swarm.signed_files import in_memory

PARTS = (
    "learner_params",
    "learner_grads",
    "optimizer",
    "replica",
    "momentum",
    "bases",
    "history",
    "snapshots",
    "carry",
    "feedback",
    "eval",
)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``x`` (tensors, dicts, lists, tuples, nested)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in list(x.values()):
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in list(x):
            yield from _tensors(v)


def _storage(t: torch.Tensor) -> tuple[tuple[str, int], int, bool]:
    """(key of the storage, its bytes, on the host)."""
    if t.is_meta:
        return ("meta", id(t)), 0, True
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr()), s.nbytes(), t.device.type == "cpu"


class Tally:
    """Bytes by part, each storage counted once, host and device apart."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.host: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.device: dict[str, int] = dict.fromkeys(PARTS, 0)

    def add(self, part: str, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            key, nbytes, on_host = _storage(t)
            if key in self.seen or key[1] == 0:
                continue
            self.seen.add(key)
            (self.host if on_host else self.device)[part] += nbytes

    def size(self, part: str, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors by their shape and dtype, not their storage (tensors another thread owns)."""
        for t in tensors:
            n, on_host = _nbytes(t)
            (self.host if on_host else self.device)[part] += n


def _nbytes(t: torch.Tensor) -> tuple[int, bool]:
    return t.numel() * t.element_size(), t.device.type == "cpu"


def resident_bytes() -> tuple[int, int]:
    """(resident memory now, its peak) of this process, in bytes; (0, 0) where /proc cannot say."""
    try:
        with open(f"/proc/{os.getpid()}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0, 0


def _retry(fn, tries: int = 3):
    """Another thread may grow a dict while it is walked (the optimizer's state at its first step)."""
    for i in range(tries):
        try:
            return fn()
        except RuntimeError:
            if i == tries - 1:
                raise
    return None


def tally(node: Any) -> Tally:
    """Walk a running node's parts (``node.swarm.agent.Node``, or anything with the same attributes)."""
    t = Tally()
    lrn = node.learner
    # The learner's own state is sized from its tensors' shapes, never by touching their storage: it is
    # this thread reading tensors the learner's thread frees and makes (gradients every step), and a status
    # read that did so crashed a node (SIGSEGV in libtorch_python). Its gradients are counted as its
    # parameters' size: the step makes them, and they live until the next one.
    params = list(lrn.params.values())
    t.size("learner_params", params)
    t.size("learner_grads", params)
    t.size("optimizer", _retry(lambda: list(_tensors(list(lrn.opt.state.values())))))
    for r in node.replicas:
        t.add("replica", _tensors(r.theta))
    for r in node.replicas:
        t.add("momentum", _tensors(r.momentum))
    t.add("bases", _retry(lambda: list(_tensors(list(lrn.base)))))
    for r in node.replicas:
        t.add("history", _retry(lambda r=r: list(r.history_tensors())))
    t.size("snapshots", _retry(lambda: [x for s in list(lrn.snaps.pending) for x in _tensors(s.host)]))
    t.size("carry", _retry(lambda: list(_tensors(list(lrn.sent.values())))))
    held = getattr(lrn, "residual", {})  # per fragment, per tensor: its int8 wire form
    t.size(
        "feedback",
        _retry(lambda: [x for d in list(held.values()) for e in d.values() for x in e.parts.values()]),
    )
    ll = getattr(node, "learner_loop", None)
    if ll is not None:
        t.add("eval", _tensors(ll.eval_tensors()))
    return t


def breakdown(node: Any) -> dict:
    """The status document's ``memory`` section: bytes by part on the host (and on the learner's device,
    when it has one), the fp32 weights, resident memory now and at its peak, and their ratios."""
    t = tally(node)
    rss, peak = resident_bytes()
    # the record log keeps signed bytes only (node.swarm.replication), not tensors, and those on disk where
    # it can (node.swarm.signed_files)
    raw = sum(in_memory(sr.raw) for log in getattr(node, "logs", []) for sr in list(log.values()))
    host = dict(t.host)
    host["history"] += raw
    # signed contribution messages kept for audits (node.swarm.trust.audit_archive): in memory; the rest on disk
    host["audit_kept"] = node.auditor.archive.resident
    weights = 4 * node.plan.total_numel
    counted = sum(host.values())
    doc = {
        "weights_bytes": weights,
        "host": host,
        "host_counted": counted,
        "other": max(0, rss - counted) if rss else None,
        "rss": rss or None,
        "peak_rss": peak or None,
        "rss_x_weights": round(rss / weights, 2) if rss and weights else None,
        "peak_x_weights": round(peak / weights, 2) if peak and weights else None,
    }
    if any(t.device.values()):
        doc["device"] = dict(t.device)
    return doc


@contextmanager
def momentum_lent(replicas: Iterable[Any]) -> Iterator[None]:
    """While held, another thread may read these replicas' momentum tensors (a checkpoint's writer, a
    snapshot's encoder): a record applied meanwhile steps the momentum into new tensors. Otherwise a
    replica steps it in place, one fragment's size less at each record (``FragmentReplica.lent``)."""
    held = list(replicas)
    for rep in held:
        rep.lent += 1
    try:
        yield
    finally:
        for rep in held:
            rep.lent -= 1
