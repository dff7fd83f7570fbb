"""Swarm benchmark: bytes on the wire per node per inner step, and a learner's throughput in a swarm.

Three parts, printed side by side:

1. Analytic bytes per node per inner step against data-parallel's fp32 ring all-reduce of the same model,
   for this repository's defaults and for paper-scale settings. In steady state every learner sends each
   fragment's int4 outer gradient once per H steps to that fragment's synchroniser, and the synchroniser
   pushes its signed merge record (the merged outer gradient in the record codec, int4 by default) to every
   other node. Averaged over the N nodes (each synchronises 1/N of the rounds, and 1/N of its own
   contributions stay local):
       ours = params * (N-1)/N * (b_c + b_r * R) / H        bytes sent per node per inner step
       DP   = params * (N-1)/N * 2 * 4                      (reduce-scatter + all-gather, fp32)
   with b_c and b_r the contribution and record codecs' bytes per parameter and R the merges per fragment
   per H steps (1 when every round merges all N learners, up to N when each contribution is merged alone).
   The ratio 8H / (b_c + b_r R) depends on neither the model size nor N.
2. Measured: a real 2-node swarm (``python -m node node``, node 1 bootstrapping from node 0's addresses,
   ``--threads 1``) trains for ``--duration`` seconds after a warm-up; bytes sent and received (transport
   payloads, from each node's status) and inner steps are differenced over that window.
3. Throughput: the same learner configuration alone, as N standalone processes running a plain
   ``Learner.train_step`` loop with one torch thread and no network, side by side (so they share the CPU as
   the swarm's nodes do), half before and half after the swarm run; tokens/s inside the swarm / alone.

    python bench/swarm.py              # ~2.5 min on two CPU cores (50 s measured after 10 s warm-up)
    python bench/swarm.py --quick      # smoke run, ~1.5 min (16 s measured)
    python bench/swarm.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from swarm_report import analytic, analytic_rows, codec_bytes, report

from node.learner.learner import InnerConfig, plan_for
from node.learner.task import TaskConfig, load_task
from node.local.launcher import Child, poll, start_node, stop_all, wait_ready
from node.swarm.settings import NodeSettings
from protocol.config import DEFAULT_FRAGMENTS, ProtocolConfig


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _stat(path: str) -> list[str] | None:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            raw = fh.read()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()  # fields from 3 (state) on; comm may hold spaces


def cpu_seconds(pid: int) -> tuple[float, float, dict[str, float]]:
    """CPU seconds of the process tree rooted at ``pid``, of the process itself, and of each of its threads.

    Linux /proc only; elsewhere zeros.
    """
    if not os.path.isdir(f"/proc/{pid}/task"):
        return 0.0, 0.0, {}
    tick = os.sysconf("SC_CLK_TCK")
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (f := _stat(f"/proc/{d}/stat")) is not None:
            procs[int(d)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)
    tree, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in procs:
            tree += procs[p][1]
            todo += [c for c, (pp, _) in procs.items() if pp == p]
    threads = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        if (f := _stat(f"/proc/{pid}/task/{t}/stat")) is not None:
            threads[t] = (int(f[11]) + int(f[12])) / tick
    return tree, procs.get(pid, (0, 0.0))[1], threads


# ------------------------------------------------------------------------------------------ alone learners
def alone_worker(seconds: float, warm_s: float, seed: int, batch: int) -> int:
    """Child process: a plain train_step loop of the node's default learner, one torch thread, no network."""
    import torch

    from node.learner.learner import Learner

    torch.set_num_threads(1)
    task = load_task(None, TaskConfig(batch_size=batch))
    lrn = Learner(
        "alone", task, ProtocolConfig(), InnerConfig(), NodeSettings().steps, seed, torch.device("cpu")
    )
    t_end_warm = time.perf_counter() + warm_s
    while time.perf_counter() < t_end_warm:
        lrn.train_step()
    steps, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        lrn.train_step()
        steps += 1
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    tokens = steps * task.tokens_per_batch
    doc = {"steps": steps, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}
    print(json.dumps({**doc, "cpu_cores": cpu / elapsed}))
    return 0


