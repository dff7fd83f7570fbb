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


def test_a_stopping_node_cancels_again_a_task_that_swallowed_its_cancel():
    """A checkpoint loop awaiting ``asyncio.wait_for`` on the learner's answer lost its cancel when the answer
    came at the same moment (Python 3.11), and went on checkpointing: its node never wrote final.json. The
    shutdown cancels again until every task has ended, and gives up on one that never does at its deadline."""
    import asyncio

    from node.common.lifetime import cancel_until_done

    async def main():
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        async def checkpoint_loop():
            while True:  # as the node's loops are: only a cancel ends it
                if not answer.done():
                    await asyncio.wait_for(answer, timeout=60)
                await asyncio.sleep(0.01)

        t = asyncio.ensure_future(checkpoint_loop())
        await asyncio.sleep(0.01)  # inside wait_for
        answer.set_result(1)  # the answer and the cancel in one turn of the loop
        t.cancel()
        await asyncio.sleep(0.05)
        lost = not t.done()  # 3.11: wait_for returned the answer, and the loop went on
        assert not await cancel_until_done({t}, 5.0, again_s=0.05)
        assert t.cancelled()

        deaf_until = [True]

        async def deaf():
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    if not deaf_until[0]:
                        raise

        d = asyncio.ensure_future(deaf())
        await asyncio.sleep(0)
        t0 = loop.time()
        assert await cancel_until_done({d}, 0.3, again_s=0.05) == {d}  # given up on at its deadline
        assert 0.3 <= loop.time() - t0 < 2.0 and not d.done()
        deaf_until[0] = False
        assert not await cancel_until_done({d}, 5.0)
        return lost

    lost = asyncio.run(main())
    if sys.version_info < (3, 12):
        assert lost  # the loss this guards against happens on this Python


def test_an_exit_without_teardown_runs_the_exit_handlers_flushes_and_keeps_the_code(tmp_path):
    import subprocess
    import sys

    code = (
        "import atexit, sys\n"
        "from node.common.lifetime import exit_without_teardown\n"
        "atexit.register(lambda: print('handler ran'))\n"
        "print('buffered', end='')\n"
        "sys.stderr.write('to stderr')\n"
        "exit_without_teardown(int(sys.argv[1]) if sys.argv[1] != 'none' else None)\n"
    )
    for arg, rc in (("3", 3), ("none", 0)):
        out = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=60)
        assert out.returncode == rc, out
        assert out.stdout == "bufferedhandler ran\n" and out.stderr == "to stderr", out
