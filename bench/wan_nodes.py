"""bench/wan.py's node systems: a swarm of real nodes, one per network namespace on capped links, and the measurement window they are read in."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from swarm import cpu_seconds
from wan_config import NODE_SYSTEM, WanConfig, rate_bits

from node.chaos.netns import NetLab
from node.common.events import read_events
from node.common.status_client import StatusError, fetch_status, read_control_token, send_control
from node.local.launcher import Child, LaunchError, kill_group, wait_ready


# ------------------------------------------------------------------------------------------------ the window
def until(cond: Callable[[], bool], timeout_s: float, what: str, check: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        check()
        if time.monotonic() > deadline:
            raise LaunchError(f"{what}: not within {timeout_s:g} s")
        time.sleep(1.0)


def window(
    cfg: WanConfig,
    lab: NetLab,
    say: Callable[[str], None],
    progress: Callable[[], str],
    pids: list[int],
    payload: Callable[[], list[dict]] | None = None,
) -> dict:
    """Warm-up, then the measured window: wall times, every link's counters and the CPU time of every
    process tree in ``pids`` at both ends (and, for nodes, ``payload``: each node's status document, whose
    transport counts the bytes it sent, by op, without DHT traffic or libp2p's framing; and their TCP
    sockets' bytes, which hold both)."""
    end = time.monotonic() + cfg.warm_s
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(5.0, left))
        say(f"warm-up  {progress()}")
    p_a = payload() if payload else None
    tcp_a = [lab.tcp_bytes(i) for i in range(cfg.nodes)] if payload else None
    c_a = [cpu_seconds(p) for p in pids]
    a, t_a, load_a = [lab.link_counters(i) for i in range(cfg.nodes)], time.time(), os.getloadavg()[0]
    end = time.monotonic() + cfg.duration_s
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(10.0, left))
        say(f"t={cfg.duration_s - max(0.0, end - time.monotonic()):3.0f}/{cfg.duration_s:g}s  {progress()}")
    b, t_b = [lab.link_counters(i) for i in range(cfg.nodes)], time.time()
    c_b = [cpu_seconds(p) for p in pids]
    tcp_b = [lab.tcp_bytes(i) for i in range(cfg.nodes)] if payload else None
    p_b = payload() if payload else None
    both = bool(p_a and p_b)
    by_op = sent_by_op(p_a, p_b) if both else {}
    return {
        "t_a": t_a,
        "t_b": t_b,
        "sent_B": [y["tx_bytes"] - x["tx_bytes"] for x, y in zip(a, b)],
        "received_B": [y["rx_bytes"] - x["rx_bytes"] for x, y in zip(a, b)],
        "sent_packets": [y["tx_packets"] - x["tx_packets"] for x, y in zip(a, b)],
        "payload_sent_B": [y["bytes_sent"] - x["bytes_sent"] for x, y in zip(p_a, p_b)] if both else None,
        # every node's transport, summed: bytes sent by op (headers included, both ends of each call)
        "by_op_sent_B": by_op if both else None,
        # every node's TCP sockets, summed: bytes written (DHT and transport, libp2p framing included)
        "tcp_sent_B": sum(y["bytes_sent"] - x["bytes_sent"] for x, y in zip(tcp_a, tcp_b)) if both else None,
        "tcp_retrans_B": sum(y["bytes_retrans"] - x["bytes_retrans"] for x, y in zip(tcp_a, tcp_b))
        if both
        else None,
        "tcp_segs_out": sum(y["segs_out"] - x["segs_out"] for x, y in zip(tcp_a, tcp_b)) if both else None,
        # CPU seconds in the window per process tree (node: its process, DHT process and p2pd; DP: a worker),
        # and of its busiest thread (the training thread)
        "cpu_s": [b[0] - a[0] for a, b in zip(c_a, c_b)],
        "train_thread_cpu_s": [
            max((v - a[2].get(t, 0.0) for t, v in b[2].items()), default=0.0) for a, b in zip(c_a, c_b)
        ],
        "load_avg": [load_a, os.getloadavg()[0]],
    }


