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


async def cancel_until_done(tasks, deadline_s: float, again_s: float = 0.5) -> set:
    """Cancel ``tasks`` (asyncio tasks) and wait until all have ended, cancelling those still running again
    every ``again_s``: one cancel can be lost. (Python 3.11's ``asyncio.wait_for`` returns its result when
    the cancel arrives as the awaited future completes; a node's checkpoint loop swallowed its cancel that
    way and its node never exited.) Returns the tasks still running at ``deadline_s``, which it logs."""
    import asyncio

    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    pending = {t for t in tasks if not t.done()}
    tries = 0
    while pending and loop.time() < end:
        if tries:
            logger.info("cancelling again (try %d): %s", tries + 1, ", ".join(map(repr, pending)))
        for t in pending:
            t.cancel()
        tries += 1
        _, pending = await asyncio.wait(pending, timeout=min(again_s, max(0.0, end - loop.time())))
    for t in pending:
        logger.warning("task %r did not end within %g s of its cancel; left behind", t, deadline_s)
    return pending


def exit_without_teardown(code: int | None) -> None:
    """End this process with ``code`` once its work is done and written: the exit handlers run, buffered output
    is flushed, and the interpreter's teardown is skipped. That teardown collects and frees every object of
    torch, hivemind and the node (some 325,000 in a tiny node), 10-20 s of a stop on a loaded 2-core machine
    after the node itself had stopped in under a second. ``code`` as ``sys.exit`` takes it (None: 0)."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its pipe gone
            pass
    os._exit(0 if code is None else int(code))
