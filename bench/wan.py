"""The WAN comparison: ours, synchronous DiLoCo and data-parallel under bandwidth caps.

Tokens/s of Decoupled DiLoCo against synchronous DiLoCo and data-parallel on the same nodes, model and
bandwidth caps, and how the ratio moves with the cap.

For each cap of ``--caps`` and each system, N processes run in N network namespaces (``node.chaos.netns``: one
per node on a bridge, every node's link capped by ``tc tbf`` in both directions, no added delay):

  ours     real ``ddiloco node`` processes with default flags (decoupled: P = H = 24, tau = 2, K = 1 with
           the grace window, int4 contributions and records)
  ours-q   the same with ``--quorum N-1``: a round waits for every learner but one (fuller rounds, fewer
           records: the setting for links of a few Mbit/s)
  sync     the same nodes with ``--system sync-diloco`` (one fragment, every live learner the quorum, plain
           mean, each learner waits after contributing until the merged model is back), the same H
  dp-fp32  ``bench/wan_dp.py``: N DDP workers in one gloo process group across the namespaces (DDP's
           gradient buckets all-reduced during the backward pass, fp32 gradients: DDP's default)
  dp-bf16  the same with gradients all-reduced in bf16, as DDP's ``bf16_compress_hook`` does (half the bytes)
  sync-ar  synchronous DiLoCo as its authors run it (``bench/wan_dp.py --mode diloco``): N workers in one
           gloo process group, H inner steps each, then an all-reduce of the fp32 outer gradients and the
           same outer step everywhere (the same H, outer lr and momentum as ours)

all with the embedded default task and model (same initial weights), the same per-learner batch and lr
schedule, one torch thread per process. Nodes start together (each paused once up, all resumed when the
last has joined), as the DP workers do. Once every process has taken a step (sync: once a round merged
every learner), a warm-up, then a window of ``--duration`` seconds: tokens/s of the whole swarm (every
learner's steps, each step's tokens credited by the share of it inside the window), bytes on each node's
link (interface counters: all traffic, DHT and headers included) and CPU of each process tree. Every system evaluates its (global) model every ``--eval-every-s`` on the same fixed
batches: eval loss is compared at the end and at equal tokens (tokens of all learners since the run's first
step; linear interpolation between the two evaluations around the count).

Under a low cap DP trains few tokens in the window. A DP step's arithmetic does not depend on the link, so
after the capped runs each DP system runs once more on uncapped links, to the most tokens any of ours
reached, evaluating on a step grid and after every step a capped DP run evaluated at (the report gives the
largest difference there: it must be 0). Against DP, eval loss is compared at the most tokens both curves
cover. ``--no-dp-reference`` skips it.

    python bench/wan.py                  # root (network namespaces); ~45 min on two CPU cores
    python bench/wan.py --quick          # two caps, 20 s windows, ~11 min
    python bench/wan.py --render RUN_DIR/wan.json     # the tables of a saved run
    python bench/wan.py --caps 10mbit --systems ours,dp-bf16 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import wan_dp
from wan_config import NODE_SYSTEM, SYSTEMS, WanConfig, burst_for, log
from wan_dp import DP_PORT
from wan_nodes import run_nodes, until, window
from wan_report import analyze, render

from node.chaos.netns import NetLab
from node.common.events import read_events
from node.local.launcher import LaunchError
from protocol.errors import DDiLoCoError


# ------------------------------------------------------------------------------------------ data-parallel
def run_dp(cfg: WanConfig, lab: NetLab, system: str, run_dir: Path, say: Callable[[str], None]) -> dict:
    """A gloo system: ``dp-fp32``, ``dp-bf16`` (DDP), or ``sync-ar`` (synchronous DiLoCo, all-reduce)."""
    if system == "sync-ar":
        grads, extra = "fp32", ["--mode", "diloco", "--sync-every", str(cfg.sync_every)]
        say(f"starting {cfg.nodes} synchronous DiLoCo workers (gloo all-reduce of fp32 outer gradients)")
    else:
        grads, extra = system.split("-")[1], []
        say(f"starting {cfg.nodes} DDP workers (gloo, {grads} gradients)")
    procs = wan_dp.start_workers(
        lab,
        run_dir,
        DP_PORT,
        grads,
        cfg.eval_every_s,
        cfg.batch_size,
        cfg.gloo_timeout_s,
        cfg.steps,
        cfg.seed,
        extra,
    )
    ev_path = run_dir / "events.jsonl"

    def check() -> None:
        for r, p in enumerate(procs):
            if p.poll() is not None:
                tail = (run_dir / f"worker-{r}.log").read_text(errors="replace").splitlines()[-15:]
                raise LaunchError(
                    f"DP worker {r} exited with code {p.returncode}; its log:\n" + "\n".join(tail)
                )

    def steps() -> list[dict]:
        return [r for r in read_events(ev_path) if r["kind"] == "step"]

    def progress() -> str:
        check()
        st = steps()
        last = st[-1]["t1"] - st[-1]["t0"] if st else 0.0
        return f"steps {len(st)}  last step {last:.2f} s"

    try:
        until(lambda: bool(steps()), cfg.start_timeout_s, "the DP group's first step", check)
        win = window(cfg, lab, say, progress, [p.pid for p in procs])
        # The last step may be long (a slow link) and is followed by an evaluation: allow for both.
        wan_dp.stop_workers(procs, run_dir, timeout_s=cfg.gloo_timeout_s)
        codes = [p.returncode for p in procs]
        if any(codes):
            say(f"DP workers exited with codes {codes}")
    finally:
        wan_dp.kill_workers(procs)
    ev = read_events(ev_path)
    final_path = run_dir / "final-0.json"
    final = json.loads(final_path.read_text()) if final_path.exists() else {}
    learner = {
        "steps": [(r["t0"], r["t1"], r["tokens"]) for r in ev if r["kind"] == "step"],
        "evals": [(r["t"], r["loss"]) for r in ev if r["kind"] == "eval"],
        "eval_steps": [(r["step"], r["loss"]) for r in ev if r["kind"] == "eval"],
        "merges": final.get("rounds") or 0,  # sync-ar's rounds; DP merges nothing
        "final": final,
    }
    tokens_per_step = learner["steps"][0][2] if learner["steps"] else 0
    # one record stream for the whole group: its steps are every worker's steps at once
    return {
        **win,
        "learners": [learner],
        "settled": True,
        "tokens_per_step": tokens_per_step,
        "world": cfg.nodes,
    }


# ------------------------------------------------------------------------------------------------ the runs
def run_all(cfg: WanConfig) -> dict:
    cfg.check()
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict]] = {}
    t_start = time.monotonic()
    tag = f"w{os.getpid() % 10000}"
    for cap in cfg.caps:
        results[cap] = {}
        for system in cfg.systems:
            run_dir = cfg.run_dir / cap / system
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)

            def say(msg: str, cap: str = cap, system: str = system) -> None:
                log(f"[{time.monotonic() - t_start:6.0f}s {cap} {system}] {msg}")

            rate = "" if cap == "none" else cap
            lab = NetLab(
                cfg.nodes,
                rate,
                tag=tag,
                burst=burst_for(cap) if rate else "32kbit",
                cpu=cfg.cpu_per_node,
                rtt_ms=cfg.rtt_ms,
            ).open()
            try:
                if system in NODE_SYSTEM:
                    raw = run_nodes(cfg, lab, system, run_dir, say)
                else:
                    raw = run_dp(cfg, lab, system, run_dir, say)
                res = analyze(raw, cfg.nodes)
                if system.startswith("dp-"):
                    res["raw"] = {"learners": raw["learners"], "tokens_per_step": raw["tokens_per_step"]}
                say(f"{res['tokens_per_s']:,.0f} tokens/s, final eval {res['final_loss']:.3f}; {run_dir}")
            except (DDiLoCoError, OSError) as e:  # one failed run is reported; the others still run
                res = {"error": str(e)}
                say(f"FAILED: {e}")
            finally:
                lab.close()
            results[cap][system] = res
            doc = {
                "config": {**asdict(cfg), "run_dir": str(cfg.run_dir)},
                "results": results,
                "wall_s": time.monotonic() - t_start,
                "cpus": os.cpu_count(),
            }
            (cfg.run_dir / "wan.json").write_text(json.dumps(doc, indent=1))  # kept if a later run fails
    if cfg.dp_reference:
        doc["reference"] = {}
        for system in [s for s in cfg.systems if s.startswith("dp-")]:
            ours = [
                r
                for row in results.values()
                for s, r in row.items()
                if s.startswith("ours") and "error" not in r
            ]
            raws = [r for row in results.values() for s, r in row.items() if s == system and "raw" in r]
            if not ours or not raws:
                continue
            run_dir = cfg.run_dir / "reference" / system
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)

            def say(msg: str, system: str = system) -> None:
                log(f"[{time.monotonic() - t_start:6.0f}s reference {system}] {msg}")

            tokens = max(r["tokens_total"] for r in ours)
            try:
                ref = wan_dp.run_reference(
                    cfg, system.split("-")[1], tokens, [r["raw"] for r in raws], run_dir, say
                )
                gap = "-" if ref["max_gap"] is None else f"{ref['max_gap']:.2g}"
                say(
                    f"{ref['tokens_total']:,} tokens; {ref['compared_evals']} evals of the capped runs "
                    f"repeated, largest difference {gap}"
                )
            except (DDiLoCoError, OSError) as e:
                ref = {"error": str(e)}
                say(f"FAILED: {e}")
            doc["reference"][system] = ref
            doc["wall_s"] = time.monotonic() - t_start
            (cfg.run_dir / "wan.json").write_text(json.dumps(doc, indent=1))
    for row in results.values():
        for r in row.values():
            r.pop("raw", None)
    (cfg.run_dir / "wan.json").write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = WanConfig(Path("."))
    ap.add_argument("--nodes", type=int, default=d.nodes)
    ap.add_argument(
        "--caps", default=",".join(d.caps), help="tc rates per link and direction ('none': no cap)"
    )
    ap.add_argument("--systems", default=",".join(d.systems), help=f"of: {', '.join(SYSTEMS)}")
    ap.add_argument(
        "--duration", type=float, default=d.duration_s, help="measured seconds per system and cap"
    )
    ap.add_argument("--warm", type=float, default=d.warm_s, help="warm-up seconds before the window")
    ap.add_argument("--eval-every-s", type=float, default=d.eval_every_s)
    ap.add_argument("--sync-every", type=int, default=d.sync_every, help="H of ours and of sync DiLoCo")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step per learner")
    ap.add_argument("--node-flags", default="", help="extra flags for every node (ours and sync)")
    ap.add_argument(
        "--run-dir",
        default="",
        help="where runs write, and wan.json at the end (default: a temporary folder)",
    )
    ap.add_argument(
        "--cpu-per-node",
        type=float,
        default=None,
        help="CPU cores each node may use (a cgroup quota, as if on a host of its own); 0: no quota "
        "(default: the machine's cores / --nodes)",
    )
    ap.add_argument(
        "--no-dp-reference",
        action="store_true",
        help="skip the uncapped DP run that gives DP's eval loss at ours' token counts",
    )
    ap.add_argument(
        "--idle-s",
        type=float,
        default=d.idle_s,
        help="seconds of link bytes measured with every learner paused, after the window (0: none)",
    )
    ap.add_argument(
        "--rtt-ms",
        type=float,
        default=d.rtt_ms,
        help="a round trip added between every two nodes, every system: a delay line in the hub holds each "
        "packet half of it (default: none)",
    )
    ap.add_argument(
        "--seed", type=int, default=d.seed, help="data seed: node and DP rank i read with seed*1000+i+1"
    )
    ap.add_argument("--quick", action="store_true", help="caps 100mbit,10mbit; 20 s windows after 5 s")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout instead of tables")
    ap.add_argument("--render", default="", help="print the tables of a saved run (its wan.json) and exit")
    a = ap.parse_args(argv)
    if a.render:
        print(render(json.loads(Path(a.render).read_text())))
        return 0
    if a.quick:
        a.caps, a.duration, a.warm, a.eval_every_s = "100mbit,10mbit", 20.0, 5.0, 5.0
    run_dir = Path(a.run_dir) if a.run_dir else Path(tempfile.mkdtemp(prefix="ddiloco-wan-"))
    cfg = WanConfig(
        run_dir=run_dir,
        nodes=a.nodes,
        caps=tuple(c.strip() for c in a.caps.split(",") if c.strip()),
        systems=tuple(s.strip() for s in a.systems.split(",") if s.strip()),
        duration_s=a.duration,
        warm_s=a.warm,
        eval_every_s=a.eval_every_s,
        sync_every=a.sync_every,
        batch_size=a.batch_size,
        node_flags=a.node_flags.split(),
        seed=a.seed,
        dp_reference=not a.no_dp_reference,
        idle_s=a.idle_s,
        rtt_ms=a.rtt_ms,
        cpu_per_node=(os.cpu_count() or 1) / a.nodes if a.cpu_per_node is None else a.cpu_per_node,
    )

    def on_term(signum, frame):  # noqa: ARG001 - SIGTERM unwinds like Ctrl+C: every finally runs
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        res = run_all(cfg)
    except KeyboardInterrupt:
        log("interrupted: every process stopped, every namespace deleted")
        return 130
    finally:
        if not a.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps(res, indent=1) if a.json else render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