# ------------------------------------------------------------------------------------------ node systems
def sent_by_op(before: list[dict], after: list[dict]) -> dict[str, int]:
    """Every node's transport bytes sent between two status reads, summed, by op (``transfers.by_op``)."""
    by_op: dict[str, int] = {}
    for x, y in zip(before, after):
        old = x["transfers"].get("by_op", {})
        for op, row in y["transfers"].get("by_op", {}).items():
            by_op[op] = by_op.get(op, 0) + row["sent"] - old.get(op, {}).get("sent", 0)
    return by_op


def round_s(cfg: WanConfig, lab: NetLab, doc: dict | None) -> float:
    """Seconds a round of synchronous DiLoCo takes on the link at its rate: M - 1 fp32 models in, and
    out again (0 where the link is not capped or the model's size is not known yet)."""
    weights = ((doc or {}).get("memory") or {}).get("weights_bytes", 0)
    if not lab.rate or lab.rate == "none" or not weights:
        return 0.0
    return 2 * (cfg.nodes - 1) * weights * 8 / rate_bits(lab.rate)


def run_nodes(cfg: WanConfig, lab: NetLab, system: str, run_dir: Path, say: Callable[[str], None]) -> dict:
    flags = ["--threads", "1", "--swarm", f"wan-{os.getpid()}", "--batch-size", str(cfg.batch_size)]
    flags += ["--eval-every-s", f"{cfg.eval_every_s:g}", "--sync-every", str(cfg.sync_every)]
    flags += ["--steps", str(cfg.steps), "--system", NODE_SYSTEM[system], *cfg.node_flags]
    if system == "ours-q":
        flags += ["--quorum", str(cfg.nodes - 1)]  # a round waits for every learner but one
    if system == "sync":
        # as its authors run it, a learner waits until its round merges: at 1 Mbit/s a round's bytes take
        # minutes, and the node's default wait (60 s) made rounds of one or two learners
        flags += ["--block-timeout-s", "1800"]
    children: list[Child] = []

    def seeded(i: int) -> list[str]:  # node i reads as DP's rank i does
        return [*flags, "--data-seed", str(cfg.seed * 1000 + i + 1)]

    def status(c: Child) -> dict | None:
        try:
            c.last = lab.inside(c.index, lambda: fetch_status(c.url, timeout_s=5))
        except StatusError:
            pass
        return c.last

    def control(c: Child, action: str) -> bool:
        try:
            lab.inside(c.index, lambda: send_control(c.url, action, token=read_control_token(c.state_dir)))
            return True
        except StatusError:
            return False

    def check() -> None:
        for c in children:
            if c.proc.poll() is not None:
                raise LaunchError(
                    f"node {c.index} exited with code {c.proc.returncode}; its log:\n{c.tail()}"
                )

    def progress() -> str:
        check()
        docs = [status(c) or {} for c in children]
        steps = " ".join(str(d.get("learner", {}).get("steps", "?")) for d in docs)
        tps = sum(d.get("learner", {}).get("tokens_per_s", 0.0) for d in docs)
        rounds = max((d.get("rounds_merged", 0) for d in docs), default=0)
        return f"steps {steps}  ~{tps:,.0f} tok/s  rounds {rounds}"

    settled, idle_sent, idle_by_op = False, None, None
    try:
        say(f"starting {cfg.nodes} nodes ({' '.join(flags)})")
        # A synchronised start, as DP's workers have: each node is paused as soon as it is up (node 0 takes a
        # step or two first) and all resume together once every one has joined, so no node trains alone
        # while the others download the state and the eval loss per token compares the algorithms.
        children.append(lab.start(0, run_dir, seeded(0), []))
        wait_ready(children, cfg.start_timeout_s)
        control(children[0], "pause")
        for i in range(1, cfg.nodes):
            children.append(lab.start(i, run_dir, seeded(i), children[0].maddrs))
        waiting, deadline = list(children[1:]), time.monotonic() + cfg.start_timeout_s
        while waiting:
            check()
            for c in [c for c in waiting if (c.state_dir / "ready.json").exists()]:
                wait_ready([c], 10)
                control(c, "pause")
                waiting.remove(c)
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"nodes {[c.index for c in waiting]} not up within {cfg.start_timeout_s:g} s"
                )
            time.sleep(0.1)
        t_start = time.time()
        for c in children:
            control(c, "resume")
        until(
            lambda: all((status(c) or {}).get("learner", {}).get("steps", 0) > 0 for c in children),
            cfg.start_timeout_s,
            "every node training",
            check,
        )
        if system == "sync":
            # Every learner waits at its first contribution until all have made theirs: the window opens
            # after the first round that merged every learner. That round moves M - 1 fp32 models into
            # its synchroniser and its record to M - 1 peers: at 1 Mbit/s, 3.5 MB each way three times,
            # at least 170 s of the link; allowed four times that, or start_timeout_s if more.
            until(
                lambda: any(
                    r["kind"] == "merge" and len(r.get("learners", [])) == cfg.nodes
                    for r in read_events(children[0].state_dir / "events.jsonl")
                ),
                max(cfg.start_timeout_s, 4 * round_s(cfg, lab, status(children[0]))),
                f"a round merging all {cfg.nodes} learners",
                check,
            )

        def payload() -> list[dict]:
            docs = [status(c) for c in children]
            return docs if all(docs) else []

        win = window(cfg, lab, say, progress, [c.proc.pid for c in children], payload)
        tokens_per_step = children[0].last["learner"]["tokens_per_step"]
        for c in children:
            control(c, "pause")
        streak, deadline = 0, time.monotonic() + cfg.settle_s
        while time.monotonic() < deadline and streak < 2:
            docs = [status(c) for c in children]
            same = len({d["model_hash"] for d in docs if d}) == 1
            streak = streak + 1 if all(d and d["learner"]["idle"] for d in docs) and same else 0
            time.sleep(1.0)
        settled = streak >= 2
        say("paused; one model hash" if settled else f"paused; hashes still differ after {cfg.settle_s:g} s")
        if cfg.idle_s > 0:  # the learners paused: what membership, heartbeats and the DHT cost alone
            docs_a = payload()
            a, t0 = [lab.link_bytes(i) for i in range(cfg.nodes)], time.monotonic()
            time.sleep(cfg.idle_s)
            b, span = [lab.link_bytes(i) for i in range(cfg.nodes)], time.monotonic() - t0
            docs_b = payload()
            idle_sent = [(y[0] - x[0]) / span for x, y in zip(a, b)]
            if docs_a and docs_b:  # of those, what the transport's ops sent (the rest: the DHT, framing)
                idle_by_op = {op: n / span for op, n in sent_by_op(docs_a, docs_b).items() if n > 0}
        for c in children:
            if not control(c, "stop"):
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for c in children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - killed below
                pass
    finally:
        for c in children:
            kill_group(c)  # reaps it, and removes what a kill -9 left in its TMPDIR
            if c.proc.poll() is None:
                say(f"node {c.index} (pid {c.proc.pid}) did not exit after SIGKILL")
    learners = []
    for c in children:
        ev = read_events(c.state_dir / "events.jsonl")
        final = c.state_dir / "final.json"
        learners.append(
            {
                "steps": [
                    (r["t0"], r["t1"], tokens_per_step)
                    for r in ev
                    if r["kind"] == "step" and r.get("learner") == c.peer_id
                ],
                "evals": [(r["t"], r["loss"]) for r in ev if r["kind"] == "eval"],
                "merges": sum(r["kind"] == "merge" for r in ev if win["t_a"] <= r.get("t", 0) < win["t_b"]),
                "final": json.loads(final.read_text()) if final.exists() else {},
            }
        )
    return {
        **win,
        "learners": learners,
        "settled": settled,
        "idle_sent_B_per_s": idle_sent,
        "idle_by_op_B_per_s": idle_by_op,
        "tokens_per_step": tokens_per_step,
        "t_start": t_start,
    }
