"""CPU priority between a node's learner and its network side (``[node] agent_nice``, ``learner_nice``).

On a machine whose cores the learners fill (CPU learners, or several nodes on one host), the network side —
the event loop, the DHT process and its p2pd — competes with the learner for the same cores. It needs
little CPU (a few percent) but at any moment, so it runs at a higher niceness: the kernel still runs it
whenever it is ready, yet gives the learner the larger share when both want a core. Linux sets niceness per
thread, and threads inherit it from the thread that creates them, so this is applied after the learner
thread has started, to every other thread of the node process and to every thread of its child processes.

``learner_nice`` is the other way round, for several nodes sharing one host (a local swarm, the chaos
harness): the learner thread alone is niced, so each node's start-up and network side run before the other
nodes' learners, as they would on hosts of their own. A restarting node's imports and model build then take
about the time they take on an idle host rather than three to four times as long.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)


def process_tree(pid: int) -> list[int]:
    """pid and every process below it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parents.items() if pp == p]
    return out


def lower_network_priority(increment: int, keep: set[int]) -> int:
    """Add ``increment`` to the niceness of every thread of this process and its descendants, except the
    native thread ids in ``keep``. Returns how many threads were changed; Linux only (0 elsewhere)."""
    if increment <= 0 or not os.path.isdir("/proc/self/task"):
        return 0
    changed = 0
    for pid in process_tree(os.getpid()):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            if tid in keep:
                continue
            try:
                os.setpriority(
                    os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
                )
                changed += 1
            except OSError as e:  # the thread ended meanwhile, or no permission
                logger.debug("niceness of thread %d not changed: %s", tid, e)
    return changed


def lower_own_thread_priority(increment: int) -> int:
    """Add ``increment`` to the niceness of the calling thread only. Returns the niceness added (0 when
    none was: increment 0, not Linux, or refused)."""
    if increment <= 0 or not os.path.isdir("/proc/self/task"):
        return 0
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, before + increment))
        return os.getpriority(os.PRIO_PROCESS, tid) - before
    except OSError as e:
        logger.warning("thread not niced: %s", e)
        return 0


def name_own_thread(name: str) -> bool:
    """Give the calling thread a name the OS shows (``top -H``, ``/proc/PID/task/TID/comm``, at most 15
    bytes on Linux), so its CPU time can be told from the rest of the process's. Returns whether it was set."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as fh:
            fh.write(name[:15])
        return True
    except OSError:
        return False


def paced_wait(period_s: float, cpu_s: float, share: float) -> float:
    """Seconds to wait before the next run of a periodic task beside the learner (a checkpoint, an
    evaluation): its period, or longer where the last run's CPU seconds over the period exceed ``share`` of
    one core. At 85M parameters a checkpoint writes and hashes 1.7 GB and an evaluation runs 8 forward
    passes: seconds of a core that the learners on the host would lose every period."""
    return max(period_s, cpu_s / share) if share > 0 else period_s
