"""The runner's side of ``bench/parity.py`` and what both sides share: the systems' protocol settings, the
slowed nodes, each node's measured pace, and the runner driven to a real run's tokens, starts and pace and
scored as the nodes are (learners per merge, goodput from the moment every learner was up)."""

from __future__ import annotations

import statistics
from dataclasses import replace

from bench.parity_curves import eval_at, merged_curve
from node.common.events import EventLog
from node.learner.learner import InnerConfig
from node.learner.model import ModelConfig
from node.learner.task import TaskConfig, load_task
from node.local.run_config import LearnerPlan, NetConfig, RunConfig
from node.local.runner import run_system
from protocol.config import ProtocolConfig
from protocol.goodput import compute_goodput

LR_STEPS = 5000  # a node's default --steps: the span of every learner's lr schedule, nodes and runner alike
SLOW, JITTER = 1.2, 0.1


def runner_setup(system: str, nodes: int) -> tuple[str, ProtocolConfig]:
    if system == "decoupled-km":
        return "decoupled", ProtocolConfig(quorum=nodes, grace=False)
    if system == "decoupled-carry":
        return "decoupled", ProtocolConfig(carry=True)
    return system, ProtocolConfig()


def slow(scenario: str, i: int, nodes: int) -> bool:
    return scenario == "heterogeneous" and i >= nodes - 2


def learners_per_merge(records: list[dict]) -> float:
    """Distinct learners per merged round (a round can hold two contributions of one learner: its
    straggler of the round before and its own)."""
    merges = {
        (r["fragment"], r["round"]): len(set(r["learners"])) for r in records if r.get("kind") == "merge"
    }
    return statistics.mean(merges.values()) if merges else 0.0


def task_config(args) -> TaskConfig:
    model = ModelConfig(dim=args.dim, layers=args.layers, heads=args.heads, seq_len=args.seq_len)
    return TaskConfig(batch_size=args.batch_size, model=model)


def pace(ev: dict[int, list[dict]], nodes: int) -> list[tuple[float, float]]:
    """Each node's (mean seconds from one step's start to the next, their coefficient of variation), past
    its first 10 steps; (0, 0) for a node with too few. Four nodes sharing two cores step far from evenly
    (a coefficient of about 0.25 with no --jitter at all), and how far apart their contributions land
    decides what a round of K = M waits for."""
    out = []
    for i in range(nodes):
        t = sorted(r["t0"] for r in ev.get(i, []) if r.get("kind") == "step")
        gaps = [b - a for a, b in zip(t, t[1:])][10:]
        if len(gaps) < 10:
            out.append((0.0, 0.0))
            continue
        mean = statistics.mean(gaps)
        out.append((mean, statistics.pstdev(gaps) / mean))
    return out


def first_steps(ev: dict[int, list[dict]], nodes: int) -> list[list[float]]:
    """Each node's steps (seconds from one step's start to the next) that started before the last node's
    first step. Nodes start one after another on this host, and while the later ones import and build
    their models the first one's learner, niced, is starved: in a homogeneous run of 100 s node 0 made 2
    steps (4.5 s and 6.9 s) in the 13 s before the others' first, where its pace would make 14, each a
    round of one. The runner replays these steps as they were (``LearnerPlan.first_steps_s``)."""
    starts = {i: sorted(r["t0"] for r in ev.get(i, []) if r.get("kind") == "step") for i in range(nodes)}
    last = max((t[0] for t in starts.values() if t), default=0.0)
    return [[b - a for a, b in zip(t, t[1:]) if a < last] for t in (starts[i] for i in range(nodes))]


def runner_run(system: str, scenario: str, seed: int, tokens: int, real: dict, args) -> dict:
    """The runner on ``real``'s run: its learners start and step as the nodes did (``step_s``,
    ``join_s``, ``first_steps``), it trains as many tokens as the nodes did and evaluates at the token counts of node 0's
    evaluations, so both curves are read at T alike; its final, drained model stands for the one the
    swarm ended on after its quiet period."""
    step_s, join_s = real["step_s"], real.get("join_s", ())
    name, pcfg = runner_setup(system, args.nodes)
    if system.startswith("decoupled"):  # the protocol flags both drivers take (bench/parity.py)
        codec, h = getattr(args, "codec", pcfg.codec), getattr(args, "sync_every", 0)  # (older saved runs)
        pcfg = replace(pcfg, codec=codec, sync_every=h or pcfg.sync_every)
    starts = list(join_s) + [0.0] * (args.nodes - len(join_s))
    pace = real.get("pace") or []
    firsts = real.get("first_steps") or [[]] * args.nodes
    measured = getattr(args, "runner_pace", "measured") == "measured" and len(pace) == args.nodes
    measured = measured and all(mean > 0 for mean, _ in pace)
    plans = []
    for i in range(args.nodes):
        if measured:  # each node's own mean step and spread (uniform jitter of that variance, at most 0.9)
            mean, cv = pace[i]
            speed, jitter = step_s / mean, min(0.9, cv * 3**0.5)
        else:  # the scenario's nominal knobs
            speed = 1 / SLOW if slow(scenario, i, args.nodes) else 1.0
            jitter = JITTER if slow(scenario, i, args.nodes) else 0.0
        plans.append(LearnerPlan(speed, jitter, start_s=starts[i], first_steps_s=tuple(firsts[i])))
    plans = tuple(plans)
    run = RunConfig(
        system=name,
        learners=args.nodes,
        token_budget=max(1, int(real["tokens"])),
        eval_tokens=tuple(int(t) for t, _ in real["curve"] if t > 0),
        step_time_s=step_s,
        seed=seed,
        plans=plans,
        lr_steps=LR_STEPS,
        net=NetConfig(latency_s=0.002, bandwidth_mbps=1000.0, merge_s=0.02),
    )
    events = EventLog()
    res = run_system(load_task(None, task_config(args)), run, pcfg, InnerConfig(), events)
    # the budget's eval is of the drained model (every merge done): after every merge event
    evals = [(t, loss) for _, t, loss in res.evals[:-1]] + [(float("inf"), res.final_loss)]
    curve = [(n, loss) for n, _, loss in res.evals]
    return {
        "loss": eval_at(curve, tokens),
        "final_loss": res.final_loss,
        "curve": curve,
        "curve_m": merged_curve(events.records, evals),
        "goodput": window_goodput(events.records, max(starts)).goodput,
        "learners_per_merge": learners_per_merge(events.records),
        "tokens_per_s": res.tokens / res.virtual_s if res.virtual_s else 0.0,
    }


def window_goodput(records: list[dict], t0: float):
    """``compute_goodput`` of a runner's records from ``t0`` (its last learner's start) on, as the chaos
    report scores the nodes from the moment every node was up: a late learner's start-up is no loss."""
    out, down = [], {}
    for r in records:
        kind = r.get("kind")
        if kind == "run":
            out.append({**r, "t0": max(r["t0"], t0)})
        elif kind == "step" and r["t0"] < t0:
            continue
        elif kind == "down":
            down[r["learner"]] = r
        elif kind == "up" and r["learner"] in down:
            d = down.pop(r["learner"])
            if r["t"] > t0:
                out += [{**d, "t": max(d["t"], t0)}, r]
        else:
            out.append(r)
    out += [{**d, "t": max(d["t"], t0)} for d in down.values()]
    return compute_goodput(out)
