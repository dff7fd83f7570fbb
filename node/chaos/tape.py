"""A finished run's folder read back: every node's tape, the measured window and outages, and what the tapes
measured (docs/replay.md).

``read_run`` reads every node's tape (``node-*/events.jsonl``, the folders ``ddiloco up`` and ``ddiloco
chaos`` make, or any folder of node state folders) and refuses, naming the file, a folder a replay cannot
be true to: a missing or empty tape, a tape cut short (its last line torn, or no ``run`` record where the
harness does not say the node was killed for good), nodes that never shared a merged round (they were not
one run), nodes of different settings, a run of another system than Decoupled DiLoCo (its learners block
on the swarm, which a replay of their step times would not reproduce).

The measured window is the chaos harness's (``chaos.json``, with its kills and pauses) where there is
one; otherwise from the moment the last node joined to the last step anywhere, with each restart of a node
(a second ``join``) taken as a kill at its tape's last record before it. ``Run`` reads the learners' step
times, the links' delays, the contributions' bytes and the state at the window's start once, for however
many replays are made of it.
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from node.chaos.report import WINDOW_FILE, Outage
from protocol.config import TAPE_SETTINGS, ProtocolConfig
from protocol.errors import ConfigError
from sim.replay import LearnerTape, Links


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


# ---------------------------------------------------------------- what the tapes measured
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
