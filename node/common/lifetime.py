"""A process that must not outlive the one that started it (no torch, no package imports: it runs first)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)
# The process that started this one, read when this module is first imported: ``python -m node`` imports it
# before anything else. Read later (once the node's heartbeats began), a launcher killed during the seconds of
# imports and start-up was never noticed: its nodes, orphaned, trained on for minutes.
_PARENT = os.getppid()


def parent_gone() -> bool:
    """Whether the process that started this one has died since it started (this one was handed on)."""
    return os.getppid() != _PARENT


def die_with_parent() -> bool:
    """Linux: have the kernel SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``). False where
    the call is not available (the process then ends when its unit's collectives fail)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(1, 9) == 0  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        logger.debug("no PR_SET_PDEATHSIG here")
        return False


def started_by_torchrun(env=os.environ) -> bool:
    """Whether this process is one rank of a multi-process learner unit that torchrun started."""
    return int(env.get("WORLD_SIZE", "1") or 1) > 1 and bool(env.get("RANK"))
