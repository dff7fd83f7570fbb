"""A finished run replayed: what ``ddiloco replay`` prints (docs/replay.md).

The run folder is read by ``node.chaos.tape``. ``figures`` scores one stream of records as
``node.chaos.report`` scores a chaos run (``goodput_records`` then ``protocol.goodput``): the real run's
from its tapes, a replay's from the real steps and outages with the replay's contributions, adoptions and
merges (``sim.replay``). Bytes are the contributions' and the records' payloads (what the node's counters
call payload: the ``bytes`` of each ``contribute`` record, and each merge record to the M - 1 other nodes,
sized by the record codec); headers and the swarm's control traffic are not in either.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field, replace

from node.chaos.report import Outage, goodput_records, lost_to_forks
from node.chaos.tape import Run
from protocol.codecs import CODECS
from protocol.config import ProtocolConfig
from protocol.errors import ConfigError
from protocol.goodput import compute_goodput
from sim.plan import Site, bytes_per_value, traffic
from sim.replay import LearnerTape, Replay, ReplayConfig

WHAT_IF = {
    "quorum": "K, the learners a round waits for (an integer >= 1)",
    "grace": "the adaptive grace window: on | off",
    "sync_every": "H, inner steps between two syncs of a fragment (an integer > overlap)",
    "overlap": "tau, steps a merged fragment is expected to take back (0 <= tau < H)",
    "carry": "a learner keeps what the global does not hold yet through adoptions: on | off",
    "codec": f"the outer gradients' codec on the wire and in records: {' | '.join(sorted(CODECS))}",
    "learners": "+N: N more learners, each stepping as one of the run's did (no outages)",
}


# ---------------------------------------------------------------- figures
@dataclass
class Trace:
    """What a timeline draws of one run (real or replayed): each step's verdict, the merges, the outages."""

    steps: dict = field(default_factory=dict)  # (learner, step) -> (t0, t1, useful share, dropped share)
    merges: list[tuple[float, int]] = field(default_factory=list)  # (time, learners merged)
    down: list[tuple[str, float, float]] = field(default_factory=list)  # (learner, from, to)
    learners: list[str] = field(default_factory=list)


def figures(run: Run, events: dict[int, list[dict]], peer_ids: dict[int, str], pcfg: ProtocolConfig,
            contrib_b: list[float], outages: list[Outage], trace: Trace | None = None) -> dict:  # fmt: skip
    """Goodput, rounds merged per fragment, learners per merge and payload bytes sent, for the window;
    ``trace``, if given, is filled for a timeline."""
    scored = goodput_records(events, peer_ids, outages, run.t0, run.t1)
    g = compute_goodput(scored, None if trace is None else trace.steps)
    lost = lost_to_forks(events)
    first: dict[tuple, dict] = {}
    for recs in events.values():
        for r in recs:
            if r.get("kind") == "merge" and r.get("hash") not in lost:
                key = (r["fragment"], r["round"], r.get("hash"))
                if key not in first or r["t"] < first[key]["t"]:
                    first[key] = r
    inside = [r for r in first.values() if run.t0 <= r["t"] <= run.t1]
    per_frag = [sum(1 for r in inside if r["fragment"] == p) for p in range(len(run.shares))]
    learners = [len(set(r.get("learners") or r["cids"])) for r in inside]
    sent = [r for recs in events.values() for r in recs
            if r.get("kind") == "contribute" and run.t0 <= r["t"] <= run.t1]  # fmt: skip
    m = len(peer_ids)
    ratio = bytes_per_value(pcfg.record_codec, pcfg.codec_block) / bytes_per_value(
        pcfg.codec, pcfg.codec_block
    )
    payload = sum(contrib_b[r["fragment"]] for r in sent) + sum(
        contrib_b[r["fragment"]] * ratio * (m - 1) for r in inside
    )
    steps = sum(1 for recs in events.values() for r in recs
                if r.get("kind") == "step" and run.t0 <= r["t1"] <= run.t1)  # fmt: skip
    if trace is not None:
        trace.learners = [peer_ids[i] for i in sorted(peer_ids)]
        trace.merges = sorted((r["t"], len(set(r.get("learners") or r["cids"]))) for r in inside)
        down_at: dict[str, float] = {}
        for r in scored:
            if r.get("kind") == "down":
                down_at[r["learner"]] = r["t"]
            elif r.get("kind") == "up" and r["learner"] in down_at:
                trace.down.append((r["learner"], down_at.pop(r["learner"]), r["t"]))
        trace.down += [(n, t, run.t1) for n, t in down_at.items()]
    return {
        "goodput": round(g.goodput, 4),
        "strict_goodput": round(g.strict, 4),
        "dropped_share": round(g.dropped_s / g.allocated_s, 4) if g.allocated_s > 0 else 0.0,
        "rounds_merged": sum(per_frag),
        "rounds_per_fragment": per_frag,
        "learners_per_merge": round(statistics.mean(learners), 3) if learners else 0.0,
        "contributions": len(sent),
        "payload_mb": round(payload / 1e6, 3),
        "payload_kb_per_step": round(payload / 1e3 / steps, 2) if steps else 0.0,
    }


