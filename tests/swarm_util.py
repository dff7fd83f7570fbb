"""Helpers for tests that run real node processes on loopback (``python -m node node``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from node.common.events import read_events
from node.common.status_client import StatusError, read_control_token, send_control
from node.local.forks import ForkServer
from node.local.launcher import Child, kill_group, poll, start_node, stop_all, wait_ready

# A small, quick swarm: tiny model, 4 fragments synced every 8 steps, fast membership, and a step delay so
# rounds come at a pace a 2-core machine running two such swarms keeps up with: three nodes at 0.05 s kept
# 1.64 cores busy (a round of each fragment every 0.6 s), at 0.15 s 1.05 cores (one every 1.3 s), and the
# suite took 20 minutes, not 35, with the two pytest workers no longer starving each other's nodes.
TINY = [
    "--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
    "--eval-batches", "4", "--fragments", "4", "--sync-every", "8", "--eval-every-s", "8",
    "--heartbeat-s", "1.0", "--ttl-s", "3", "--failover-s", "6", "--rpc-timeout-s", "5",
    "--threads", "1", "--step-delay-s", "0.15", "--checkpoint-every-s", "3", "--test-hooks",
]  # fmt: skip


_FORKS: ForkServer | None = None


def fork_server() -> ForkServer | None:
    """This test process's fork server (``node.cli.forkserver``), started at its first use: a node it forks
    skips the 6 CPU-seconds of imports, about a third of the suite's CPU when every node paid them. It ends
    with the test process (``tests/conftest.py``). ``DDILOCO_TEST_FORKS=0``: None, every node a fresh
    ``python -m node`` as a user starts it."""
    global _FORKS
    if os.environ.get("DDILOCO_TEST_FORKS", "1") == "0":
        return None
    if _FORKS is None or _FORKS.proc.poll() is not None:
        _FORKS = ForkServer()
    return _FORKS


def close_fork_server() -> None:
    global _FORKS
    if _FORKS is not None:
        _FORKS.close()
        _FORKS = None


class Swarm:
    def __init__(self, run_dir: Path, flags: list[str] | None = None) -> None:
        self.run_dir = run_dir
        self.flags = list(TINY if flags is None else flags)
        self.children: dict[int, Child] = {}

    def start(self, index: int, extra: list[str] = (), peers_from: int | None = 0) -> Child:
        peers = []
        if peers_from is not None and peers_from in self.children and peers_from != index:
            peers = self.children[peers_from].maddrs
        if index in self.children:  # a restart: the previous life is over, its TMPDIR goes with it
            kill_group(self.children[index])
        c = start_node(index, self.run_dir, self.flags + list(extra), peers, forks=fork_server())
        self.children[index] = c
        return c

    def start_many(self, n: int, extra: dict[int, list[str]] | None = None) -> None:
        extra = extra or {}
        self.start(0, extra.get(0, []), peers_from=None)
        wait_ready([self.children[0]], 120)
        for i in range(1, n):
            self.start(i, extra.get(i, []))
        wait_ready(list(self.children.values()), 120)

    def alive(self) -> list[Child]:
        return [c for c in self.children.values() if c.proc.poll() is None]

    def status(self) -> dict[int, dict]:
        live = self.alive()
        for c in live:
            c.last = None
        poll(live)
        return {c.index: c.last for c in live if c.last is not None}

    def control(self, index: int, action: str, **extra) -> dict:
        c = self.children[index]
        return send_control(c.url, action, token=read_control_token(c.state_dir), **extra)

    def kill9(self, index: int) -> None:
        """kill -9 the node's whole process group: the node, its DHT process and its p2pd, as a crash would."""
        kill_group(self.children[index])

    def one_hash_without(self, index: int, timeout_s: float = 60.0) -> dict[int, dict]:
        """Crash member ``index`` (a hostile one, say), let the others settle, and check they hold one hash."""
        self.kill9(index)
        del self.children[index]
        time.sleep(1.0)
        final = self.settle(timeout_s)
        assert len({s["model_hash"] for s in final.values()}) == 1, {
            i: s["model_hash"] for i, s in final.items()
        }
        return final

    def events(self, index: int) -> list[dict]:
        return read_events(self.children[index].state_dir / "events.jsonl")

    def merged_contributors(self, index: int, since: float = 0.0) -> set[str]:
        return {
            p for e in self.events(index) if e["kind"] == "merge" and e["t"] >= since for p in e["learners"]
        }

    def credited(self, index: int) -> set[str]:
        """The learners node ``index`` has seen merged in a record signed by another member: those the election
        fence of a public swarm counts as credited (a member's own records never credit it)."""
        return {
            p
            for e in self.events(index)
            if e["kind"] == "merge"
            for p in e["learners"]
            if p != e.get("signer")
        }

    def settle(self, timeout_s: float = 45.0) -> dict[int, dict]:
        """Pause every learner and wait until every live node holds one model hash (twice in a row)."""
        for c in self.alive():
            try:
                send_control(c.url, "pause", token=read_control_token(c.state_dir))
            except StatusError:
                pass
        streak, last, prev = 0, {}, None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            last = self.status()
            hashes = {s["model_hash"] for s in last.values()}
            idle = all(s["learner"]["idle"] and not s.get("in_flight") for s in last.values())
            agreed = len(last) == len(self.alive()) and idle and len(hashes) == 1
            streak = streak + 1 if agreed and hashes == prev else (1 if agreed else 0)  # one hash, unchanged
            prev = hashes if agreed else None
            if streak >= 2:
                return last
            time.sleep(1.0)
        raise AssertionError(
            "hashes did not converge (hash, learner idle, merges or sends in flight): "
            + json.dumps(
                {i: [s["model_hash"][:12], s["learner"]["idle"], s.get("in_flight")] for i, s in last.items()}
            )
            + "; per fragment (round, hash, behind): "
            + json.dumps(
                {
                    i: [(f["round"], f["hash"][:8], f["behind"]) for f in s["fragments"]]
                    for i, s in last.items()
                }
            )
            + "; refused: "
            + json.dumps({i: s.get("refused") for i, s in last.items()})
        )

    def stop(self) -> None:
        stop_all(list(self.children.values()), timeout_s=60)


