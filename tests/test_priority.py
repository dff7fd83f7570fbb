"""node.common.priority: the network side of a node is niced, the learner thread is not (run in a child process,
since niceness cannot be lowered back without privileges)."""

import subprocess
import sys

import pytest

SCRIPT = r"""
import os, subprocess, sys, threading, time
from node.common.priority import lower_network_priority
ready, stop = threading.Event(), threading.Event()
def learner():
    ready.set(); stop.wait()
t = threading.Thread(target=learner); t.start(); ready.wait()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
time.sleep(0.2)
base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
n = lower_network_priority(4, keep={t.native_id})
print(n, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) - base,
      os.getpriority(os.PRIO_PROCESS, t.native_id) - base,
      os.getpriority(os.PRIO_PROCESS, child.pid) - base)
child.kill(); child.wait(); stop.set(); t.join()
"""


def test_network_side_is_niced_and_the_learner_thread_keeps_its_priority():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    changed, main_d, learner_d, child_d = map(int, out.stdout.split())
    assert changed >= 2 and main_d == 4 and learner_d == 0 and child_d == 4


OWN_SCRIPT = r"""
import os, threading
from node.common.priority import lower_own_thread_priority
base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
out = {}
def learner():
    out["added"] = lower_own_thread_priority(6)
    out["learner"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) - base
t = threading.Thread(target=learner); t.start(); t.join()
print(out["added"], out["learner"], os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) - base)
"""


def test_learner_nice_lowers_only_the_calling_thread():
    out = subprocess.run([sys.executable, "-c", OWN_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    added, learner_d, main_d = map(int, out.stdout.split())
    assert added == 6 and learner_d == 6 and main_d == 0


@pytest.mark.slow
def test_launched_nodes_share_the_launchers_session_in_a_process_group_of_their_own(tmp_path):
    """Linux autogroups are per session: a node in a session of its own would get an equal share of the
    CPU whatever its threads' niceness, and ``learner_nice`` would not reach across nodes."""
    import os

    from node.local.launcher import kill_group, start_node

    child = start_node(0, tmp_path, ["--help"], [])
    try:
        pid = child.proc.pid
        assert os.getpgid(pid) == pid  # kill -9 of the group takes the node with its DHT process and p2pd
        assert os.getsid(pid) == os.getsid(0)
    finally:
        child.proc.wait(timeout=60)
        kill_group(child)  # reaped: its private TMPDIR goes