def run_alone(n: int, seconds: float, warm_s: float, label: str, batch: int) -> list[dict]:
    log(f"[alone {label}] {n} standalone learners side by side for {warm_s:g} s warm-up + {seconds:g} s")
    cmd = [sys.executable, os.path.abspath(__file__), "--alone-worker", str(seconds), "--warm", str(warm_s)]
    cmd += ["--batch-size", str(batch)]
    procs: list[subprocess.Popen] = []
    try:
        for i in range(n):
            procs.append(
                subprocess.Popen(
                    [*cmd, "--seed", str(i + 1)], stdout=subprocess.PIPE, text=True, start_new_session=True
                )
            )
        out = []
        deadline = time.monotonic() + seconds + warm_s + 120
        for p in procs:
            stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"alone learner exited with code {p.returncode}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        log(f"[alone {label}] tokens/s: " + ", ".join(f"{r['tokens_per_s']:.0f}" for r in out))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# --------------------------------------------------------------------------------------------- the swarm
def _snapshot(children: list[Child]) -> list[dict]:
    poll(children)
    snaps = []
    for c in children:
        if c.proc.poll() is not None:
            raise RuntimeError(f"node {c.index} exited with code {c.proc.returncode}; its log:\n{c.tail()}")
        if c.last is None:
            raise RuntimeError(f"node {c.index} did not answer its status endpoint ({c.url})")
        tree, own, threads = cpu_seconds(c.proc.pid)
        snaps.append({**c.last, "cpu_tree_s": tree, "cpu_own_s": own, "cpu_threads_s": threads})
    return snaps


def _contributions(state_dir: Path, peer: str, t_a: float, t_b: float) -> list[int]:
    out = []
    with open(state_dir / "events.jsonl", encoding="utf-8") as fh:
        for line in fh:
            if '"contribute"' not in line:
                continue
            r = json.loads(line)
            if r["kind"] == "contribute" and r.get("learner") == peer and t_a <= r["t"] < t_b:
                out.append(int(r["bytes"]))
    return out


