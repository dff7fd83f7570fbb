"""A finished run's folder read back and replayed: what ``ddiloco replay`` prints (docs/replay.md).

``read_run`` reads every node's tape (``node-*/events.jsonl``, the folders ``ddiloco up`` and ``ddiloco
chaos`` make, or any folder of node state folders) and refuses, naming the file, a folder the replay cannot
be true to: a missing or empty tape, a tape cut short (its last line torn, or no ``run`` record: the node
never stopped cleanly), nodes that never shared a merged round (they were not one run), a run of another
system than Decoupled DiLoCo (its learners block on the swarm, which a replay of their step times would
not reproduce).

The measured window is the chaos harness's (``chaos.json``, with its kills and pauses) where there is
one; otherwise from the moment the last node joined to the last step anywhere, with each restart of a node
(a second ``join``) taken as a kill at its tape's last record before it.

``figures`` scores one stream of records as ``node.chaos.report`` scores a chaos run
(``goodput_records`` then ``protocol.goodput``): the real run's from its tapes, a replay's from the real
steps and outages with the replay's contributions, adoptions and merges. Bytes are the contributions' and
the records' payloads (what the node's counters call payload: the ``bytes`` of each ``contribute`` record,
and each merge record to the M - 1 other nodes, sized by the record codec); headers and the swarm's control
traffic are not in either.
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from node.chaos.report import WINDOW_FILE, Outage, goodput_records, lost_to_forks
from protocol.codecs import CODECS
from protocol.config import TAPE_SETTINGS, ProtocolConfig
from protocol.errors import ConfigError
from protocol.goodput import compute_goodput
from sim.plan import Site, bytes_per_value, traffic
from sim.replay import LearnerTape, Links, Replay, ReplayConfig

WHAT_IF = {
    "quorum": "K, the learners a round waits for (an integer >= 1)",
    "grace": "the adaptive grace window: on | off",
    "sync_every": "H, inner steps between two syncs of a fragment (an integer > overlap)",
    "overlap": "tau, steps a merged fragment is expected to take back (0 <= tau < H)",
    "carry": "a learner keeps what the global does not hold yet through adoptions: on | off",
    "codec": f"the outer gradients' codec on the wire and in records: {' | '.join(sorted(CODECS))}",
    "learners": "+N: N more learners, each stepping as one of the run's did (no outages)",
}


class TapeError(ConfigError):
    """A run folder the replay cannot read or be true to; the message names the file."""


@dataclass
class NodeTape:
    index: int
    folder: Path
    records: list[dict]
    peer: str
    run: dict | None  # None: killed for good (the harness's chaos.json says so), it never stopped
    settings: dict | None  # None: the node's tape predates the settings in its join record


@dataclass
class Run:
    folder: Path
    nodes: list[NodeTape]
    t0: float
    t1: float
    outages: list[Outage]
    protocol: ProtocolConfig
    shares: list[float]
    ttl_s: float
    notes: list[str]

    @property
    def peer_ids(self) -> dict[int, str]:
        return {n.index: n.peer for n in self.nodes}

    @property
    def events(self) -> dict[int, list[dict]]:
        return {n.index: n.records for n in self.nodes}

    # What the tapes measured, read once however many what-ifs are replayed on them
    @functools.cached_property
    def links(self) -> Links:
        return measured_links(self)

    @functools.cached_property
    def contribution_bytes(self) -> list[float]:
        return contribution_bytes(self)

    @functools.cached_property
    def learners(self) -> tuple[LearnerTape, ...]:
        return tuple(learner_tapes(self))

    @functools.cached_property
    def start(self) -> tuple[tuple[int, float, float] | None, ...]:
        return start_state(self)


def _node_folders(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise TapeError(f"{folder}: no such folder (give a run folder of 'ddiloco up' or 'ddiloco chaos')")
    nodes = sorted(
        (p for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"node-\d+", p.name)),
        key=lambda p: int(p.name.split("-")[1]),
    )
    if nodes:
        return nodes
    runs = sorted(p.name for p in folder.iterdir() if p.is_dir() and any(p.glob("node-*/events.jsonl")))
    if runs:
        raise TapeError(f"{folder} holds several runs ({', '.join(runs)}): give one of them")
    raise TapeError(f"{folder}: no node-N folders (no node of a run wrote its state here)")


def _read_tape(path: Path) -> list[dict]:
    if not path.exists():
        raise TapeError(f"{path}: missing (that node wrote no tape)")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise TapeError(f"{path}: empty")
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line))
        except ValueError:
            if i == len(lines):
                raise TapeError(f"{path}: truncated (line {i}, its last, is cut short)") from None
            continue  # a kill -9 cut a line that a restarted node wrote after: as read_events reads it
    return out


def read_run(folder: str | Path) -> Run:
    folder = Path(folder)
    notes: list[str] = []
    tapes = []
    unstopped = []
    for nf in _node_folders(folder):
        recs = _read_tape(nf / "events.jsonl")
        runs = [r for r in recs if r.get("kind") == "run"]
        joins = [r for r in recs if r.get("kind") == "join"]
        if not joins:
            raise TapeError(f"{nf / 'events.jsonl'}: no 'join' record (not a node's tape)")
        if not runs:
            unstopped.append(len(tapes))
        settings = joins[-1].get("settings")
        tapes.append(NodeTape(int(nf.name.split("-")[1]), nf, recs, joins[-1]["learner"],
                              runs[-1] if runs else None, settings))  # fmt: skip
    _check_one_run(tapes)
    known = [t for t in tapes if t.settings is not None]
    if known:
        first = known[0].settings
        for t in known[1:]:
            diff = [k for k in TAPE_SETTINGS if t.settings.get(k) != first.get(k)]
            if diff:
                raise TapeError(
                    f"{t.folder.name} and {known[0].folder.name} ran with different settings ({', '.join(diff)}): "
                    "not one run, or one the replay cannot re-decide with one set of rules"
                )
        system = first.get("system", "decoupled")
        if system != "decoupled":
            raise TapeError(
                f"{known[0].folder.name} ran system={system}: replay re-decides Decoupled DiLoCo runs (the "
                "baselines' learners block on the swarm, which a replay of their step times cannot re-decide)"
            )
        pcfg = ProtocolConfig(**{k: first[k] for k in TAPE_SETTINGS if k in first})
        ttl = float(first.get("ttl_s", 8.0))
    else:
        pcfg, ttl = ProtocolConfig(), 8.0
        notes.append("the tapes carry no settings (written before they did): the defaults are assumed")
    t0, t1, outages = _window(folder, tapes, notes)
    for i in unstopped:  # no 'run' record: fine for a node the harness killed for good, else cut short
        t = tapes[i]
        last = max((r.get("t", r.get("t1", 0.0)) for r in t.records), default=0.0)
        if not any(o.node == t.index and o.kind == "kill" and o.t0 >= last - 1.0 for o in outages):
            raise TapeError(
                f"{t.folder / 'events.jsonl'}: truncated (no 'run' record: the node did not stop cleanly, or "
                "the tape was cut short)"
            )
    stopped = [t for t in tapes if t.run is not None]
    if not stopped:
        raise TapeError(f"{folder}: no node stopped cleanly (no tape has a 'run' record)")
    shares = list(stopped[0].run["shares"])
    return Run(folder, tapes, t0, t1, outages, pcfg, shares, ttl, notes)


def _check_one_run(tapes: list[NodeTape]) -> None:
    """Nodes of one run applied the same merged rounds: each must share one with the first."""
    hashes = [{r.get("hash") for r in t.records if r.get("kind") == "merge"} - {None} for t in tapes]
    for t, hs in zip(tapes[1:], hashes[1:]):
        if hashes[0] and hs and not (hs & hashes[0]):
            raise TapeError(
                f"{t.folder.name} and {tapes[0].folder.name} share no merged round: nodes of different runs"
            )


def _window(folder: Path, tapes: list[NodeTape], notes: list[str]) -> tuple[float, float, list[Outage]]:
    f = folder / WINDOW_FILE
    if f.exists():
        try:
            doc = json.loads(f.read_text())
            outages = [Outage(**o) for o in doc["outages"]]
            t0, t1 = float(doc["t0"]), float(doc["t1"])
        except (ValueError, KeyError, TypeError) as e:
            raise TapeError(f"{f}: unreadable ({e})") from e
        notes.append(f"window, kills and pauses from {WINDOW_FILE}")
        return t0, t1, outages
    outages = []
    for t in tapes:
        joins = [i for i, r in enumerate(t.records) if r.get("kind") == "join"]
        for j in joins[1:]:  # a restart: its previous life ended at its last record before this join
            before = [r.get("t", r.get("t1")) for r in t.records[:j]]
            before = [x for x in before if isinstance(x, (int, float))]
            if before:
                outages.append(Outage(t.index, "kill", max(before)))
    first_joins = [min(r["t"] for r in t.records if r.get("kind") == "join") for t in tapes]
    ends = [max((r["t1"] for r in t.records if r.get("kind") == "step"), default=0.0) for t in tapes]
    t0, t1 = max(first_joins), max(ends)
    if not t1 > t0:
        raise TapeError(f"{folder}: no learner stepped after the last node joined (nothing to replay)")
    if outages:
        notes.append(f"{len(outages)} restart(s) read from second joins, taken as kills")
    return t0, t1, outages


# ---------------------------------------------------------------- what the tape measured
def learner_tapes(run: Run) -> list[LearnerTape]:
    out = []
    for n in run.nodes:
        steps = tuple((r["step"], r["t0"], r["t1"]) for r in n.records if r.get("kind") == "step")
        kills = tuple(o.t0 for o in run.outages if o.node == n.index and o.kind == "kill")
        outs = []
        joins = sorted(r["t"] for r in n.records if r.get("kind") == "join")
        for o in run.outages:
            if o.node != n.index:
                continue
            if o.kind == "kill":
                later = [j for j in joins if j > o.t0]
                outs.append((o.t0, later[0] if later else math.inf))
            else:
                outs.append((o.t0, o.t1 if o.t1 is not None else math.inf))
        out.append(LearnerTape(n.peer, tuple(sorted(steps, key=lambda s: s[2])), tuple(outs), kills))
    return out


def measured_links(run: Run) -> Links:
    """Latencies from the tapes. Each contribution's: from its ``contribute`` (its step's end) to the
    synchroniser's ``accept``, kept per contribution and per learner. A merge's own work: its
    record on its signer against the last ``accept`` among its contributions (the lower quartile: a round
    that waited out a grace window does not count). A record's way out: the other nodes' moments of it
    against its signer's, per node (and their median). Tapes written before nodes recorded ``accept`` give one figure for
    the first two: the merge against its last contribution's step end."""
    contributes = {r["cid"]: r for n in run.nodes for r in n.records if r.get("kind") == "contribute"}
    accepted = {r["cid"]: r["t"] for n in run.nodes for r in n.records if r.get("kind") == "accept"}
    own: dict[tuple, float] = {}
    seen: dict[tuple, list[float]] = {}
    cids_of: dict[tuple, list[str]] = {}
    for n in run.nodes:
        for r in n.records:
            if r.get("kind") != "merge":
                continue
            key = (r["fragment"], r["round"], r.get("hash"))
            seen.setdefault(key, []).append(r["t"])
            cids_of[key] = r["cids"]
            if r.get("signer") == n.peer:
                own[key] = r["t"]
    fan, fanout_by = [], {}
    slack = 2 * run.ttl_s
    for n in run.nodes:
        joins = sorted(r["t"] for r in n.records if r.get("kind") == "join")
        away = [(j, j + slack) for j in joins]
        for o in run.outages:
            if o.node == n.index:
                end = o.t1 if o.kind == "pause" else next((j for j in joins if j > o.t0), None)
                away.append((o.t0, (math.inf if end is None else end) + slack))
        for r in n.records:
            if r.get("kind") == "merge" and r.get("signer") != n.peer:
                t = own.get((r["fragment"], r["round"], r.get("hash")))
                # a record a node took in while out or catching up after (a kill's restart, a pause, its
                # join) says how long it was out, not how long a record takes: left out of the draws
                if t is not None and r["t"] >= t and not any(a <= t <= b for a, b in away):
                    fan.append(r["t"] - t)
                    fanout_by.setdefault(n.peer, []).append(r["t"] - t)
    fanout = statistics.median(fan) if fan else 0.0
    # and one that took ten times the median, or a second past it, was caught up (a re-sync, a node behind),
    # not sent: what a replay draws from is the way records go out
    cut = max(10 * fanout, fanout + 1.0)
    fanout_by = {k: [x for x in v if x <= cut] for k, v in fanout_by.items()}
    delays: dict[tuple, float] = {}
    per: dict[str, list[float]] = {}
    for cid, t in accepted.items():
        c = contributes.get(cid)
        if c is not None:
            d = max(0.0, t - c["t"])
            delays[(c["learner"], c["fragment"], c["step"])] = d
            per.setdefault(c["learner"], []).append(d)
    if delays:
        work = []
        for key, t in own.items():
            took = [accepted[c] for c in cids_of[key] if c in accepted]
            if took:
                work.append(max(0.0, t - max(took)))
        all_d = list(delays.values())
        return Links(
            contrib_s=statistics.median(all_d),
            fanout_s=fanout,
            floor_s=min(min(all_d), fanout) if fan else min(all_d),
            merge_s=_quantile(work, 0.25) if work else 0.0,
            delays=delays,
            by_learner={k: tuple(v) for k, v in per.items()},
            fanout_by={k: tuple(v) for k, v in fanout_by.items()},
        )
    lat = []
    for key, t in own.items():
        ts = [contributes[c]["t"] for c in cids_of.get(key, []) if c in contributes]
        if ts:
            lat.append(max(0.0, t - max(ts)))
    if not lat:
        raise TapeError(f"{run.folder}: no merge whose contributions are on the tapes (nothing was merged)")
    return Links(contrib_s=_quantile(lat, 0.25), fanout_s=fanout,
                 floor_s=min(min(lat), fanout) if fan else min(lat),
                 fanout_by={k: tuple(v) for k, v in fanout_by.items()})  # fmt: skip


def start_state(run: Run) -> tuple[tuple[int, float, float] | None, ...]:
    """Per fragment, the newest record applied anywhere by the window's start: (round, due, period)."""
    best: dict[int, dict] = {}
    for n in run.nodes:
        for r in n.records:
            if r.get("kind") == "merge" and r["t"] <= run.t0:
                p = r["fragment"]
                if p not in best or r["round"] > best[p]["round"]:
                    best[p] = r
    return tuple(
        (best[p]["round"], float(best[p].get("due") or best[p]["t"]), float(best[p].get("period") or 0.0))
        if p in best
        else None
        for p in range(len(run.shares))
    )


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def contribution_bytes(run: Run) -> list[float]:
    """The mean payload of one contribution of each fragment, from the tapes."""
    by: dict[int, list[int]] = {}
    for n in run.nodes:
        for r in n.records:
            if r.get("kind") == "contribute" and "bytes" in r:
                by.setdefault(r["fragment"], []).append(r["bytes"])
    mean = statistics.mean([b for bs in by.values() for b in bs]) if by else 0.0
    return [statistics.mean(by[p]) if p in by else mean for p in range(len(run.shares))]


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
