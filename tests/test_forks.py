"""The fork server (``node.local.forks``): a node it forks is the process ``python -m node`` would have been
(argv, working folder, environment, log, process group, exit code), and the server's bookkeeping of its
children stays right through failures and kills."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from node.local.forks import ForkServer, ForkServerError
from node.local.launcher import kill_group, start_node, wait_ready
from tests.swarm_util import TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def forks():
    """One server for the module's tests (each start imports for 6-10 s); each test's children are its own,
    and the server still serves after each (the bad-request test shows it)."""
    server = ForkServer()
    try:
        yield server
    finally:
        server.close()
    assert server.proc.returncode == 0


def test_a_forked_command_runs_in_its_folder_writes_its_log_and_exits_with_its_code(forks, tmp_path):
    log = tmp_path / "keygen.log"
    first = forks.spawn(["keygen"], dict(os.environ), str(log), cwd=str(tmp_path))
    assert first.wait(timeout=60) == 0
    peer = log.read_text().split()[-1]
    assert peer.startswith("12D3Koo") and (tmp_path / "identity.key").exists()
    # the same again: refused (the key exists), code 2, the message on stderr in the same log
    again = forks.spawn(["keygen"], dict(os.environ), str(log), cwd=str(tmp_path))
    assert again.wait(timeout=60) == 2
    assert "already exists" in log.read_text()
    other = forks.spawn(["keygen", "--out", "b.key"], dict(os.environ), str(log), cwd=str(tmp_path))
    assert other.wait(timeout=60) == 0
    assert log.read_text().split()[-1] not in (
        peer,
        "",
    )  # a key of its own: the child's randomness is its own


def test_a_forked_script_runs_as_python_would_run_it(forks, tmp_path):
    """``spawn(script=...)``: the file runs as ``__main__`` with its own argv (``bench/hostile_node.py``, a
    node with changes of its own, is forked so), its exit code is the child's, and a script that is not a
    file is refused before any fork."""
    script = tmp_path / "s.py"
    script.write_text(
        "import os, sys\n"
        "if __name__ == '__main__':\n"
        "    print(sys.argv[1:], os.getcwd(), os.environ['MARK'])\n"
        "    sys.exit(3)\n"
    )
    log = tmp_path / "s.log"
    child = forks.spawn(
        ["a", "--b"], dict(os.environ, MARK="m"), str(log), cwd=str(tmp_path), script=str(script)
    )
    assert child.wait(timeout=60) == 3
    assert log.read_text().split("\n")[0] == f"['a', '--b'] {tmp_path} m"
    with pytest.raises(ForkServerError, match="is not a file"):
        forks.spawn(["a"], dict(os.environ), str(log), cwd=str(tmp_path), script=str(tmp_path / "none.py"))


def test_a_forked_node_has_its_own_group_environment_and_a_kill_is_reported(forks, tmp_path):
    c = start_node(0, tmp_path, TINY, [], forks=forks)
    try:
        wait_ready([c], 120)
        assert os.getpgid(c.proc.pid) == c.proc.pid and os.getsid(c.proc.pid) == os.getsid(0)
        assert c.proc.poll() is None
        # the launcher's TMPDIR for this life reached the child: its p2p daemon's sockets are there
        assert list(Path(c.tmp).rglob("*.sock")), os.listdir(c.tmp)
        startup = json.loads((c.state_dir / "events.jsonl").read_text().splitlines()[0])["startup"]
        assert 0 <= startup["imports"] < 1.0, startup  # nothing left to import
        os.kill(c.proc.pid, signal.SIGKILL)
        assert c.proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        kill_group(c)
    assert not os.path.exists(c.tmp)


_HOLD = """
import pathlib, sys, time
from hivemind.utils.mpfuture import MPFuture
if __name__ == '__main__':
    if sys.argv[1] == "hold":
        MPFuture._update_lock.acquire()  # as a DHT process does to send its node a result
        pathlib.Path("held").write_text("")
        time.sleep(600)
    sys.exit(0 if MPFuture._update_lock.acquire(timeout=10) else 1)
"""


def test_a_child_killed_holding_a_hivemind_lock_leaves_the_next_child_its_own(forks, tmp_path):
    """hivemind makes its multiprocessing locks at import, in the server: a child killed while it held one
    (a DHT process sends every result to its node under one) left it held for every child forked after it,
    and each of their DHTs hung at start. A child has locks of its own, as a fresh process has."""
    script = tmp_path / "hold.py"
    script.write_text(_HOLD)
    log = str(tmp_path / "hold.log")
    holder = forks.spawn(["hold"], dict(os.environ), log, cwd=str(tmp_path), script=str(script))
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "held").exists():
            assert holder.poll() is None and time.monotonic() < deadline, Path(log).read_text()
            time.sleep(0.05)
    finally:
        holder.kill()
    assert holder.wait(timeout=30) == -signal.SIGKILL
    after = forks.spawn(["take"], dict(os.environ), log, cwd=str(tmp_path), script=str(script))
    assert after.wait(timeout=60) == 0, Path(log).read_text()


def test_a_bad_request_is_refused_and_the_server_keeps_serving(forks, tmp_path):
    with pytest.raises(ForkServerError, match="unknown op"):
        forks._ask({"op": "nonsense"})
    with pytest.raises(ForkServerError, match="needs argv"):
        forks._ask({"op": "spawn", "argv": ["keygen"]})  # no env, no log
    with pytest.raises(ForkServerError, match="not a folder"):
        forks.spawn(["keygen"], dict(os.environ), str(tmp_path / "l"), cwd=str(tmp_path / "none"))
    assert forks.returncode(1) is None  # not a child of the server's: nothing known of it
    done = forks.spawn(["keygen", "--out", "k"], dict(os.environ), str(tmp_path / "l"), cwd=str(tmp_path))
    assert done.wait(timeout=60) == 0


def test_when_the_server_is_gone_its_children_read_as_killed(tmp_path):
    server = ForkServer()
    c = start_node(0, tmp_path, TINY, [], forks=server)
    try:
        wait_ready([c], 120)
        server.proc.kill()  # a node started with --exit-with-parent sees its parent gone, and stops
        server.proc.wait()
        assert c.proc.wait(timeout=60) == -signal.SIGKILL  # its code went with the server: read as killed
        with pytest.raises(ForkServerError, match="exited"):
            server.spawn(["keygen"], dict(os.environ), str(tmp_path / "l"))
    finally:
        kill_group(c)
        server.close()


_FORK_AFTER_PRELOAD = """
import os, sys, torch
from node.cli.forkserver import _preload
threads = _preload()
pid = os.fork()
if pid == 0:
    torch.set_num_threads(2)
    torch.zeros(20_000_000, dtype=torch.uint8).long()  # a parallel loop over 2 threads
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), threads >= 1)
"""


def test_a_child_forked_after_the_imports_runs_parallel_loops():
    """Modules make small tensors at import; an OpenMP team started by them in the server is one no child
    has, and a child's first parallel loop waited for it for ever (a sharded unit's node, which loads its
    task before it sets its threads, never started)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FORK_AFTER_PRELOAD], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.split() == ["0", "True"], (out.stdout, out.stderr[-2000:])
