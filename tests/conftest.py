"""Shared fixtures: a tiny task that trains in milliseconds, and a reaper for stray child processes."""

from __future__ import annotations

import os
import signal
import tempfile

import pytest
import torch

from node.learner.model import ModelConfig
from node.learner.task import TaskConfig, load_task

# One intra-op thread a test process: two workers share the two cores, and a tiny model's step with two threads
# took 13 ms against 8 ms with one (the threads' hand-offs cost more than the arithmetic they split).
torch.set_num_threads(1)

# Generated text is made once per test session, in a folder of the session's (node processes inherit it),
# rather than read from or left in the user's cache.
_OWN_CACHE = None
if "DDILOCO_CACHE" not in os.environ:
    _OWN_CACHE = os.environ["DDILOCO_CACHE"] = tempfile.mkdtemp(prefix="ddiloco-test-cache-")


# What a run of the project may leave in the temporary folder: p2pd and hivemind client sockets, a DHT's
# socket folder, a node's private TMPDIR (``node.local.launcher.private_tmp``), multiprocessing's and
# torchrun's folders. After the suite none may be there that was not there before.
LEFTOVER_PATTERNS = (
    "hivemind-p2pclient-*.sock",
    "hivemind-p2pd-*.sock",
    "ddiloco-dht-*",
    "ddiloco-node*-*",
    "pymp-*",
    "torchelastic_*",
)


def project_leftovers(tmp: str | None = None) -> set[str]:
    import glob
    import multiprocessing.process

    tmp = tmp or tempfile.gettempdir()
    found = {p for pat in LEFTOVER_PATTERNS for p in glob.glob(os.path.join(tmp, pat))}
    own = multiprocessing.process.current_process()._config.get("tempdir")  # removed when pytest exits
    return found - {own}


# Under pytest-xdist each worker is a session of its own while the others run, so the check belongs to the
# process that started the run (the controller, or the only process without xdist): it looks before the first
# test and after every worker has finished.
_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
_TMP_BEFORE: set[str] = set()


def pytest_sessionstart(session):
    if not _XDIST_WORKER:
        _TMP_BEFORE.update(project_leftovers())


def pytest_sessionfinish(session, exitstatus):
    """The suite leaves the machine as it found it: nothing of the project's is left in the temporary
    folder (the test of this check is ``tests/test_tmp_hygiene.py``)."""
    from tests.swarm_util import close_fork_server

    close_fork_server()
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
    if _XDIST_WORKER:
        return
    import gc

    gc.collect()  # an in-process DHT's socket folder goes with its finaliser
    left = project_leftovers() - _TMP_BEFORE
    if left:
        msg = f"the test session left these in {tempfile.gettempdir()}: {sorted(left)}"
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("FAILED leftover check: " + msg, red=True)
        else:
            print(msg)
        if session.exitstatus == 0:
            session.exitstatus = 1


# The modules whose tests start node processes and run for tens of seconds (``--durations``): collected first,
# with their short tests beside them, so that the pytest-xdist workers of ``scripts/test.sh`` end on short tests
# and finish together. (All the slow tests first made both workers run node processes at once throughout: the
# suite took 666 s against 555 s, its tests 2-4x their time alone.)
SLOW_FIRST = (
    "test_hostile_state", "test_chaos", "test_membership_at_size", "test_sybil_election", "test_swarm",
    "test_hostile_snapshots", "test_election_fence", "test_hostile_counters", "test_audit", "test_left_out",
    "test_doctor", "test_distrust", "test_unit_fsdp", "test_unit", "test_hf", "test_wire_refusals",
    "test_strangers", "test_hostile_peer", "test_robust", "test_node_systems", "test_private_swarm",
    "test_open_learners", "test_evidence", "test_remote_status", "test_operating", "test_golden",
)  # fmt: skip


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(it.module.__name__.rsplit(".", 1)[-1], len(rank)))


TINY_MODEL = ModelConfig(dim=32, layers=2, heads=2, seq_len=32)


def tiny_task_config(**kw) -> TaskConfig:
    return TaskConfig(batch_size=kw.pop("batch_size", 4), eval_batches=2, model=TINY_MODEL, **kw)


@pytest.fixture(scope="session")
def tiny_task():
    return load_task(None, tiny_task_config())


def _children(pid: int) -> list[int]:
    out = []
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as fh:
                        ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == pid:
                    out.append(int(entry))
                    out.extend(_children(int(entry)))
    except OSError:
        pass
    return out


def _is_process_infrastructure(pid: int) -> bool:
    """torch's shared-memory manager and the node fork server (``tests.swarm_util.fork_server``) start
    lazily and serve the whole test process; they are not leaks (what the fork server forks is)."""
    from tests import swarm_util

    if swarm_util._FORKS is not None and pid == swarm_util._FORKS.proc.pid:
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"torch_shm_manager" in fh.read()
    except OSError:
        return False


@pytest.fixture(autouse=True)
def reap_children():
    """Whatever a test started, nothing it started outlives it."""
    before = set(_children(os.getpid()))
    yield
    for pid in set(_children(os.getpid())) - before:
        if _is_process_infrastructure(pid):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
