"""The suite leaves the temporary folder as it found it: the session check sees a leftover, and a
node killed -9 by the launcher leaves nothing behind, its p2p daemon's sockets included."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from node.local.launcher import kill_group, start_node, wait_ready
from tests.conftest import project_leftovers
from tests.swarm_util import TINY


def test_the_leftover_check_sees_each_kind(tmp_path):
    for name in (
        "hivemind-p2pclient-abc.sock",
        "ddiloco-dht-1-x",
        "ddiloco-node0-y",
        "pymp-z",
        "torchelastic_q",
    ):
        (tmp_path / name).mkdir()
    (tmp_path / "unrelated").mkdir()
    assert {Path(p).name for p in project_leftovers(str(tmp_path))} == {
        "hivemind-p2pclient-abc.sock",
        "ddiloco-dht-1-x",
        "ddiloco-node0-y",
        "pymp-z",
        "torchelastic_q",
    }


@pytest.mark.slow
def test_a_node_killed_minus_9_leaves_nothing_in_tmp(tmp_path):
    c = start_node(0, tmp_path, TINY, [])
    try:
        wait_ready([c], 120)
        # the node's p2p daemon and its client keep their sockets in the node's private TMPDIR
        socks = [p for p in Path(c.tmp).rglob("*.sock")]
        assert socks, f"no p2pd sockets under the node's TMPDIR {c.tmp}: {os.listdir(c.tmp)}"
        assert json.loads((c.state_dir / "ready.json").read_text())["peer_id"]
        # torch's shared-memory helper (the file_system strategy that hivemind sets) outlived every node
        # and aborted once the node's TMPDIR was removed, "terminate called ..." in each node's log
        # (it runs in a session of its own, so the kill -9 of the node's group did not reach it either)
        children = _descendants(c.proc.pid)
        assert "p2pd" in children and "torch_shm_manager"[:15] not in children, children
    finally:
        kill_group(c)
    deadline = time.monotonic() + 30
    while os.path.exists(c.tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert c.proc.poll() is not None
    assert not os.path.exists(c.tmp), f"{c.tmp} is still there: {os.listdir(c.tmp)}"


def _descendants(pid: int) -> list[str]:
    """The command names (at most 15 characters, as the kernel keeps them) of a process's descendants."""
    procs = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited meanwhile
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        procs[int(stat.parent.name)] = (name, int(rest[1]))  # fields after the name: state, ppid, ...
    names, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for child, (name, ppid) in procs.items():
            if ppid == parent:
                names.append(name)
                todo.append(child)
    return names
