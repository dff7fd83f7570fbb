"""Node processes forked from one process that has already imported everything a node imports.

A node spends about 6 CPU-seconds importing torch (and ``torch._dynamo``, which an optimiser's first
``add_param_group`` imports), hivemind and this package before it does anything of its own; a launcher that
starts many nodes on a small machine (the test suite starts about a hundred) spends most of its CPU there. A
``ForkServer`` is a process, started once, that makes those imports and then forks a node for each request:
the child sets up what a fresh ``python -m node node ...`` would have (its argv, environment, working folder,
log on stdout and stderr, its own process group, fresh random seeds, an empty signal table, and
multiprocessing locks of its own where hivemind made them at import: ``own_process_locks``) and runs the
same ``node.cli.main.main``. Each node is still a process of its own, with its own DHT process, p2p daemon
and sockets; only the imports are shared, copy-on-write.

The server is the nodes' parent, so the launcher sees each through a ``Forked`` handle (the parts of
``subprocess.Popen`` the launcher uses: ``pid``, ``poll``, ``wait``, ``returncode``, signals), whose exit code
the server reaps and reports. The server exits when its launcher closes it or dies (end of its stdin, and
``PR_SET_PDEATHSIG``); a node started with ``--exit-with-parent`` then stops as it does when its launcher
dies. Requests and answers are one JSON object a line, on the server's stdin and stdout; the server is
``node.cli.forkserver``, this module its launcher's side.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from protocol.errors import DDiLoCoError


class ForkServerError(DDiLoCoError):
    """The fork server died or answered something other than what was asked."""


class ForkServer:
    """The launcher's side: starts the server process and asks it for nodes."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "node.cli.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            process_group=0,  # a Ctrl+C to the launcher's group is the launcher's to pass on
        )
        self._ask({"op": "ready"}, timeout_s)

    def _ask(self, request: dict, timeout_s: float = 60.0) -> dict:
        with self._lock:
            if self.proc.poll() is not None:
                raise ForkServerError(f"the fork server exited with code {self.proc.returncode}")
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
            except OSError as e:
                raise ForkServerError(f"the fork server is gone: {e}") from e
            line = _readline(self.proc.stdout, timeout_s)
        if not line:
            raise ForkServerError(f"the fork server did not answer {request['op']!r} within {timeout_s:g} s")
        answer = json.loads(line)
        if "error" in answer:
            raise ForkServerError(answer["error"])
        return answer

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        log: str,
        cwd: str | None = None,
        script: str | None = None,
    ) -> Forked:
        """A node process running ``ddiloco *argv`` with ``env``, its output appended to ``log``; or, given
        ``script``, one running that Python file as ``python script *argv`` would (a node with changes of its
        own, such as ``bench/hostile_node.py``, which ends by running the node's CLI)."""
        req = {"op": "spawn", "argv": argv, "env": env, "log": log, "cwd": cwd or os.getcwd()}
        if script is not None:
            req["script"] = script
        answer = self._ask(req)
        return Forked(self, answer["pid"], [script or "ddiloco", *argv])

    def returncode(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})["returncode"]

    def close(self) -> None:
        """End the server: its nodes still running then see their parent gone."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            self.proc.stdout.close()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _readline(stream, timeout_s: float) -> bytes:
    """One line from the server's stdout, or b"" when none came within ``timeout_s``."""
    import select

    if not select.select([stream], [], [], timeout_s)[0]:
        return b""
    return stream.readline()


class Forked:
    """A node the fork server started, seen as ``subprocess.Popen`` sees its child."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self.server.returncode(self.pid)
            except ForkServerError:
                # The server is gone, and no one reports this child's code: a node started to exit with its
                # parent stops now; once it has, it reads as killed.
                if not _alive(self.pid):
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