def run_swarm(nodes: int, seconds: float, warm_s: float, run_dir: Path, batch: int) -> dict:
    flags = ["--threads", "1", "--swarm", f"bench-{os.getpid()}", "--batch-size", str(batch)]
    children: list[Child] = []
    try:
        log(f"[swarm] starting {nodes} nodes in {run_dir}")
        children.append(start_node(0, run_dir, flags, []))
        wait_ready(children, 180)
        for i in range(1, nodes):
            children.append(start_node(i, run_dir, flags, children[0].maddrs))
        wait_ready(children, 180)
        log(f"[swarm] up; warming up {warm_s:g} s")
        t_warm = time.monotonic() + warm_s
        while time.monotonic() < t_warm:
            time.sleep(min(1.0, max(0.0, t_warm - time.monotonic())))
        a, t_a = _snapshot(children), time.time()
        for s in a:
            if len(s["peers"]) != nodes:
                log(f"[swarm] warning: {s['peer_id'][-8:]} sees {len(s['peers'])} of {nodes} members")
        log(f"[swarm] measuring {seconds:g} s")
        t_end = time.monotonic() + seconds
        while (left := t_end - time.monotonic()) > 0:
            time.sleep(min(10.0, left))
            if time.monotonic() < t_end - 1:
                s = _snapshot(children)
                log(
                    f"[swarm] t={seconds - (t_end - time.monotonic()):4.0f}s  steps "
                    + " ".join(str(x["learner"]["steps"]) for x in s)
                    + "  MB out "
                    + " ".join(f"{x['bytes_sent'] / 1e6:.1f}" for x in s)
                )
        b, t_b = _snapshot(children), time.time()
        per_node = []
        for c, sa, sb in zip(children, a, b):
            steps = sb["learner"]["steps"] - sa["learner"]["steps"]
            contribs = _contributions(c.state_dir, sb["peer_id"], t_a, t_b)
            per_node.append(
                {
                    "node": c.index,
                    "peer": sb["peer_id"],
                    "steps": steps,
                    "seconds": sb["uptime_s"] - sa["uptime_s"],
                    "tokens_per_s": (sb["learner"]["tokens"] - sa["learner"]["tokens"])
                    / (sb["uptime_s"] - sa["uptime_s"]),
                    "sent_B": sb["bytes_sent"] - sa["bytes_sent"],
                    "received_B": sb["bytes_received"] - sa["bytes_received"],
                    "join_sent_B": sa["bytes_sent"],
                    "join_received_B": sa["bytes_received"],
                    "records_made": sb["counters"]["records_made"] - sa["counters"]["records_made"],
                    "contributions": len(contribs),
                    "contribution_B": sum(contribs),
                    "peers_seen": len(sb["peers"]),
                    "rounds_merged": sb["rounds_merged"],
                    "model_hash": sb["model_hash"],
                    "refused": sum(sb["refused"].values()),
                    # CPU in cores over the window: the node's process tree (node, DHT process, p2pd), the node
                    # process alone, and its busiest thread (the learner)
                    "cpu_cores": (sb["cpu_tree_s"] - sa["cpu_tree_s"]) / (sb["uptime_s"] - sa["uptime_s"]),
                    "node_process_cores": (sb["cpu_own_s"] - sa["cpu_own_s"])
                    / (sb["uptime_s"] - sa["uptime_s"]),
                    "learner_cores": max(
                        (v - sa["cpu_threads_s"].get(t, 0.0) for t, v in sb["cpu_threads_s"].items()),
                        default=0.0,
                    )
                    / (sb["uptime_s"] - sa["uptime_s"]),
                    "counters": sb["counters"],
                }
            )
        return {"nodes": per_node, "run_dir": str(run_dir), "t_a": t_a, "t_b": t_b}
    finally:
        log("[swarm] stopping nodes")
        stop_all(children, timeout_s=30)
        for c in children:  # stop_all waits and kills; make sure
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()


