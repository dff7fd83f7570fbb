"""The fork server (``python -m node.cli.forkserver``, started by ``node.local.forks.ForkServer``): imports
what a node imports, then forks a node for each request and reaps it; a forked child becomes the
``python -m node node ...`` its request names. Requests and answers: one JSON object a line, on stdin and
stdout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

from node.common.lifetime import exit_without_teardown

_exited: dict[int, int] = {}  # pid -> exit code, as subprocess reports it (-N: killed by signal N)


def _reap(*_) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _exited[pid] = os.waitstatus_to_exitcode(status)


def _preload() -> int:
    """Import what a node imports before its first step (``torch._dynamo`` included); returns torch's
    default number of threads. Before any torch work here, torch runs one thread: some modules make small
    tensors at import, and an OpenMP team started in this process would be a team no forked child has (its
    first parallel loop would wait on those threads for ever); each child starts its own."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    import torch._dynamo  # noqa: F401

    import node.cli.main  # noqa: F401
    import node.cli.node_cmd  # noqa: F401 - the CLI imports it only for a node's command
    import node.swarm.agent  # noqa: F401
    from dht import launch  # noqa: F401

    return threads


def _check_spawn(req: dict) -> None:
    """A spawn request names its argv (strings), environment (strings to strings), log file and folder;
    checked before the fork, so that a bad one is refused here, not in a child that dies of it."""
    ok = (
        isinstance(req.get("argv"), list)
        and all(isinstance(a, str) for a in req["argv"])
        and isinstance(req.get("env"), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in req["env"].items())
        and isinstance(req.get("log"), str)
        and isinstance(req.get("cwd"), str)
        and isinstance(req.get("script", ""), str)
    )
    if not ok:
        raise ValueError(
            "a spawn request needs argv [str], env {str: str}, log str and cwd str (script str: optional)"
        )
    if not os.path.isdir(req["cwd"]):
        raise ValueError(f"cwd {req['cwd']!r} is not a folder")
    if "script" in req and not os.path.isfile(req["script"]):
        raise ValueError(f"script {req['script']!r} is not a file")


def _serve() -> dict:
    """Answer requests until one asks for a node; return that request in the forked child (with torch's
    default number of threads here, ``threads``). Exit when the launcher closes stdin."""
    import faulthandler

    from node.common.heap import one_arena
    from node.common.lifetime import die_with_parent

    die_with_parent()
    # what ``python -m node`` does first (node/__main__.py), before torch and any thread: one malloc heap,
    # and every thread's traceback on a crash in a native library
    one_arena()
    faulthandler.enable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops its nodes itself
    signal.signal(signal.SIGCHLD, _reap)
    threads = _preload()
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            op = req["op"]
            if op == "ready":
                answer = {"ok": True}
            elif op == "poll":
                _reap()
                answer = {"returncode": _exited.get(int(req["pid"]))}
            elif op == "spawn":
                _check_spawn(req)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    return dict(req, threads=threads)
                # a pid the kernel gave again: the exit code of its earlier child is not this one's
                _exited.pop(pid, None)
                with contextlib.suppress(OSError):
                    os.setpgid(pid, pid)  # as the child does: whichever runs first
                answer = {"pid": pid}
            else:
                answer = {"error": f"unknown op {op!r}"}
        except (ValueError, KeyError, TypeError, OSError) as e:
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()
    exit_without_teardown(0)  # its launcher closed the pipe: the teardown of torch took 10-20 s


def own_process_locks() -> None:
    """In a forked child: new multiprocessing locks in place of those hivemind made at import (in the
    server), which every child forked from the server would otherwise share. They are POSIX semaphores in
    shared memory: a node killed while one of its processes held one (a DHT process sends every result to its
    node under ``MPFuture._update_lock``) left it held for ever, and every node forked after it hung starting
    its DHT (a suite run: three in a row, "not ready within 60 s"). A fresh ``python -m node`` makes its own
    at import; so does this, before any hivemind object exists in the child."""
    import multiprocessing as mp

    from hivemind.utils import asyncio as hm_asyncio
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()  # MPFuture's initialisation and update locks, SharedBytes' lock
    hm_asyncio._AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()
    hm_asyncio._AsyncContextWrapper.EXECUTOR_PID = None


def _become_node(req: dict) -> int:
    """In the forked child: be what ``python -m node`` with this request's argv would have been."""
    import random
    import runpy
    import tempfile

    import torch

    import node.common.lifetime as lifetime
    import node.swarm.agent as agent
    from node.cli.main import main

    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    os.chdir(req["cwd"])
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None  # read TMPDIR again
    lifetime._PARENT = os.getppid()
    own_process_locks()
    agent.IMPORTED_AT = time.time()  # nothing left to import
    random.seed()
    torch.seed()
    # the threads a fresh process would start with: OMP_NUM_THREADS of its environment, else torch's default
    omp = req["env"].get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(omp) if omp.isdigit() and int(omp) > 0 else req["threads"])
    if "script" in req:  # as ``python script argv...`` would run it
        sys.argv = [req["script"], *req["argv"]]
        try:
            runpy.run_path(req["script"], run_name="__main__")
        except SystemExit as e:
            return e.code
        return 0
    sys.argv = ["ddiloco", *req["argv"]]
    return main(req["argv"])


if __name__ == "__main__":
    exit_without_teardown(_become_node(_serve()))  # in the forked child: the server's _serve exits itself
