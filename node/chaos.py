"""``ddiloco chaos``: a swarm of real node processes under a failure plan, then what it cost (issue 4).

N nodes start as ``ddiloco up`` starts them (``node.launcher``: node 0 first, the others bootstrap from it,
each in its own process group). Once all are up, a plan (``node.chaos_plan``: drawn from a seeded failure
model, or given) is executed against them: kill -9 of a node's whole process group — some aimed at the node
that synchronises a fragment at that moment, read from the status endpoint — SIGSTOP/SIGCONT pauses, and
restarts of a killed node on its own state folder after its return time. At the end the learners are
paused, the survivors get a quiet period to agree on one model hash, every node is stopped, and
``node.chaos_report`` scores the run from the nodes' event records. Every child is reaped: a killed node's
group is killed and waited for, and whatever is left at the end (also on Ctrl+C) is continued and stopped.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from node.chaos_plan import FailureModel, Fault, draw_plan
from node.chaos_report import (
    Outage,
    chaos_goodput,
    first_merge_after,
    merges_between,
    stalls,
    steps_between,
)
from node.launcher import Child, kill_group, start_node, stop_all, wait_ready
from node.status import StatusError, fetch_status, send_control
from protocol.errors import ConfigError


@dataclass
class ChaosConfig:
    run_dir: Path
    nodes: int = 4
    duration_s: float = 300.0
    """seconds of training under the plan, counted from the moment every node is up"""
    seed: int = 0
    model: FailureModel = field(default_factory=FailureModel)
    plan: list[Fault] | None = None
    """faults to apply instead of drawing them from ``model``"""
    node_flags: list[str] = field(default_factory=list)
    stall_bound_s: float = 30.0
    """the longest interval with no merge anywhere that the run may show"""
    min_alive: int = 2
    """a fault that would leave fewer running nodes is skipped"""
    settle_s: float = 90.0
    """the final quiet period's bound on reaching one model hash"""
    start_timeout_s: float = 180.0
    refresh_s: float = 2.0
    quiet: bool = False

    def check(self) -> None:
        if self.nodes < 2:
            raise ConfigError(f"nodes={self.nodes} is invalid: a chaos run needs at least 2 nodes")
        if self.duration_s <= 0:
            raise ConfigError(f"duration_s={self.duration_s} is invalid: must be > 0")
        if not 1 <= self.min_alive <= self.nodes:
            raise ConfigError(f"min_alive={self.min_alive} is invalid: between 1 and nodes={self.nodes}")
        self.model.check()


@dataclass
class Slot:
    """One node index: its incarnations (a restart is a new process on the same state folder)."""

    index: int
    lives: list[Child]
    state: str = "starting"  # starting | running | paused | down
    until: float | None = None  # monotonic time of the scheduled SIGCONT or restart
    started: float = 0.0  # monotonic time the newest incarnation was launched

    @property
    def child(self) -> Child:
        return self.lives[-1]


