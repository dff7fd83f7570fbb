"""``ddiloco chaos``: a swarm of real node processes under a failure plan, then what it cost.

N nodes start as ``ddiloco up`` starts them (``node.local.launcher``: node 0 first, the others bootstrap from it,
each in its own process group). Once all are up, a plan (``node.chaos.plan``: drawn from a seeded failure
model, or given) is executed against them: kill -9 of a node's whole process group — some aimed at the node
that synchronises a fragment at that moment, read from the status endpoint — SIGSTOP/SIGCONT pauses, and
restarts of a killed node on its own state folder after its return time. With ``netns`` each node runs in
its own network namespace (``node.chaos.netns``: optional bandwidth caps, and partitions as faults). At the end
the learners are paused, the survivors get a quiet period to agree on one model hash, every node is
stopped, and ``node.chaos.report`` scores the run from the nodes' event records. Every child is reaped: a
killed node's group is killed and waited for, and whatever is left at the end (also on Ctrl+C) is
continued and stopped; namespaces are deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from node.chaos.config import ChaosConfig
from node.chaos.plan import Fault, draw_plan
from node.chaos.report import WINDOW_FILE, Outage, run_report
from node.common.events import read_events
from node.common.status_client import StatusError, fetch_status, read_control_token, send_control
from node.local.launcher import Child, kill_group, start_node, wait_ready

RESTART_TRIES = 3  # a restart whose process exits by itself (e.g. its bootstrap peer just died) is retried


@dataclass
class Slot:
    """One node index: its lives (a restart is a new process on the same state folder)."""

    index: int
    lives: list[Child]
    state: str = "starting"  # starting | running | paused | down
    until: float | None = None  # monotonic time of the scheduled SIGCONT or restart
    started: float = 0.0  # monotonic time the newest life was launched
    tries: int = 0  # restarts of this outage that exited by themselves

    @property
    def child(self) -> Child:
        return self.lives[-1]


class ChaosRun:
    def __init__(self, cfg: ChaosConfig) -> None:
        cfg.check()
        self.cfg = cfg
        self.flags = [
            "--threads",
            str(max(1, (os.cpu_count() or 1) // cfg.nodes)),
            "--learner-nice",
            str(cfg.learner_nice),
            *cfg.node_flags,
        ]
        self.slots: dict[int, Slot] = {}
        self.outages: list[Outage] = []
        self.applied: list[dict] = []
        self.plan: list[Fault] = []
        self.t0 = self.t1 = 0.0  # wall times of the measured window
        self.m0 = 0.0
        self.peer_ids: dict[int, str] = {}
        self.settled = False
        self.interrupted = False
        self.lab = None  # node.netns.NetLab with cfg.netns
        self.heal_at: float | None = None

    # ------------------------------------------------------------------ helpers
    def log(self, msg: str) -> None:
        if not self.cfg.quiet:
            el = f"t={time.monotonic() - self.m0:6.1f}s  " if self.m0 else ""
            print(el + msg, file=sys.stderr, flush=True)

    def running(self) -> list[Slot]:
        return sorted((s for s in self.slots.values() if s.state == "running"), key=lambda s: s.index)

    def launch(self, index: int, peers: list[str]) -> Child:
        (self.cfg.run_dir / f"node-{index}" / "final.json").unlink(missing_ok=True)
        flags = self.flags + self.cfg.node_extra.get(index, [])
        if self.lab is not None:
            c = self.lab.start(index, self.cfg.run_dir, flags, peers)
        else:
            c = start_node(index, self.cfg.run_dir, flags, peers, forks=self.cfg.forks)
        slot = self.slots.setdefault(index, Slot(index, []))
        slot.lives.append(c)
        slot.state, slot.until, slot.started = "starting", None, time.monotonic()
        return c

    def _http(self, slot: Slot, fn):
        """Call the node's status endpoint (from inside its namespace with netns: it listens on loopback)."""
        return fn() if self.lab is None else self.lab.inside(slot.index, fn)

    def status(self, slot: Slot, timeout_s: float = 3.0) -> dict | None:
        url = slot.child.url
        try:
            doc = self._http(slot, lambda: fetch_status(url, timeout_s=timeout_s))
        except StatusError:
            return None
        slot.child.last = doc  # the newest doc of each life: its bytes sent and received
        return doc

    def control(self, slot: Slot, action: str) -> None:
        url = slot.child.url
        with contextlib.suppress(StatusError):
            self._http(
                slot, lambda: send_control(url, action, token=read_control_token(slot.child.state_dir))
            )

    def donors(self) -> list[str]:
        """Initial peers for a restart: every running node (one dying meanwhile must not strand it)."""
        return [m for s in self.running() for m in s.child.maddrs[:1]]

    # ------------------------------------------------------------------ faults
    def pick(self, fault: Fault) -> tuple[Slot | None, str]:
        run = self.running()
        if len(run) - 1 < self.cfg.min_alive:
            return None, f"skipped: {len(run)} running, min_alive {self.cfg.min_alive}"
        note = ""
        if fault.kind == "kill_sync":
            # Views can differ for a moment (a node that has not yet applied the newest record ranks the
            # candidates of an older round): the node most views name is the one the learners send to.
            by_peer = {self.peer_ids[s.index]: s for s in run}
            votes: dict[str, int] = {}
            for observer in run:
                st = self.status(observer)
                if st is not None and st["fragments"]:
                    # A plan drawn for P fragments also runs against a swarm of fewer (a baseline system).
                    sync = st["fragments"][fault.fragment % len(st["fragments"])]["synchroniser"]
                    if sync in by_peer:
                        votes[sync] = votes.get(sync, 0) + 1
            if votes:
                sync = max(votes, key=lambda p: (votes[p], -by_peer[p].index))
                frag = fault.fragment % len(st["fragments"]) if st and st["fragments"] else fault.fragment
                why = f"fragment {frag}'s synchroniser in {votes[sync]} of {len(run)} views"
                return by_peer[sync], why
            note = "no running synchroniser in view; "
        for k in range(self.cfg.nodes):
            s = self.slots[(fault.node + k) % self.cfg.nodes]
            if s.state == "running":
                return s, note + ("" if k == 0 else f"node {fault.node} not running, next running node")
        return None, "skipped: nothing running"

    def apply(self, fault: Fault) -> None:
        rec = {"at_s": round(time.monotonic() - self.m0, 1), **vars(fault), "node": None, "note": ""}
        self.applied.append(rec)
        if fault.kind == "partition":
            self.partition(fault, rec)
            return
        slot, rec["note"] = self.pick(fault)
        if slot is None:
            self.log(f"{fault.kind}: {rec['note']}")
            return
        rec["node"], rec["peer"] = slot.index, self.peer_ids[slot.index]
        why = rec["note"] or "as planned"
        if fault.kind == "pause":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(slot.child.proc.pid, signal.SIGSTOP)
            rec["t"] = time.time()
            self.outages.append(Outage(slot.index, "pause", rec["t"]))
            rec["outage"] = len(self.outages) - 1
            slot.state, slot.until = "paused", time.monotonic() + (fault.hold_s or 0.0)
            self.log(f"SIGSTOP node {slot.index} for {fault.hold_s:.1f}s ({why})")
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(slot.child.proc.pid, signal.SIGKILL)
        rec["t"] = time.time()
        self.outages.append(Outage(slot.index, "kill", rec["t"]))
        rec["outage"] = len(self.outages) - 1
        try:
            slot.child.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.log(f"node {slot.index} did not die within 30 s of SIGKILL")
        slot.state, slot.tries = "down", 0
        slot.until = None if fault.hold_s is None else time.monotonic() + fault.hold_s
        back = "never restarted" if fault.hold_s is None else f"restart in {fault.hold_s:.1f}s"
        self.log(f"kill -9 node {slot.index} [{fault.kind}] ({why}); {back}")

    def partition(self, fault: Fault, rec: dict) -> None:
        if self.lab is None or self.heal_at is not None:
            rec["note"] = "skipped: partitions need --netns" if self.lab is None else "skipped: already split"
            self.log(f"partition: {rec['note']}")
            return
        n = self.cfg.nodes
        side = sorted((fault.node + k) % n for k in range(n // 2))
        self.lab.partition(set(side))
        rec.update(side=side, t=time.time(), note=f"nodes {side} apart from the rest")
        self.heal_at = time.monotonic() + (fault.hold_s or 0.0)
        self.log(f"partition: nodes {side} cut off from the others for {fault.hold_s:.1f}s")

    def heal(self) -> None:
        if self.lab is not None and self.heal_at is not None:
            self.lab.heal()
            self.heal_at = None
            self.log("partition healed")

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
        self.launch(slot.index, self.donors())
        self.log(f"restarting node {slot.index} on its state folder")

    def check_children(self) -> None:
        now = time.monotonic()
        if self.heal_at is not None and now >= self.heal_at:
            self.heal()
        for s in self.slots.values():
            c = s.child
            if s.state in ("running", "starting") and c.proc.poll() is not None:
                kill_group(c)
                if s.state == "starting" and s.tries + 1 < RESTART_TRIES:
                    s.tries += 1
                    s.state, s.until = "down", now + 5.0
                    self.log(f"node {s.index}'s restart exited (code {c.proc.returncode}); retrying in 5 s")
                    continue
                self.log(f"node {s.index} exited by itself (code {c.proc.returncode}); its log:\n{c.tail(8)}")
                rec = {"at_s": round(now - self.m0, 1), "kind": "crash", "node": s.index, "note": "exited"}
                if s.state == "running":
                    self.outages.append(Outage(s.index, "kill", time.time()))
                    rec["outage"] = len(self.outages) - 1
                self.applied.append(rec)
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
            if cfg.netns:
                from node.chaos.netns import NetLab

                self.lab = NetLab(cfg.nodes, cfg.netns_rate, cpu=cfg.netns_cpu).open()
                cap = f", links capped at {cfg.netns_rate} each way" if cfg.netns_rate else ""
                self.log(f"network namespaces {self.lab.ns(0)}..{self.lab.ns(cfg.nodes - 1)}{cap}")
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
            faults = "\n".join("  " + f.describe() for f in self.plan)
            self.log(f"swarm up; failure plan ({len(self.plan)} faults):\n{faults}")
            self.t0, self.m0 = time.time(), time.monotonic()
            todo = list(self.plan)
            next_poll = 0.0
            while (el := time.monotonic() - self.m0) < cfg.duration_s:
                while todo and todo[0].at_s <= el:
                    self.apply(todo.pop(0))
                self.check_children()
                if time.monotonic() >= next_poll:
                    for s in self.running():
                        self.status(s)
                    if int(el) // 10 != int(el - cfg.refresh_s) // 10 or el < cfg.refresh_s:
                        self.progress()
                    next_poll = time.monotonic() + cfg.refresh_s
                time.sleep(0.2)
            self.t1 = time.time()
            self.finish()
        except KeyboardInterrupt:
            self.interrupted = True
            self.t1 = self.t1 or time.time()
            self.log("interrupted: continuing paused nodes and stopping every node")
        finally:
            self.teardown()
        rep = self.report()
        self.write_window()
        return rep

    def write_window(self) -> None:
        """``RUN_DIR/chaos.json``: what only the harness knows of the run (its measured window, the nodes' peer
        ids, every kill and pause, and the plan), for ``ddiloco replay`` to score the nodes' tapes as this
        report did, and for ``--plan`` to run the same faults again."""
        doc = {
            "t0": self.t0,
            "t1": self.t1,
            "peer_ids": {str(i): p for i, p in sorted(self.peer_ids.items())},
            "outages": [vars(o) for o in self.outages],
            "plan": [vars(f) for f in self.plan or []],
            "interrupted": self.interrupted,
        }
        (self.cfg.run_dir / WINDOW_FILE).write_text(json.dumps(doc, indent=1) + "\n")

    def finish(self) -> None:
        """Heal, continue paused nodes, let restarts come up; pause learners; wait for one model hash."""
        self.heal()
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
            self.control(s, "pause")
        streak, last, deadline = 0, None, time.monotonic() + self.cfg.settle_s
        while time.monotonic() < deadline:
            self.check_children()
            live = [self.status(s) for s in self.running()]
            ok = bool(live) and all(
                x is not None and x["learner"]["idle"] and not x.get("in_flight") for x in live
            )
            hashes = {x["model_hash"] for x in live} if ok else None
            agreed = ok and len(hashes) == 1
            # one hash, the same on consecutive polls (``node.local.launcher.quiet_period``)
            streak = streak + 1 if agreed and hashes == last else (1 if agreed else 0)
            last = hashes if agreed else None
            if streak >= 2:
                self.settled = True
                break
            time.sleep(1.0)
        self.log("one model hash across the running nodes" if self.settled else "hashes still differ")

    def teardown(self) -> None:
        """Every life of every node ends here: continued, asked to stop (checkpoint, export), then killed."""
        lives = [(s, c) for s in self.slots.values() for c in s.lives]
        for s in self.slots.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.child.proc.pid, signal.SIGCONT)
        try:
            for s, c in lives:
                if c.proc.poll() is None:
                    if c is s.child and c.url:
                        self.control(s, "stop")
                    else:
                        c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            for _, c in lives:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            for _, c in lives:
                kill_group(c)  # reaps it, and removes what a kill -9 left in its TMPDIR
            if self.lab is not None:
                self.lab.close()

    # ------------------------------------------------------------------ the numbers
    def events(self) -> dict[int, list[dict]]:
        return {i: read_events(self.cfg.run_dir / f"node-{i}" / "events.jsonl") for i in self.slots}

    def report(self) -> dict:
        """What the run cost: goodput, stalls, outages, final hashes and losses, per-node numbers."""
        return run_report(self)


def run_chaos(cfg: ChaosConfig) -> tuple[dict, list[Fault]]:
    """Run the plan against a fresh swarm; the report (see ``ChaosRun.report``) and the plan it ran."""
    run = ChaosRun(cfg)
    return run.run(), list(run.plan or [])