def real_figures(run: Run, trace: Trace | None = None) -> dict:
    out = figures(run, run.events, run.peer_ids, run.protocol, run.contribution_bytes, run.outages, trace)
    out["plan_kb_per_step"] = round(planned_bytes_per_step(run) / 1e3, 2)
    return out


def planned_bytes_per_step(run: Run) -> float:
    """What ``ddiloco plan``'s byte model (``sim.plan.traffic``) says a node of this run sends per inner
    step: the model's size read back from the contributions' bytes, at the run's M, P, H and codecs."""
    pc = run.protocol
    values = sum(run.contribution_bytes) / bytes_per_value(pc.codec, pc.codec_block)
    site = Site(params=max(1.0, values), learners=len(run.nodes), codec=pc.codec, record_codec=pc.record_codec,
                block=pc.codec_block)  # fmt: skip
    return traffic(site, len(run.shares), pc.sync_every).sent_per_step_B


def parse_what_if(text: str) -> list[dict]:
    """``quorum=2,grace=off`` -> two alternatives; keys joined by spaces (``"quorum=2 grace=off"``) make
    one. Raises ConfigError naming an unknown key or a bad value."""
    alts = []
    for alt in (a.strip() for a in text.split(",")):
        if not alt:
            continue
        one: dict = {}
        for item in alt.split():
            key, eq, val = item.partition("=")
            if not eq:
                raise ConfigError(f"what-if {item!r} is invalid: write KEY=VALUE ({', '.join(WHAT_IF)})")
            if key not in WHAT_IF:
                raise ConfigError(f"what-if key {key!r} is unknown: choose from {', '.join(WHAT_IF)}")
            one[key] = _value(key, val)
        alts.append(one)
    if not alts:
        raise ConfigError(f"what-if {text!r} is empty: give KEY=VALUE ({', '.join(WHAT_IF)})")
    return alts


def _value(key: str, val: str):
    def bad() -> ConfigError:
        return ConfigError(f"what-if {key}={val!r} is invalid: {WHAT_IF[key]}")

    if key in ("grace", "carry"):
        if val not in ("on", "off", "true", "false"):
            raise bad()
        return val in ("on", "true")
    if key == "codec":
        if val not in CODECS:
            raise bad()
        return val
    if key == "learners":
        if not re.fullmatch(r"\+?\d+", val) or int(val) < 1:
            raise bad()
        return int(val)
    if not re.fullmatch(r"\d+", val):
        raise bad()
    return int(val)


def describe(alt: dict) -> str:
    return (
        " ".join(
            f"{k}={'on' if v is True else 'off' if v is False else ('+' if k == 'learners' else '') + str(v)}"
            for k, v in alt.items()
        )
        or "own settings"
    )


def replay(run: Run, alt: dict | None = None, trace: Trace | None = None) -> dict:
    """The figures of the run re-decided with its own settings changed by ``alt`` (a ``parse_what_if``
    alternative), and the synchronisers' decisions counted."""
    alt = alt or {}
    changes = {k: v for k, v in alt.items() if k in ("quorum", "grace", "sync_every", "overlap", "carry")}
    if "codec" in alt:
        changes.update(codec=alt["codec"], record_codec=alt["codec"])
    try:
        pcfg = replace(run.protocol, **changes)
    except ConfigError as e:
        raise ConfigError(f"what-if {describe(alt)} is invalid: {e}") from e
    learners = list(run.learners)
    extra = int(alt.get("learners", 0))
    base = len(learners)
    for i in range(extra):
        src = learners[i % base]
        learners.append(LearnerTape(f"extra-{i}", src.steps))
    if pcfg.quorum > len(learners):
        raise ConfigError(
            f"what-if {describe(alt)} is invalid: K={pcfg.quorum} exceeds the {len(learners)} learners"
        )
    bpv = bytes_per_value(pcfg.codec, pcfg.codec_block) / bytes_per_value(
        run.protocol.codec, run.protocol.codec_block
    )
    cfg = ReplayConfig(pcfg, tuple(run.shares), run.t0, run.t1, run.links, run.ttl_s, bpv, run.start)
    res = Replay(cfg, learners).run()
    # the tape's steps (and the harness's outages) with the replay's decisions, scored as the real run is
    events: dict[int, list[dict]] = {}
    peer_ids: dict[int, str] = {}
    steps_of = {n.peer: [r for r in n.records if r.get("kind") in ("step", "join", "run")] for n in run.nodes}
    index_of = {n.peer: n.index for n in run.nodes}
    nxt = max(index_of.values()) + 1
    for lt in learners:
        if lt.name in index_of:
            i = index_of[lt.name]
            own = steps_of[lt.name]
        else:
            i, nxt = nxt, nxt + 1
            own = [{"kind": "step", "learner": lt.name, "step": s, "t0": a, "t1": b} for s, a, b in lt.steps]
        peer_ids[i] = lt.name
        recs = [*own, *res.records[lt.name]]
        events[i] = recs
    first = min(events)
    events[first] = [*events[first], *res.merges]
    contrib_b = [b * bpv for b in run.contribution_bytes]
    out = figures(run, events, peer_ids, pcfg, contrib_b, run.outages, trace)
    out["decisions"] = res.decisions.as_dict()
    return out
