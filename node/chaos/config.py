"""What a chaos run is: its swarm, duration, failure model or plan, namespaces and bounds."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from node.chaos.plan import FailureModel, Fault
from node.local.forks import ForkServer
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
    node_extra: dict[int, list[str]] = field(default_factory=dict)
    """flags for one node alone, after ``node_flags`` (e.g. ``--slowdown 1.2`` for a slower chip)"""
    learner_nice: int = 10
    """niceness of every node's learner thread (``[node] learner_nice``): the nodes share this host's cores,
    and a restarting node's start-up and every node's network side should not queue behind the other
    nodes' learners, as they would not on hosts of their own (0: leave priorities alone)"""
    stall_bound_s: float = 30.0
    """the longest interval with no merge anywhere that the run may show"""
    min_alive: int = 2
    """a kill or pause that would leave fewer running nodes is skipped"""
    settle_s: float = 90.0
    """the final quiet period's bound on reaching one model hash"""
    start_timeout_s: float = 180.0
    refresh_s: float = 2.0
    netns: bool = False
    """one network namespace per node (root only); needed for partitions and bandwidth caps"""
    netns_rate: str = ""
    """with netns: tc tbf rate of every node's link in each direction, e.g. '100mbit' ('': no cap)"""
    netns_cpu: float = 0.0
    """with netns: CPU cores each node may use, a cgroup quota (0: none, the nodes share the machine)"""
    quiet: bool = False
    forks: ForkServer | None = None
    """start the nodes (not in namespaces) by forking them from this server (``node.local.forks``), as the
    test suite does; None: each a fresh ``python -m node``"""

    def check(self) -> None:
        if self.nodes < 2:
            raise ConfigError(f"nodes={self.nodes} is invalid: a chaos run needs at least 2 nodes")
        if self.duration_s <= 0:
            raise ConfigError(f"duration_s={self.duration_s} is invalid: must be > 0")
        if not 1 <= self.min_alive <= self.nodes:
            raise ConfigError(f"min_alive={self.min_alive} is invalid: between 1 and nodes={self.nodes}")
        if not 0 <= self.learner_nice <= 19:
            raise ConfigError(f"learner_nice={self.learner_nice} is invalid: must be in [0, 19]")
        if self.netns_rate and not self.netns:
            raise ConfigError(f"netns_rate={self.netns_rate!r} needs netns (caps are set on namespace links)")
        if not 0 <= self.netns_cpu <= (os.cpu_count() or 1):
            raise ConfigError(
                f"netns_cpu={self.netns_cpu:g} is invalid: cores per node, 0 to {os.cpu_count()}"
            )
        if self.netns_cpu and not self.netns:
            raise ConfigError(
                f"netns_cpu={self.netns_cpu:g} needs netns (the quota goes with a node's namespace)"
            )
        self.model.check()