class ChaosRun:
    def __init__(self, cfg: ChaosConfig) -> None:
        cfg.check()
        self.cfg = cfg
        self.flags = ["--threads", str(max(1, (os.cpu_count() or 1) // cfg.nodes)), *cfg.node_flags]
        self.slots: dict[int, Slot] = {}
        self.outages: list[Outage] = []
        self.applied: list[dict] = []
        self.plan: list[Fault] = []
        self.t0 = self.t1 = 0.0  # wall times of the measured window
        self.m0 = 0.0
        self.peer_ids: dict[int, str] = {}
        self.settled = False
        self.interrupted = False

    # ------------------------------------------------------------------ helpers
    def log(self, msg: str) -> None:
        if not self.cfg.quiet:
            el = f"t={time.monotonic() - self.m0:6.1f}s  " if self.m0 else ""
            print(el + msg, file=sys.stderr, flush=True)

    def running(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.state == "running"]

    def launch(self, index: int, peers: list[str]) -> Child:
        (self.cfg.run_dir / f"node-{index}" / "final.json").unlink(missing_ok=True)
        c = start_node(index, self.cfg.run_dir, self.flags, peers)
        slot = self.slots.setdefault(index, Slot(index, []))
        slot.lives.append(c)
        slot.state, slot.until, slot.started = "starting", None, time.monotonic()
        return c

    def status(self, slot: Slot, timeout_s: float = 3.0) -> dict | None:
        try:
            slot.child.last = fetch_status(slot.child.url, timeout_s=timeout_s)
        except StatusError:
            return None
        return slot.child.last

    def poll(self) -> None:
        for s in self.running():
            self.status(s)

    # ------------------------------------------------------------------ faults
    def pick(self, fault: Fault) -> tuple[Slot | None, str]:
        run = sorted(self.running(), key=lambda s: s.index)
        if len(run) - 1 < self.cfg.min_alive:
            return None, f"skipped: {len(run)} running, min_alive {self.cfg.min_alive}"
        if fault.kind == "kill_sync":
            by_peer = {self.peer_ids[s.index]: s for s in run}
            for observer in run:
                st = self.status(observer)
                if st is None or fault.fragment >= len(st["fragments"]):
                    continue
                sync = st["fragments"][fault.fragment]["synchroniser"]
                if sync in by_peer:
                    return by_peer[
                        sync
                    ], f"synchroniser of fragment {fault.fragment} in node {observer.index}'s view"
            note = "no running synchroniser in view; "
        else:
            note = ""
        for k in range(self.cfg.nodes):
            s = self.slots[(fault.node + k) % self.cfg.nodes]
            if s.state == "running":
                return s, note + ("" if k == 0 else f"node {fault.node} not running, next running node")
        return None, "skipped: nothing running"

    def apply(self, fault: Fault) -> None:
        slot, note = self.pick(fault)
        rec = {"at_s": round(time.monotonic() - self.m0, 1), **vars(fault), "node": None, "note": note}
        self.applied.append(rec)
        if slot is None:
            self.log(f"{fault.kind}: {note}")
            return
        rec["node"], rec["peer"] = slot.index, self.peer_ids[slot.index]
        pid = slot.child.proc.pid
        if fault.kind == "pause":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGSTOP)
            rec["t"] = time.time()
            self.outages.append(Outage(slot.index, "pause", rec["t"]))
            slot.state, slot.until = "paused", time.monotonic() + (fault.hold_s or 0.0)
            self.log(f"SIGSTOP node {slot.index} for {fault.hold_s:.1f}s ({note or 'as planned'})")
            return
        self.kill(slot, rec)
        slot.until = None if fault.hold_s is None else time.monotonic() + fault.hold_s
        back = "never restarted" if fault.hold_s is None else f"restart in {fault.hold_s:.1f}s"
        self.log(f"kill -9 node {slot.index} [{fault.kind}] ({note or 'as planned'}); {back}")

    def kill(self, slot: Slot, rec: dict) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(slot.child.proc.pid, signal.SIGKILL)
        rec["t"] = time.time()
        self.outages.append(Outage(slot.index, "kill", rec["t"]))
        try:
            slot.child.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.log(f"node {slot.index} did not die within 30 s of SIGKILL")
        slot.state = "down"

    def recover(self, slot: Slot) -> None:
        if slot.state == "paused":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(slot.child.proc.pid, signal.SIGCONT)
            i = max(k for k, o in enumerate(self.outages) if o.node == slot.index and o.kind == "pause")
            o = self.outages[i]
            self.outages[i] = Outage(o.node, o.kind, o.t0, time.time())
            slot.state, slot.until = "running", None
            self.log(f"SIGCONT node {slot.index}")
            return
        donors = [s.child.maddrs for s in sorted(self.running(), key=lambda s: s.index) if s.child.maddrs]
        self.launch(slot.index, donors[0] if donors else [])
        self.log(f"restarting node {slot.index} on its state folder")

    def check_children(self) -> None:
        now = time.monotonic()
        for s in self.slots.values():
            c = s.child
            if s.state in ("running", "starting") and c.proc.poll() is not None:
                self.log(f"node {s.index} exited by itself (code {c.proc.returncode}); its log:\n{c.tail(8)}")
                kill_group(c)
                self.outages.append(Outage(s.index, "kill", time.time()))
                self.applied.append({"at_s": round(now - self.m0, 1), "kind": "crash", "node": s.index})
                s.state, s.until = "down", None
            elif s.state == "starting" and (c.state_dir / "ready.json").exists():
                doc = json.loads((c.state_dir / "ready.json").read_text())
                c.url, c.peer_id, c.maddrs = doc["status_url"], doc["peer_id"], doc["maddrs"]
                s.state = "running"
                self.log(f"node {s.index} is back ({now - s.started:.1f}s after its restart)")
            elif s.state == "starting" and now - s.started > self.cfg.start_timeout_s:
                self.log(f"node {s.index} not ready {self.cfg.start_timeout_s:g}s after its restart; killed")
                kill_group(c)
                c.proc.wait()
                s.state = "down"
            elif s.state in ("paused", "down") and s.until is not None and now >= s.until:
                self.recover(s)

    def progress(self) -> None:
        cells = []
        for s in sorted(self.slots.values(), key=lambda s: s.index):
            st = s.child.last if s.state == "running" else None
            if st:
                cells.append(
                    f"{s.index}:{st['learner']['steps']}st/{st['rounds_merged']}r/{st['model_hash'][:6]}"
                )
            else:
                cells.append(f"{s.index}:{s.state}")
        self.log(f"/{self.cfg.duration_s:g}s  " + "  ".join(cells))

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.log(f"starting {cfg.nodes} nodes in {cfg.run_dir} (logs: node-*/node.log)")
            self.launch(0, [])
            wait_ready([self.slots[0].child], cfg.start_timeout_s)
            for i in range(1, cfg.nodes):
                self.launch(i, self.slots[0].child.maddrs)
            wait_ready([s.child for s in self.slots.values()], cfg.start_timeout_s)
            for s in self.slots.values():
                s.state = "running"
                self.peer_ids[s.index] = s.child.peer_id
            first = self.status(self.slots[0], timeout_s=10) or {}
            frags = len(first.get("fragments", [])) or 1
            self.plan = (
                cfg.plan
                if cfg.plan is not None
                else draw_plan(cfg.seed, cfg.duration_s, cfg.nodes, frags, cfg.model)
            )
            self.log(
                f"swarm up; failure plan ({len(self.plan)} faults):\n"
                + "\n".join("  " + f.describe() for f in self.plan)
            )
            self.t0, self.m0 = time.time(), time.monotonic()
            todo = list(self.plan)
            next_poll = 0.0
            while (el := time.monotonic() - self.m0) < cfg.duration_s:
                while todo and todo[0].at_s <= el:
                    self.apply(todo.pop(0))
                self.check_children()
                if time.monotonic() >= next_poll:
                    self.poll()
                    if int(el) // 10 != int(el - cfg.refresh_s) // 10 or el < cfg.refresh_s:
                        self.progress()
                    next_poll = time.monotonic() + cfg.refresh_s
                time.sleep(0.2)
            self.t1 = time.time()
            self.finish()
        except KeyboardInterrupt:
            self.interrupted = True
            self.t1 = self.t1 or time.time()
            self.log("Ctrl+C: continuing paused nodes and stopping every node")
        finally:
            self.teardown()
        return self.report()

    def finish(self) -> None:
        """Paused nodes continue, restarts in progress come up; learners pause; wait for one model hash."""
        for s in self.slots.values():
            if s.state == "paused":
                self.recover(s)
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while any(s.state == "starting" for s in self.slots.values()) and time.monotonic() < deadline:
            self.check_children()
            time.sleep(0.5)
        for s in self.slots.values():
            s.until = None  # a node still down stays down
        self.log("end of the plan: pausing learners, waiting for one model hash across the running nodes")
        for s in self.running():
            with contextlib.suppress(StatusError):
                send_control(s.child.url, "pause")
        streak, deadline = 0, time.monotonic() + self.cfg.settle_s
        while time.monotonic() < deadline:
            self.check_children()
            self.poll()
            live = [s.child.last for s in self.running()]
            ok = live and all(x is not None and x["learner"]["idle"] for x in live)
            ok = ok and len({x["model_hash"] for x in live}) == 1
            streak = streak + 1 if ok else 0
            if streak >= 2:
                self.settled = True
                break
            time.sleep(1.0)
        self.log("one model hash across the running nodes" if self.settled else "hashes still differ")

    def teardown(self) -> None:
        everyone = [c for s in self.slots.values() for c in s.lives]
        for s in self.slots.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.child.proc.pid, signal.SIGCONT)
        try:
            stop_all([c for c in everyone if c.proc.poll() is None], timeout_s=60)
        finally:
            for c in everyone:
                kill_group(c)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=10)
                # a node killed -9 leaves its p2pd's unix sockets behind (dht.swarm names the folder by pid)
                base = tempfile.gettempdir() if len(tempfile.gettempdir()) <= 40 else "/tmp"
                for d in glob.glob(os.path.join(base, f"ddiloco-dht-{c.proc.pid}-*")):
                    shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ the numbers
    def events(self) -> dict[int, list[dict]]:
        out = {}
        for i in self.slots:
            path = self.cfg.run_dir / f"node-{i}" / "events.jsonl"
            recs = []
            with contextlib.suppress(OSError), open(path, encoding="utf-8") as fh:
                for line in fh:
                    with contextlib.suppress(ValueError):  # a line cut by kill -9
                        recs.append(json.loads(line))
            out[i] = recs
        return out

    def report(self) -> dict:
        ev = self.events()
        t0, t1 = self.t0, self.t1 or time.time()
        finals = {}
        for i, s in self.slots.items():
            f = s.child.state_dir / "final.json"
            if s.state == "running" and f.exists():
                finals[i] = json.loads(f.read_text())
        rep: dict = {
            "nodes": self.cfg.nodes,
            "seed": self.cfg.seed,
            "window_s": round(t1 - t0, 1) if t0 else 0.0,
            "run_dir": str(self.cfg.run_dir),
            "interrupted": self.interrupted,
            "settled": self.settled,
            "plan": [vars(f) for f in self.plan],
            "faults": self.applied,
        }
        if not t0:
            return rep
        try:
            rep["goodput"] = chaos_goodput(ev, self.peer_ids, self.outages, t0, t1).as_dict()
        except ValueError as e:
            rep["goodput"] = {"error": str(e)}
        st = stalls(ev, t0, t1)
        rep["stall"] = {**{k: round(v, 2) if isinstance(v, float) else v for k, v in st.items()}}
        rep["stall"]["bound_s"] = self.cfg.stall_bound_s
        rep["stall"]["ok"] = st["global_s"] <= self.cfg.stall_bound_s
        spans = []  # (outage, end or None while still out at the end)
        for o in self.outages:
            end = o.t1
            if o.kind == "kill":
                joins = [r["t"] for r in ev.get(o.node, []) if r.get("kind") == "join" and r["t"] > o.t0]
                end = min(joins) if joins else None
            spans.append((o, end))
        windows = []
        for o, end in spans:
            b = min(end, t1) if end is not None else t1
            others = [
                i for i in self.slots
                if i != o.node and not any(x.node == i and x.t0 < b and (e or t1) > o.t0 for x, e in spans)
            ]  # fmt: skip
            w = {
                "node": o.node,
                "kind": o.kind,
                "from_s": round(o.t0 - t0, 1),
                "out_s": round((end if end is not None else t1) - o.t0, 1),
                "back": end is not None,
                "merges_meanwhile": merges_between(ev, o.t0, b),
                "steps_meanwhile": {i: steps_between(ev[i], o.t0, b) for i in others},
            }
            windows.append(w)
        for rec in self.applied:
            if rec.get("kind") == "kill_sync" and rec.get("node") is not None:
                gap = first_merge_after(ev, rec["fragment"], rec["t"])
                rec["fragment_merged_again_s"] = None if gap is None else round(gap, 2)
        rep["outages"] = windows
        evals = [r for r in ev.get(0, []) if r.get("kind") == "eval"]
        rep["eval_loss_initial"] = evals[0]["loss"] if evals else None
        losses = [f["eval_loss"] for f in finals.values() if f.get("eval_loss") is not None]
        rep["eval_loss_final"] = min(losses) if losses else None
        hashes = {i: f["model_hash"] for i, f in finals.items()}
        rep["survivors"] = sorted(finals)
        rep["hashes"] = hashes
        rep["equal_hashes"] = len(set(hashes.values())) == 1 and len(hashes) > 0
        rep["tokens_merged"] = max((f["tokens_merged"] for f in finals.values()), default=0.0)
        rep["rounds_merged"] = max((f["rounds_merged"] for f in finals.values()), default=0)
        per = []
        for i, s in sorted(self.slots.items()):
            lasts = [c.last for c in s.lives if c.last]
            per.append(
                {
                    "node": i,
                    "peer": self.peer_ids.get(i, ""),
                    "lives": len(s.lives),
                    "state": s.state,
                    "steps": steps_between(ev[i], t0, t1),
                    "mb_sent": round(sum(x["bytes_sent"] for x in lasts) / 1e6, 2),
                    "mb_received": round(sum(x["bytes_received"] for x in lasts) / 1e6, 2),
                    "exit_code": s.child.proc.returncode,
                    "hash": hashes.get(i),
                }
            )
        rep["per_node"] = per
        return rep


def run_chaos(cfg: ChaosConfig) -> dict:
    """Run the plan against a fresh swarm and return the report (see ``ChaosRun.report``)."""
    return ChaosRun(cfg).run()
