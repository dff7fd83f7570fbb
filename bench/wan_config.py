"""What one run of bench/wan.py compares: its systems, link caps, durations and model, checked."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from node.swarm.settings import NodeSettings
from protocol.errors import ConfigError

SYSTEMS = ("ours", "ours-q", "sync", "sync-ar", "dp-fp32", "dp-bf16")
NODE_SYSTEM = {"ours": "decoupled", "ours-q": "decoupled", "sync": "sync-diloco"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rate_bits(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ConfigError(f"cap {rate!r} is invalid: write it as tc does (e.g. 100mbit, 1gbit) or 'none'")
    return float(m[1]) * {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]


def burst_for(rate: str) -> str:
    """The token bucket's depth: 1 ms of the rate, at least 32kbit (``NetLab``'s default)."""
    return f"{max(32, int(rate_bits(rate) / 1e6))}kbit"


@dataclass
class WanConfig:
    run_dir: Path
    nodes: int = 4
    caps: tuple[str, ...] = ("1000mbit", "100mbit", "30mbit", "10mbit", "3mbit")
    """tc rates of every node's link, each direction; 'none' for no cap"""
    systems: tuple[str, ...] = SYSTEMS
    duration_s: float = 75.0
    """measured seconds per system and cap"""
    warm_s: float = 20.0
    """seconds after every process has stepped, before the window opens"""
    eval_every_s: float = 15.0
    sync_every: int = 24
    """H of ours and of sync DiLoCo"""
    batch_size: int = 16
    """sequences per step per learner (and per DP worker)"""
    steps: int = NodeSettings().steps
    """inner steps the lr schedule spans, in every system"""
    node_flags: list[str] = field(default_factory=list)
    start_timeout_s: float = 300.0
    settle_s: float = 60.0
    """bound on the nodes' quiet period (one model hash) after the window"""
    idle_s: float = 10.0
    """seconds of link bytes measured after the quiet period, learners paused: the swarm's background"""
    gloo_timeout_s: float = 300.0
    cpu_per_node: float = 0.0
    """CPU cores each node (or DP worker) may use, a cgroup quota; 0: none (they share the machine)"""
    rtt_ms: float = 0.0
    """a round trip added between every two nodes, every system (``NetLab(rtt_ms=...)``: a delay line for packets)"""
    seed: int = 0
    """data seed: node (and DP rank) i reads its batches with seed * 1000 + i + 1"""
    dp_reference: bool = True
    """run each DP system once more, uncapped, to the most tokens ours reached (eval loss per token)"""

    def check(self) -> None:
        if self.nodes < 2:
            raise ConfigError(f"nodes={self.nodes} is invalid: a comparison needs at least 2")
        for s in self.systems:
            if s not in SYSTEMS:
                raise ConfigError(f"system {s!r} is invalid: choose from {', '.join(SYSTEMS)}")
        for c in self.caps:
            if c != "none":
                rate_bits(c)
        if self.idle_s < 0:
            raise ConfigError(f"idle_s={self.idle_s:g} is invalid: seconds, 0 for none")
        if self.duration_s <= 0 or self.warm_s < 0 or self.eval_every_s <= 0:
            raise ConfigError("duration and eval period must be > 0, warm-up >= 0")