def heartbeat_estimate(nodes: int, fragments: int) -> int:
    """Bytes of one signed membership record as a node of this swarm publishes it (DHT traffic estimate)."""
    from dht.identity import Identity
    from dht.records import Member, sign_member

    ident = Identity.generate()
    now = time.time()
    m = Member(
        peer_id=ident.peer_id,
        addrs=(f"/ip4/127.0.0.1/tcp/40000/p2p/{ident.peer_id}",),
        version="ddiloco/0.3",
        issued_at=now,
        expires_at=now + 6.0,
        tokens_per_s=12345.678,
        heads={str(p): [120, "f" * 64, nodes, 123456.0] for p in range(fragments)},
        step=2880,
        leases={"3": 121},
    )
    return len(sign_member("ddiloco-local", ident, m))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=50.0, help="measured seconds in the swarm")
    ap.add_argument("--warm", type=float, default=10.0, help="warm-up seconds before measuring")
    ap.add_argument("--nodes", type=int, default=2, help="swarm nodes (and standalone learners)")
    ap.add_argument("--quick", action="store_true", help="short run: 16 s measured, 5 s warm-up")
    ap.add_argument("--keep", action="store_true", help="keep the nodes' state folders")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=TaskConfig().batch_size,
        help="sequences per inner step (the default's steps are short on a CPU: the network side's fixed cost per "
        "step weighs more)",
    )
    ap.add_argument("--alone-worker", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.alone_worker is not None:
        return alone_worker(a.alone_worker, a.warm, a.seed, a.batch_size)
    if a.quick:
        a.duration, a.warm = 16.0, 5.0
    if a.nodes < 2:
        ap.error("--nodes must be >= 2")

    t_start = time.monotonic()
    load_start = os.getloadavg()[0]
    pcfg = ProtocolConfig(fragments=DEFAULT_FRAGMENTS)  # the default a model of 24+ tensors gets
    tcfg = TaskConfig(batch_size=a.batch_size)
    task = load_task(None, tcfg)
    model = task.new_model()
    plan = plan_for(task, model, pcfg)
    shapes = {n: p.numel() for n, p in model.named_parameters()}
    params = plan.total_numel
    exact_b = sum(codec_bytes(k, pcfg.codec, pcfg.codec_block) for k in shapes.values()) / params
    exact_r = sum(codec_bytes(k, pcfg.record_codec, pcfg.codec_block) for k in shapes.values()) / params
    rows = analytic_rows(params, exact_b, exact_r, a.nodes, pcfg)

    half, alone_warm = a.duration / 2, min(3.0, a.warm)
    before = run_alone(a.nodes, half, alone_warm, "before", a.batch_size)
    run_dir = Path(tempfile.mkdtemp(prefix="ddiloco-bench-swarm-"))
    try:
        sw = run_swarm(a.nodes, a.duration, a.warm, run_dir, a.batch_size)
    finally:
        if not a.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    after = run_alone(a.nodes, half, alone_warm, "after", a.batch_size)

    nodes = sw["nodes"]
    steps = sum(x["steps"] for x in nodes)
    merges = sum(x["records_made"] for x in nodes)
    contribs = sum(x["contributions"] for x in nodes)
    per_learner_syncs = contribs / a.nodes  # fragment-syncs per learner in the window
    r_meas = merges / per_learner_syncs if per_learner_syncs else float("nan")
    dp = analytic("", params, a.nodes, pcfg.sync_every, exact_b, b_record=exact_r)["dp_B"]
    sent = sum(x["sent_B"] for x in nodes) / steps
    settings = NodeSettings()
    rec_b = heartbeat_estimate(a.nodes, pcfg.fragments)
    steps_per_s = steps / sum(x["seconds"] for x in nodes)
    measured = {
        **sw,
        "seconds": a.duration,
        "warm_s": a.warm,
        "sent_per_step_B": sent,
        "received_per_step_B": sum(x["received_B"] for x in nodes) / steps,
        "dp_B": dp,
        "ratio": dp / sent,
        "contributions_per_merge": contribs / merges if merges else float("nan"),
        "merges_per_sync": r_meas,
        "analytic_at_R_B": analytic("", params, a.nodes, pcfg.sync_every, exact_b, r_meas, exact_r)["ours_B"],
        "member_record_B": rec_b,
        "heartbeat_s": settings.heartbeat_s,
        "heartbeat_per_step_B": (2 * a.nodes - 1) * rec_b / settings.heartbeat_s / steps_per_s,
    }
    alone_tps = [(b["tokens"] + f["tokens"]) / (b["seconds"] + f["seconds"]) for b, f in zip(before, after)]
    alone_mean = sum(alone_tps) / len(alone_tps)
    throughput = {
        "alone_before": before,
        "alone_after": after,
        "alone_per_learner": alone_tps,
        "alone_mean": alone_mean,
        "ratios": [x["tokens_per_s"] / alone_mean for x in nodes],
    }
    res = {
        "settings": {
            "dim": tcfg.model.dim,
            "layers": tcfg.model.layers,
            "params": params,
            "tokens_per_step": task.tokens_per_batch,
            "fragments": pcfg.fragments,
            "sync_every": pcfg.sync_every,
            "overlap": pcfg.overlap,
            "quorum": pcfg.quorum,
            "codec": pcfg.codec,
            "codec_block": pcfg.codec_block,
            "codec_bytes_per_param": exact_b,
            "record_codec": pcfg.record_codec,
            "record_bytes_per_param": exact_r,
            "nodes": a.nodes,
        },
        "analytic": rows,
        "measured": measured,
        "throughput": throughput,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg()[0],
        "wall_s": time.monotonic() - t_start,
    }
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
