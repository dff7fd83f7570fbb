"""``--exit-with-parent``: a node notices its launcher's death even when the launcher died while the node was
still importing and starting (before its heartbeats began). Read at the first heartbeat, the parent was
already gone: the orphaned nodes of a killed ``bench/attacks.py`` trained on for minutes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import os, sys, time
    import node.common.lifetime as lifetime  # first, as in python -m node
    open(sys.argv[1], "w").write("started")
    deadline = time.monotonic() + 20
    while os.getppid() == lifetime._PARENT and time.monotonic() < deadline:
        time.sleep(0.05)  # the launcher dies meanwhile: the node's start-up
    open(sys.argv[1], "w").write(str(lifetime.parent_gone()))
    """
)

LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys, time, pathlib
    flag = pathlib.Path(sys.argv[2])
    p = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(flag)], start_new_session=True)
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(p.pid, flush=True)  # and dies, its child still starting
    """
)


def test_a_launcher_that_dies_while_its_node_starts_is_noticed(tmp_path):
    flag = tmp_path / "flag"
    out = subprocess.run(
        [sys.executable, "-c", LAUNCHER, CHILD, str(flag)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while flag.read_text() == "started" and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert flag.read_text() == "True"
    finally:
        subprocess.run(["kill", "-9", str(child)], capture_output=True)


def test_a_live_launcher_is_not_taken_for_gone():
    from node.common.lifetime import parent_gone

    assert not parent_gone()