def assert_eval_held(swarm: Swarm, since: float, nodes=None, factor: float = 1.05) -> dict[int, tuple]:
    """After an attack that began at ``since`` (``time.time()``) and a ``settle``: each honest node's evaluation
    of the global model made after this call is at most ``factor`` times the last it made before the attack.
    Training only lowers the loss over a test's few hundred steps, so an attack the swarm neutralised passes
    and one that got into the model does not (an installed all-zero snapshot read 5.5, inflated
    flipped weights 9.6-15, against 2.0-2.6 before). Returns each node's (before, after)."""
    nodes = list(swarm.children) if nodes is None else list(nodes)
    t_end = time.time()
    for i in nodes:  # now, rather than at each node's next eval_every_s
        with contextlib.suppress(StatusError):
            swarm.control(i, "evaluate")

    def losses():
        out = {}
        for i in nodes:
            ev = [e for e in swarm.events(i) if e["kind"] == "eval"]
            before = [e["loss"] for e in ev if e["t"] <= since]
            after = [e["loss"] for e in ev if e["t"] >= t_end]
            if not before or not after:
                return None
            out[i] = (before[-1], after[-1])
        return out

    held = wait_until(losses, 60, "an evaluation of the settled model on every honest node")
    for i, (before, after) in held.items():
        assert after <= factor * before, (
            f"node {i}: eval loss {after:.4f} after the attack, {before:.4f} before"
        )
    return held


def processes_naming(text: str) -> list[int]:
    """The pids of the processes whose command line holds ``text`` (a node's state folder names its
    torchrun and every rank of its unit)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if text.encode() in fh.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def wait_until(pred, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def exit_now() -> None:
    """End a spawned rank without interpreter teardown: gloo's threads, destroyed there after
    destroy_process_group, now and then abort the process (SIGABRT, "terminate called without an active
    exception") after all its work is done and written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_unit_trained_and_converged(swarm, tokens_per_step: int) -> None:
    """Node 0 (a learner unit) adopted merged fragments, each contribution carried the unit's whole batch
    (c_tokens = c_steps x the unit's tokens per step), and the swarm settles on one model hash."""
    ev = swarm.events(0)
    assert sum(1 for e in ev if e["kind"] == "adopt") > 0
    contribs = [e for e in ev if e["kind"] == "contribute"]
    assert contribs and all(e["c_tokens"] == e["c_steps"] * tokens_per_step for e in contribs)
    final = swarm.settle()
    assert len({s["model_hash"] for s in final.values()}) == 1
