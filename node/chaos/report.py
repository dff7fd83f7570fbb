"""What a chaos run of real nodes measured, from the nodes' own event records (``STATE_DIR/events.jsonl``).

Goodput is ``protocol.goodput.compute_goodput`` — the one definition (docs/design.md, section 2) — over
the nodes' records merged into one stream, with what only the harness knows added as records of the kinds
it reads:

- one ``run`` record for the measured window: from the moment every node was up to the moment the learners
  were paused at the end (start-up and the final quiet period are outside it), every node a learner;
- ``down``/``up`` for each kill (down from the kill to the restarted node's ``join``) and each SIGSTOP;
- a kill -9 loses what the learner had not yet contributed: each node's records are cut into segments at
  its kills, step numbers are made unique per segment (a restarted learner resumes from its checkpoint and
  repeats step numbers), and each killed segment ends with a contribution of every fragment that was never
  merged, so its uncontributed steps count as dropped. Work the checkpoint kept and the restarted node
  contributed later is not credited back: the figure is a lower bound;
- a step that a SIGSTOP cut in two is shortened by the stopped time (the learner was not computing);
- a merge record that lost a split brain (the losing side of a ``fork`` record) is left out: the swarm
  re-synced to the other chain, so what it merged is not in the kept model. Records built on the losing
  one before the re-sync still count (a small overstatement).

Stalls are read from every node's ``merge`` records: the longest interval of the window in which no
fragment merged anywhere (global), and the longest for any one fragment (what killing its synchroniser
costs). Pure: records in, numbers out.
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass

from protocol.goodput import Goodput, compute_goodput

SEGMENT = 10**9  # step numbers of a node's k-th segment become k * SEGMENT + step
WINDOW_FILE = (
    "chaos.json"  # in a chaos run's folder: its window, peer ids and outages (``ChaosRun.write_window``)
)


@dataclass(frozen=True)
class Outage:
    """A node out of the swarm: killed (until its restart joined) or stopped (until SIGCONT)."""

    node: int
    kind: str
    """'kill' or 'pause'"""
    t0: float
    """wall time of the kill -9 or SIGSTOP"""
    t1: float | None = None
    """pause: wall time of SIGCONT (None: still stopped at the end); kill: unused, the join record says"""


def _joins(records: list[dict]) -> list[float]:
    return sorted(r["t"] for r in records if r.get("kind") == "join")


def lost_to_forks(events: dict[int, list[dict]]) -> set[str]:
    """The hashes of the records that lost a split brain (the losing side of each ``fork`` record)."""
    return {
        r["ours"] if r.get("winner") == "theirs" else r["theirs"]
        for recs in events.values()
        for r in recs
        if r.get("kind") == "fork"
    }


def goodput_records(
    events: dict[int, list[dict]],
    peer_ids: dict[int, str],
    outages: list[Outage],
    t0: float,
    t1: float,
) -> list[dict]:
    """One stream of records that ``compute_goodput`` scores for the window [t0, t1] (see module doc)."""
    runs = [r for recs in events.values() for r in recs if r.get("kind") == "run"]
    shares = runs[0]["shares"] if runs else None
    if shares is None:
        raise ValueError(
            "no node wrote a 'run' record (none stopped cleanly); the fragment shares are unknown"
        )
    out: list[dict] = [
        {
            "kind": "run",
            "t0": t0,
            "t1": t1,
            "learners": [peer_ids[i] for i in sorted(peer_ids)],
            "shares": shares,
            "overlap": runs[0].get("overlap", 0),
        }
    ]
    # A record that lost a split brain is not in the model the swarm kept: its merge does not count.
    lost = lost_to_forks(events)
    for i, recs in events.items():
        learner = peer_ids[i]
        kills = sorted(o.t0 for o in outages if o.node == i and o.kind == "kill")
        pauses = [
            (o.t0, o.t1 if o.t1 is not None else t1) for o in outages if o.node == i and o.kind == "pause"
        ]
        joins = _joins(recs)
        for k in kills:
            out.append({"kind": "down", "learner": learner, "t": max(k, t0)})
            j = bisect.bisect_right(joins, k)
            if j < len(joins) and joins[j] < t1:
                out.append({"kind": "up", "learner": learner, "t": max(joins[j], t0)})
        for a, b in pauses:
            out.append({"kind": "down", "learner": learner, "t": max(a, t0)})
            out.append({"kind": "up", "learner": learner, "t": min(b, t1)})
        last_step: dict[int, int] = {}
        for r in recs:
            kind = r.get("kind")
            if kind == "merge" and r.get("hash") not in lost:
                out.append(
                    {"kind": "merge", "fragment": r["fragment"], "round": r["round"], "cids": r["cids"]}
                )
            elif kind == "contribute" or (kind == "adopt" and "step" in r):
                seg = bisect.bisect_left(kills, r["t"])
                out.append({**r, "step": seg * SEGMENT + r["step"]})
            elif kind == "step":
                seg = bisect.bisect_left(kills, r["t0"])
                step = seg * SEGMENT + r["step"]
                last_step[seg] = max(last_step.get(seg, step), step)
                a, b = r["t0"], min(r["t1"], t1)
                if a < t0 or a >= t1:
                    continue
                stopped = sum(max(0.0, min(b, pe) - max(a, ps)) for ps, pe in pauses)
                out.append(
                    {"kind": "step", "learner": learner, "step": step, "t0": a, "t1": max(a, b - stopped)}
                )
        for seg, step in last_step.items():
            if seg < len(kills):  # this segment ended in a kill -9: what it had not sent is lost with it
                for p in range(len(shares)):
                    out.append(
                        {
                            "kind": "adopt",
                            "learner": learner,
                            "fragment": p,
                            "step": step,
                            "kept": False,
                            "lost": True,
                        }
                    )
    return out


def chaos_goodput(
    events: dict[int, list[dict]], peer_ids: dict[int, str], outages: list[Outage], t0: float, t1: float
) -> Goodput:
    return compute_goodput(goodput_records(events, peer_ids, outages, t0, t1))


def longest_gap(times: list[float], t0: float, t1: float) -> tuple[float, float]:
    """The longest interval of [t0, t1] with none of ``times`` in it: (length, start)."""
    pts = [t0, *sorted(t for t in times if t0 < t < t1), t1]
    best, at = 0.0, t0
    for a, b in zip(pts, pts[1:]):
        if b - a > best:
            best, at = b - a, a
    return best, at


def merge_times(events: dict[int, list[dict]]) -> dict[int, list[float]]:
    """Fragment -> times any node applied a merge record of it (one record lands on every node: the first
    time a (fragment, round, hash) is seen is when it was merged)."""
    first: dict[tuple, float] = {}
    for recs in events.values():
        for r in recs:
            if r.get("kind") == "merge":
                key = (r["fragment"], r["round"], r.get("hash"))
                first[key] = min(first.get(key, r["t"]), r["t"])
    out: dict[int, list[float]] = {}
    for (p, _, _), t in first.items():
        out.setdefault(p, []).append(t)
    return {p: sorted(ts) for p, ts in sorted(out.items())}


def stalls(events: dict[int, list[dict]], t0: float, t1: float) -> dict:
    per = merge_times(events)
    everything = [t for ts in per.values() for t in ts]
    g, g_at = longest_gap(everything, t0, t1)
    frag = {p: longest_gap(ts, t0, t1)[0] for p, ts in per.items()}
    worst = max(frag.items(), key=lambda kv: kv[1], default=(None, 0.0))
    return {
        "global_s": g,
        "global_at_s": g_at - t0,
        "fragment_s": worst[1],
        "fragment": worst[0],
        "merges": len(everything),
    }


def first_merge_after(events: dict[int, list[dict]], fragment: int, t: float) -> float | None:
    """Seconds from ``t`` to the next merge of ``fragment`` anywhere (None: none followed)."""
    ts = merge_times(events).get(fragment, [])
    i = bisect.bisect_right(ts, t)
    return ts[i] - t if i < len(ts) else None


def merges_between(events: dict[int, list[dict]], a: float, b: float) -> int:
    return sum(1 for ts in merge_times(events).values() for t in ts if a < t < b)


def steps_between(records: list[dict], a: float, b: float) -> int:
    return sum(1 for r in records if r.get("kind") == "step" and a < r["t1"] < b)


def outage_windows(events: dict[int, list[dict]], outages: list[Outage], t0: float, t1: float) -> list[dict]:
    """For each outage: how long the node was out (a kill: until its restarted life joined), and what the
    rest of the swarm did meanwhile — merges anywhere, and steps of each node that was never out then."""
    spans = []  # (outage, end or None: still out at the end)
    for o in outages:
        end = o.t1
        if o.kind == "kill":
            joins = [t for t in _joins(events.get(o.node, [])) if t > o.t0]
            end = joins[0] if joins else None
        spans.append((o, end))
    out = []
    for o, end in spans:
        b = min(end, t1) if end is not None else t1
        others = [
            i for i in events
            if i != o.node and not any(x.node == i and x.t0 < b and (e or t1) > o.t0 for x, e in spans)
        ]  # fmt: skip
        out.append(
            {
                "node": o.node,
                "kind": o.kind,
                "from_s": round(o.t0 - t0, 1),
                "out_s": round((end if end is not None else t1) - o.t0, 1),
                "back": end is not None,
                "merges_meanwhile": merges_between(events, o.t0, b),
                "steps_meanwhile": {i: steps_between(events[i], o.t0, b) for i in others},
            }
        )
    return out


def run_report(run) -> dict:
    """The report of a finished (or interrupted) ``node.chaos.harness.ChaosRun``: the numbers above, scored
    from the nodes' event records and final files inside the run's window."""
    cfg = run.cfg
    t0, t1 = run.t0, run.t1 or time.time()
    rep: dict = {
        "nodes": cfg.nodes,
        "seed": cfg.seed,
        "netns": cfg.netns,
        "netns_rate": cfg.netns_rate,
        "netns_cpu": cfg.netns_cpu,
        "window_s": round(t1 - t0, 1) if t0 else 0.0,
        "run_dir": str(cfg.run_dir),
        "interrupted": run.interrupted,
        "settled": run.settled,
        "plan": [vars(f) for f in run.plan],
        "faults": run.applied,
    }
    if not t0:
        return rep
    ev = run.events()
    try:
        rep["goodput"] = chaos_goodput(ev, run.peer_ids, run.outages, t0, t1).as_dict()
    except ValueError as e:
        rep["goodput"] = {"error": str(e)}
    st = {k: round(v, 2) if isinstance(v, float) else v for k, v in stalls(ev, t0, t1).items()}
    rep["stall"] = {**st, "bound_s": cfg.stall_bound_s, "ok": st["global_s"] <= cfg.stall_bound_s}
    rep["outages"] = outage_windows(ev, run.outages, t0, t1)
    for rec in run.applied:
        if rec.get("kind") == "kill_sync" and rec.get("node") is not None:
            gap = first_merge_after(ev, rec["fragment"], rec["t"])
            rec["fragment_merged_again_s"] = None if gap is None else round(gap, 2)
    finals = {}
    for i, s in run.slots.items():
        f = s.child.state_dir / "final.json"
        if s.state == "running" and f.exists():
            finals[i] = json.loads(f.read_text())
    evals = [r for r in ev.get(0, []) if r.get("kind") == "eval"]
    losses = [f["eval_loss"] for f in finals.values() if f.get("eval_loss") is not None]
    hashes = {i: f["model_hash"] for i, f in finals.items()}
    rep.update(
        eval_loss_initial=evals[0]["loss"] if evals else None,
        eval_loss_final=min(losses) if losses else None,
        survivors=sorted(finals),
        hashes=hashes,
        equal_hashes=len(set(hashes.values())) == 1,
        tokens_merged=max((f["tokens_merged"] for f in finals.values()), default=0.0),
        rounds_merged=max((f["rounds_merged"] for f in finals.values()), default=0),
    )
    per = []
    for i, s in sorted(run.slots.items()):
        lasts = [c.last for c in s.lives if c.last]
        per.append(
            {
                "node": i,
                "peer": run.peer_ids.get(i, ""),
                "lives": len(s.lives),
                "state": s.state,
                "steps": steps_between(ev[i], t0, t1),
                "mb_sent": round(sum(x["bytes_sent"] for x in lasts) / 1e6, 2),
                "mb_received": round(sum(x["bytes_received"] for x in lasts) / 1e6, 2),
                "exit_code": s.child.proc.returncode,
                **{k: sum(x["counters"].get(k, 0) for x in lasts) for k in ("failovers", "forks", "resyncs")},
                "hash": hashes.get(i),
            }
        )
    rep["per_node"] = per
    tps = next(
        (c.last["learner"]["tokens_per_step"] for s in run.slots.values() for c in s.lives if c.last), 0
    )
    rep["tokens_trained"] = tps * sum(n["steps"] for n in per)  # steps inside the window
    return rep
