"""The node process's malloc heap (no torch, no package imports: it runs before them): one heap for every
thread (``one_arena``), and the allocator's thresholds (``tune_allocator``, ``steady_allocator``,
``release_free_memory``).

glibc gives threads heaps of their own ("arenas", up to 8 per core) as they first allocate. A node's learner
thread then allocates its gradients and activations in a secondary arena, made of 64 MiB heaps that glibc
unmaps as soon as one is wholly free, whatever ``M_TRIM_THRESHOLD`` says (the steady
allocator keeps only the main heap's top). Which arena the learner gets, and which agent threads share it,
depends on the order threads first allocate. Measured with two 85M nodes on 2 cores
(``bench/swarm_speed.py``): one learner took 154 page faults a second, the other 21,900 (its gradients'
heaps unmapped after each optimiser step and faulted in again by the next backward), and peak RSS was
9.2-9.7x the fp32 weights; with one arena, 331 and 961 faults a second and 8.35-8.5x.

Threads of the node take few, large allocations (tensors) and share that heap's lock: in the same bench the
learner thread's CPU a step stayed within the spread of the runs before (1.25-1.28 s against 1.25-1.33).
An explicit ``MALLOC_ARENA_MAX`` (or ``glibc.malloc.arena_max`` in ``GLIBC_TUNABLES``) wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_ARENA_MAX = -8  # glibc's mallopt parameter


def one_arena(env=os.environ) -> bool:
    """Have every thread of this process allocate from the main heap (glibc ``M_ARENA_MAX`` 1). Call it before
    any thread starts (an arena a thread already holds stays). False where nothing was changed: the setting
    was given in the environment, or this is not glibc."""
    if "MALLOC_ARENA_MAX" in env or "arena_max" in env.get("GLIBC_TUNABLES", ""):
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False


# glibc's mallopt parameter: allocations of at least this many bytes get pages of their own (mmap)
_M_MMAP_THRESHOLD = -3
# ``malloc_mmap_mib`` -1: this threshold for a model of at least this many parameters. At 124M (GPT-2 small,
# seq 128, batch 2) a step's activations are blocks of 0.75-1.5 MiB: in glibc's heaps they stay resident after
# the backward pass frees them, beside the gradients it makes; with pages of their own they are handed back.
# One node alone peaked at 3,584-3,588 MiB against 3,914-4,127 with 2 MiB; a step costs 1.046x (bench/allocator.py).
AUTO_MMAP_PARAMS = 100_000_000
AUTO_MMAP_MIB = 0.25


def mmap_threshold(setting_mib: float, numel: int) -> int:
    """The allocator threshold in bytes a node's ``malloc_mmap_mib`` asks for, given its model's size (0:
    leave the C library's rule)."""
    mib = (AUTO_MMAP_MIB if numel >= AUTO_MMAP_PARAMS else 0.0) if setting_mib < 0 else setting_mib
    return int(mib * (1 << 20))


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def tune_allocator(threshold: int) -> bool:
    """Give every allocation of ``threshold`` bytes or more pages of its own, returned to the system when it
    is freed (glibc's ``M_MMAP_THRESHOLD``). By default glibc raises that threshold to the size of each
    large block freed, up to 32 MiB, so a node's tensors (parameters, gradients, fragments, codec buffers)
    end up inside its heaps, and what a merge, an encoding or a step frees stays resident there. At 85M
    parameters, 2 MiB took one node's peak RSS from 9.1-9.3x to 8.4-8.5x the fp32 weights, and cost 4% of
    the learner's CPU per step in page faults (docs/benchmarks.md). An explicit ``MALLOC_MMAP_THRESHOLD_``
    in the environment wins. False where nothing was changed."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        return bool(_libc().mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


# glibc's mallopt parameter: free memory at the top of a heap beyond this many bytes is handed back
_M_TRIM_THRESHOLD = -1
# ``malloc_mmap_mib`` -1 below AUTO_MMAP_PARAMS (``steady_allocator``): blocks up to glibc's largest dynamic mmap
# threshold come from the heaps from the start, and this much free memory at a heap's top, as a multiple of
# the fp32 weights, is kept for the next step
STEADY_MMAP_BYTES = 32 << 20
STEADY_KEEP_X = 1.25
STEADY_KEEP_MIN = 64 << 20  # glibc's own largest trim threshold (twice its largest mmap threshold)


def steady_allocator(weights_bytes: int) -> bool:
    """Keep what a learner's step frees for its next step: blocks up to 32 MiB from the heaps (glibc's
    ``M_MMAP_THRESHOLD``, where its own rule ends up after the first large frees), and free memory at a
    heap's top up to 1.25x the fp32 weights not handed back (``M_TRIM_THRESHOLD``). The learner frees its
    gradients after the optimiser's step, so they do not sit beside the next forward's activations; with
    glibc's own rule that freed top was handed back and the next backward faulted it in again: at 85M
    parameters 51,600 page faults a step, a step 8% longer than a plain loop's (docs/benchmarks.md). Free
    memory is still handed back after evaluations and checkpoints (``release_free_memory``). An explicit
    ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` in the environment wins. False where nothing
    was changed."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    keep = max(STEADY_KEEP_MIN, int(STEADY_KEEP_X * weights_bytes))
    try:
        libc = _libc()
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, min(keep, 2**31 - 1))
        )
    except (OSError, AttributeError):
        return False


def release_free_memory() -> bool:
    """Hand the allocator's free pages back to the system (glibc's ``malloc_trim``): after a checkpoint or an
    evaluation the large temporaries they freed stay in the process's heaps otherwise, and count in its
    resident memory. False where the C library has no such call."""
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False
