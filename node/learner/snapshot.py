"""Fragment snapshots: a due fragment's parameters copied to the host without stalling the next step.

A contribution is measured against the parameters of the step that made its fragment due. On a GPU the
copy to the host goes on a side stream: an event recorded on the compute stream after the step's optimizer
work (and, in a sharded unit, after the gather of the whole fragment) is what the copy waits for; the copy
lands in pinned host memory, and a second event says when it is done. The learner encodes the contribution
once that event has fired, so the next step's forward and backward run while the bytes move. Whatever
writes the parameters next (the next optimizer step, an adoption) first makes the compute stream wait for
the copies still reading them (``fence``): a wait on the GPU, never on the host.

On the CPU the same calls make a plain copy that is ready at once, so the tests run the same bookkeeping.
The CUDA branch has not been run here (no GPU on the machines this was written on).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class Snapshot:
    fragment: int
    host: dict[str, torch.Tensor]  # the parameters on the host, in their own dtype
    base: dict[str, torch.Tensor]  # the global fragment they are measured against, as it was at the step
    tag: object  # the caller's (counters, step) at the step
    done: object = None  # torch.cuda.Event of the copy; None: already on the host
    live: bool = False  # the copy reads the learner's own parameters (not a gathered copy)
    reads: list[torch.Tensor] = field(default_factory=list)  # device tensors kept alive until ``done``

    def ready(self) -> bool:
        return self.done is None or self.done.query()


class Snapshots:
    """Snapshots in flight, oldest first."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending: deque[Snapshot] = deque()

    def take(
        self, p: int, tensors: dict[str, torch.Tensor], base: dict[str, torch.Tensor], tag: object, live: bool
    ) -> None:
        """Start copying ``tensors`` (fragment p as of now) to the host. ``live``: they are the learner's
        parameters, which the next write must not touch before the copy has read them."""
        if self.stream is None:
            host = {n: (t.detach().clone() if live else t.detach()).to("cpu") for n, t in tensors.items()}
            self.pending.append(Snapshot(p, host, base, tag))
            return
        compute = torch.cuda.current_stream(self.device)
        after_step = compute.record_event()  # after the optimizer step (and the gather) queued so far
        self.stream.wait_event(after_step)
        host = {}
        with torch.cuda.stream(self.stream):
            for n, t in tensors.items():
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t.detach(), non_blocking=True)
                host[n] = h
        done = self.stream.record_event()
        self.pending.append(Snapshot(p, host, base, tag, done, live, list(tensors.values())))

    def fence(self) -> None:
        """Make the compute stream wait for every copy that still reads live parameters (no host wait)."""
        if self.stream is None:
            return
        compute = torch.cuda.current_stream(self.device)
        for s in self.pending:
            if s.live and s.done is not None:
                compute.wait_event(s.done)

    def collect(self, wait: bool = False) -> list[Snapshot]:
        """The snapshots whose copy is done (all of them with ``wait``), oldest first; the rest stay."""
        out, keep = [], deque()
        for s in self.pending:
            if wait and s.done is not None:
                s.done.synchronize()
            (out if s.ready() else keep).append(s)
        self.pending = keep
        for s in out:
            s.reads = []  # the copy has read them: the allocator may reuse their memory
        return out
