"""The failure plan of a chaos run of real nodes (``ddiloco chaos``): what fails, when, and for how long.

A plan is a declarative list of faults, drawn once from a seeded failure model before the faults start, so
a run can be printed, stored and replayed; ``node.chaos.harness`` executes it against node processes. The model:
failures anywhere in the swarm arrive as a Poisson process (exponential gaps, mean ``mtbf_s``); each one is

  kill       kill -9 of a node's whole process group (node, DHT process, p2pd), as a machine crash;
  kill_sync  the same, aimed at the node that synchronises a fragment's open round at that moment;
  pause      SIGSTOP of the group for ``hold_s``, then SIGCONT (a hung host, a long GC, a live migration);
  partition  (only with network namespaces, ``node.chaos.netns``) half the nodes cut off from the other half for
             ``hold_s``, then healed; ``node`` says where the half starts.

A killed node comes back after its return time ``hold_s`` (None: it stays down): the same node index on
the same state folder, so it resumes from its checkpoint and catches up from its peers. Pure: no I/O.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

from protocol.errors import ConfigError

KINDS = ("kill", "kill_sync", "pause", "partition")


@dataclass(frozen=True)
class Fault:
    at_s: float
    """seconds after the swarm is up (all nodes ready)"""
    kind: str
    """one of KINDS"""
    node: int
    """the node index to hit (kill, pause); when it is not running then, the next running index is hit"""
    fragment: int = 0
    """kill_sync: the fragment whose synchroniser is killed"""
    hold_s: float | None = None
    """pause, partition: seconds it lasts; kill: seconds until the restart (None: never restarted)"""

    def describe(self) -> str:
        if self.kind == "pause":
            return f"t={self.at_s:6.1f}s  pause node {self.node} for {self.hold_s:.1f}s"
        if self.kind == "partition":
            return f"t={self.at_s:6.1f}s  partition half the nodes from node {self.node} on for {self.hold_s:.1f}s"
        back = "never restarted" if self.hold_s is None else f"restart after {self.hold_s:.1f}s"
        what = (
            f"synchroniser of fragment {self.fragment}" if self.kind == "kill_sync" else f"node {self.node}"
        )
        return f"t={self.at_s:6.1f}s  kill -9 {what}, {back}"


@dataclass(frozen=True)
class FailureModel:
    mtbf_s: float = 60.0
    """mean time between failures anywhere in the swarm, in seconds (0: no failures)"""
    pause_share: float = 0.3
    """share of failures that are SIGSTOP pauses rather than kills"""
    partition_share: float = 0.0
    """share of failures that are network partitions (needs network namespaces)"""
    sync_share: float = 0.5
    """share of kills aimed at the synchroniser of a fragment"""
    return_s: float = 5.0
    """mean time before a killed node restarts (drawn uniformly in [0.5, 1.5] x this): a supervisor
    restarting the process (systemd's RestartSec defaults to 0.1 s, Kubernetes' first crash back-off is
    10 s); the restart itself (imports, model, checkpoint or download, DHT) is measured, not drawn"""
    pause_s: float = 10.0
    """mean length of a SIGSTOP or a partition (drawn uniformly in [0.5, 1.5] x this)"""
    quiet_end_s: float = 20.0
    """no failure starts in the last seconds of the run, so the swarm ends with its nodes back"""

    def check(self) -> None:
        if self.mtbf_s < 0:
            raise ConfigError(f"mtbf_s={self.mtbf_s} is invalid: must be >= 0 (0: no failures)")
        if self.pause_share + self.partition_share > 1.0:
            raise ConfigError(
                f"pause_share + partition_share = {self.pause_share + self.partition_share:g} is invalid: "
                "shares of one draw, at most 1"
            )
        for name in ("pause_share", "partition_share", "sync_share"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"{name}={v} is invalid: a share in [0, 1]")
        for name in ("return_s", "pause_s", "quiet_end_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} is invalid: seconds, must be >= 0")


def draw_plan(seed: int, duration_s: float, nodes: int, fragments: int, model: FailureModel) -> list[Fault]:
    """Faults at exponential gaps over ``duration_s`` (minus the quiet end), targets and holds drawn too."""
    model.check()
    if model.mtbf_s == 0:
        return []
    rng = random.Random(seed)
    out: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / model.mtbf_s)
        if t >= duration_s - model.quiet_end_s:
            return out
        u = rng.random()
        node = rng.randrange(nodes)
        fragment = rng.randrange(fragments)
        spread = rng.uniform(0.5, 1.5)
        if u < model.pause_share:
            out.append(Fault(round(t, 2), "pause", node, hold_s=round(spread * model.pause_s, 2)))
        elif u < model.pause_share + model.partition_share:
            out.append(Fault(round(t, 2), "partition", node, hold_s=round(spread * model.pause_s, 2)))
        else:
            kind = "kill_sync" if rng.random() < model.sync_share else "kill"
            out.append(Fault(round(t, 2), kind, node, fragment, round(spread * model.return_s, 2)))


def plan_to_json(plan: list[Fault]) -> str:
    return json.dumps([asdict(f) for f in plan], indent=1)


def plan_from_json(text: str) -> list[Fault]:
    """A plan written by hand or by ``plan_to_json``, or the ``chaos.json`` a chaos run left in its folder
    (its ``plan``: the same faults again); ConfigError names what is wrong."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"failure plan is not JSON: {e}") from e
    if isinstance(raw, dict) and isinstance(raw.get("plan"), list):
        raw = raw["plan"]
    if not isinstance(raw, list):
        raise ConfigError("failure plan must be a JSON list of faults {at_s, kind, node, fragment, hold_s}")
    out = []
    for i, d in enumerate(raw):
        try:
            f = Fault(**d)
        except TypeError as e:
            raise ConfigError(f"fault {i} of the plan: {e}") from e
        if f.kind not in KINDS:
            raise ConfigError(f"fault {i} of the plan: kind={f.kind!r} is invalid: one of {', '.join(KINDS)}")
        if f.at_s < 0 or (f.hold_s is not None and f.hold_s < 0):
            raise ConfigError(f"fault {i} of the plan: times must be >= 0")
        if f.kind in ("pause", "partition") and f.hold_s is None:
            raise ConfigError(f"fault {i} of the plan: a {f.kind} needs hold_s")
        out.append(f)
    return sorted(out, key=lambda f: f.at_s)
