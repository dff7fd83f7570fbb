"""One malloc heap for the whole node process (no torch, no package imports: it runs before them).

glibc gives threads heaps of their own ("arenas", up to 8 per core) as they first allocate. A node's learner
thread then allocates its gradients and activations in a secondary arena, made of 64 MiB heaps that glibc
unmaps as soon as one is wholly free, whatever ``M_TRIM_THRESHOLD`` says (``node.swarm.memory``'s steady
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
