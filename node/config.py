"""Configuration: nested frozen dataclasses, merged with precedence defaults < TOML file < CLI flags.

Every field of a section becomes a flag ``--field-name`` (help from the field's metadata), and a TOML
table named after the section sets the same fields. Validation lives in each dataclass's
``__post_init__`` and raises ``ConfigError`` naming the bad value.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from node.learner import InnerConfig
from node.model import ModelConfig
from node.runner import SYSTEMS, NetConfig
from node.task import TaskConfig
from protocol.config import ProtocolConfig
from protocol.errors import ConfigError

NODE_SYSTEMS = tuple(x for x in SYSTEMS if x != "dp")  # what a real node runs


@dataclass(frozen=True)
class LocalRunConfig:
    """The in-process swarm that ``ddiloco train-local`` runs."""

    system: str = field(default="decoupled", metadata={"help": f"comma-separated, of: {', '.join(SYSTEMS)}"})
    learners: int = field(default=4, metadata={"help": "M: learners in the swarm"})
    tokens: int = field(default=1_200_000, metadata={"help": "token budget over all learners"})
    seed: int = field(default=0, metadata={"help": "learner data order and jitter seed"})
    slow_learners: int = field(default=0, metadata={"help": "how many learners run slower"})
    slow_factor: float = field(default=1.2, metadata={"help": "their steps take this many times longer"})
    jitter: float = field(default=0.0, metadata={"help": "step time jitter, e.g. 0.1 for +-10%"})
    down: str = field(default="", metadata={"help": "failures 'learner:from_s:to_s,...' in virtual s"})
    eval_points: int = field(default=10, metadata={"help": "evaluations of the global model per run"})
    events: str | None = field(default=None, metadata={"help": "write event records (JSON lines) here"})
    task: str | None = field(default=None, metadata={"help": "custom task 'module:function'"})
    export: str | None = field(
        default=None, metadata={"help": "write the final global model here (safetensors)"}
    )

    def __post_init__(self) -> None:
        for s in self.system.split(","):
            if s not in SYSTEMS:
                raise ConfigError(f"system={s!r} is invalid: choose from {', '.join(SYSTEMS)}")
        if self.learners < 1:
            raise ConfigError(f"learners={self.learners} is invalid: need at least 1")
        if not 0 <= self.slow_learners <= self.learners:
            raise ConfigError(
                f"slow_learners={self.slow_learners} is invalid: must be in [0, {self.learners}]"
            )
        if self.slow_factor <= 0:
            raise ConfigError(f"slow_factor={self.slow_factor} is invalid: must be > 0")
        if not 0 <= self.jitter < 1:
            raise ConfigError(f"jitter={self.jitter} is invalid: must be in [0, 1)")
        self.down_intervals()  # validates

    def down_intervals(self) -> dict[int, list[tuple[float, float]]]:
        out: dict[int, list[tuple[float, float]]] = {}
        for item in filter(None, (x.strip() for x in self.down.split(","))):
            try:
                m, a, b = item.split(":")
                m_, a_, b_ = int(m), float(a), float(b)
            except ValueError:
                raise ConfigError(
                    f"down={self.down!r} is invalid: expected 'learner:from_s:to_s', got {item!r}"
                ) from None
            if not (0 <= m_ < self.learners and 0 <= a_ < b_):
                raise ConfigError(
                    f"down={item!r} is invalid: need 0 <= learner < {self.learners} and 0 <= from_s < to_s"
                )
            out.setdefault(m_, []).append((a_, b_))
        return out


@dataclass(frozen=True)
class TrainLocalConfig:
    run: LocalRunConfig = LocalRunConfig()
    protocol: ProtocolConfig = ProtocolConfig()
    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig()
    inner: InnerConfig = InnerConfig()
    net: NetConfig = NetConfig()

    def task_config(self) -> TaskConfig:
        return replace(self.task, model=self.model)


@dataclass(frozen=True)
class NodeSettings:
    """One node of a real swarm (``ddiloco node``): its network, identity, state and timing."""

    swarm: str = field(
        default="ddiloco-local", metadata={"help": "swarm id; nodes of other swarms are ignored"}
    )
    identity: str = field(default="", metadata={"help": "Ed25519 key file (default: STATE_DIR/identity.key)"})
    state_dir: str = field(default="node-state", metadata={"help": "checkpoints, events, export, ready file"})
    host_maddrs: str = field(
        default="/ip4/127.0.0.1/tcp/0", metadata={"help": "comma-separated multiaddrs to listen on"}
    )
    announce_maddrs: str = field(
        default="", metadata={"help": "comma-separated multiaddrs peers should dial"}
    )
    initial_peers: str = field(
        default="", metadata={"help": "comma-separated multiaddrs (with /p2p/ID) of nodes to bootstrap from"}
    )
    client_mode: bool = field(
        default=False, metadata={"help": "accept no inbound connections (NAT); pull state, never synchronise"}
    )
    status_host: str = field(default="127.0.0.1", metadata={"help": "address of the HTTP status endpoint"})
    status_port: int = field(default=0, metadata={"help": "port of the status endpoint (0: any free port)"})
    heartbeat_s: float = field(default=2.0, metadata={"help": "membership refresh period"})
    ttl_s: float = field(
        default=8.0, metadata={"help": "membership record lifetime: a silent node is gone after"}
    )
    failover_s: float = field(
        default=8.0, metadata={"help": "bound on re-routing a contribution after its synchroniser died"}
    )
    rpc_timeout_s: float = field(default=10.0, metadata={"help": "deadline of one request to a peer"})
    checkpoint_every_s: float = field(
        default=60.0, metadata={"help": "checkpoint period, the first 10 s after joining (0: only at exit)"}
    )
    eval_every_s: float = field(default=60.0, metadata={"help": "evaluate the global model this often"})
    steps: int = field(
        default=5000, metadata={"help": "inner steps the lr schedule spans (then at its floor)"}
    )
    data_seed: int = field(default=-1, metadata={"help": "data order seed (-1: derived from the peer id)"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})
    authority: str = field(
        default="",
        metadata={
            "help": "private swarm: the swarm authority's peer id ('ddiloco swarm init' prints it); peers need "
            "a certificate it signed, payloads and DHT records are sealed with the swarm secret"
        },
    )
    certificate: str = field(
        default="", metadata={"help": "private swarm: this node's admission certificate"}
    )
    swarm_secret: str = field(default="", metadata={"help": "private swarm: the swarm secret file"})
    revoked: str = field(
        default="",
        metadata={"help": "private swarm: file of revoked peer ids, one a line (re-read on change)"},
    )
    ban_after: float = field(
        default=10.0,
        metadata={"help": "ban a peer after this many refused hostile messages (net of accepted work)"},
    )
    ban_s: float = field(default=300.0, metadata={"help": "how long a ban lasts (s)"})
    agent_nice: int = field(
        default=0,
        metadata={
            "help": "niceness added to the node's network side (event loop, DHT process, p2pd) after the "
            "learner starts, so a CPU the learner fills serves it first; 0 (default) leaves priorities alone: "
            "under load from other programs a niced network side answers late"
        },
    )
    learner_nice: int = field(
        default=0,
        metadata={
            "help": "niceness added to the learner thread alone when it starts: for several nodes on one "
            "host (the chaos harness sets 10), so each node's start-up and network side run before the "
            "other nodes' learners, as on hosts of their own; 0 (default) leaves priorities alone"
        },
    )
    nproc: int = field(
        default=1,
        metadata={
            "help": "processes in this node's learner unit: >1 runs the node under torchrun, data-parallel "
            "(DDP, or FSDP2 shards with shard; gloo on CPU, NCCL on GPUs), rank 0 speaking for the unit"
        },
    )
    shard: bool = field(
        default=False,
        metadata={
            "help": "with nproc > 1: shard parameters, gradients and optimizer state across the unit's "
            "processes (FSDP2: fully_shard per block of the model's ModuleLists, then the root) instead of "
            "replicating them (DDP), for models that do not fit one device"
        },
    )
    unit_timeout_s: float = field(
        default=600.0, metadata={"help": "deadline of the unit's rendezvous and of each collective"}
    )
    system: str = field(
        default="decoupled",
        metadata={
            "help": "decoupled (the paper: learners never wait) | sync-diloco (baseline: one fragment, every "
            "live learner, plain mean, and each learner waits after contributing until the merge is back) | "
            "streaming (baseline: fragments, every live learner, plain mean, a learner waits tau steps after "
            "contributing a fragment until it is back); every node of a swarm must run the same system"
        },
    )
    block_timeout_s: float = field(
        default=60.0,
        metadata={"help": "sync-diloco/streaming: give up waiting for a merge after this long and train on"},
    )
    duration: float = field(default=0.0, metadata={"help": "stop after this many seconds (0: until stopped)"})
    step_delay_s: float = field(default=0.0, metadata={"help": "sleep after each inner step (a slower chip)"})
    slowdown: float = field(
        default=1.0,
        metadata={
            "help": "make this learner a slower chip: after each inner step it sleeps (slowdown - 1) times "
            "the step's own time, so steps take this many times longer (1: full speed)"
        },
    )
    jitter: float = field(
        default=0.0,
        metadata={
            "help": "each step's slowdown is scaled by a uniform factor in [1-j, 1+j] (a step is never made "
            "faster than the chip runs it)"
        },
    )
    export: str = field(
        default="", metadata={"help": "final global model file (default: STATE_DIR/model.safetensors)"}
    )
    test_hooks: bool = field(default=False, metadata={"help": "enable test-only controls (partition)"})
    exit_with_parent: bool = field(
        default=False, metadata={"help": "stop when the launching process dies (set by 'ddiloco up')"}
    )

    def __post_init__(self) -> None:
        if self.authority and not (self.certificate and self.swarm_secret):
            raise ConfigError(
                "authority is set (a private swarm) but certificate or swarm_secret is not: a member needs "
                "its admission certificate ('ddiloco swarm admit') and the swarm secret file"
            )
        if not 0 <= self.agent_nice <= 19:
            raise ConfigError(f"agent_nice={self.agent_nice} is invalid: must be in [0, 19]")
        if not 0 <= self.learner_nice <= 19:
            raise ConfigError(f"learner_nice={self.learner_nice} is invalid: must be in [0, 19]")
        if self.system not in NODE_SYSTEMS:
            raise ConfigError(
                f"system={self.system!r} is invalid: a node runs one of {', '.join(NODE_SYSTEMS)} "
                "(data-parallel runs only in the in-process runner and bench/wan.py)"
            )
        if self.nproc < 1:
            raise ConfigError(f"nproc={self.nproc} is invalid: a learner unit needs at least 1 process")
        for name in (
            "heartbeat_s",
            "ttl_s",
            "failover_s",
            "rpc_timeout_s",
            "unit_timeout_s",
            "block_timeout_s",
            "ban_after",
            "ban_s",
            "eval_every_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} is invalid: must be > 0")
        if self.ttl_s <= 2 * self.heartbeat_s:
            raise ConfigError(
                f"ttl_s={self.ttl_s} is invalid: must exceed 2 x heartbeat_s={self.heartbeat_s}, or a live "
                "node drops out of the view between two refreshes"
            )
        if not 0 <= self.status_port < 65536:
            raise ConfigError(f"status_port={self.status_port} is invalid: must be in [0, 65535]")
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps} is invalid: must be >= 1")
        if self.step_delay_s < 0:
            raise ConfigError(f"step_delay_s={self.step_delay_s} is invalid: must be >= 0")
        if not self.slowdown >= 1.0:
            raise ConfigError(f"slowdown={self.slowdown} is invalid: must be >= 1 (a node cannot go faster)")
        if not 0.0 <= self.jitter < 1.0:
            raise ConfigError(f"jitter={self.jitter} is invalid: must be in [0, 1)")
        if not self.swarm or "/" in self.swarm:
            raise ConfigError(f"swarm={self.swarm!r} is invalid: a non-empty name without '/'")

    @staticmethod
    def split(v: str) -> list[str]:
        return [x.strip() for x in v.split(",") if x.strip()]


@dataclass(frozen=True)
class NodeConfig:
    node: NodeSettings = NodeSettings()
    protocol: ProtocolConfig = ProtocolConfig()
    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig()
    inner: InnerConfig = InnerConfig()

    def task_config(self) -> TaskConfig:
        return replace(self.task, model=self.model)


# Flags whose natural name collides with another section's field.
RENAMES = {("task", "seed"): "model-seed", ("inner", "lr"): "inner-lr"}


def _section_fields(cls) -> list[dataclasses.Field]:
    return [f for f in fields(cls) if not is_dataclass(f.default)]


def _type_of(cls, f: dataclasses.Field):
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_config_args(parser: argparse.ArgumentParser, root=TrainLocalConfig) -> None:
    """One flag per field of every section; defaults suppressed so we can tell what was given."""
    for sec in fields(root):
        group = parser.add_argument_group(sec.name)
        for f in _section_fields(sec.type if isinstance(sec.type, type) else type(sec.default)):
            cls = type(sec.default)
            flag = "--" + RENAMES.get((sec.name, f.name), f.name.replace("_", "-"))
            kw: dict[str, Any] = {
                "dest": f"{sec.name}.{f.name}",
                "default": argparse.SUPPRESS,
                "metavar": f.name.upper(),
                "help": f"{f.metadata.get('help', '')} (default: {f.default})".replace("%", "%%"),
            }
            t = _type_of(cls, f)
            if t is bool:
                kw["action"] = argparse.BooleanOptionalAction
                del kw["metavar"]
            else:
                kw["type"] = t
            group.add_argument(flag, **kw)


def build_config(args: argparse.Namespace, toml_path: str | None, root=TrainLocalConfig):
    """defaults < TOML < CLI. Raises ConfigError naming any bad value or unknown key."""
    values: dict[str, dict[str, Any]] = {sec.name: {} for sec in fields(root)}
    if toml_path:
        p = Path(toml_path)
        if not p.is_file():
            raise ConfigError(f"config={toml_path!r} is invalid: no such file")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config={toml_path!r} is not valid TOML: {e}") from e
        for name, table in data.items():
            if name not in values or not isinstance(table, dict):
                raise ConfigError(f"config {toml_path}: unknown section [{name}]; known: {', '.join(values)}")
            values[name].update(table)
    for dest, v in vars(args).items():
        if "." in dest:
            sec, name = dest.split(".", 1)
            values[sec][name] = v
    kwargs = {}
    for sec in fields(root):
        cls = type(sec.default)
        known = {f.name: f for f in _section_fields(cls)}
        unknown = set(values[sec.name]) - set(known)
        if unknown:
            raise ConfigError(f"unknown setting(s) {sorted(unknown)} in section [{sec.name}]")
        for name, v in values[sec.name].items():
            values[sec.name][name] = _coerce(cls, known[name], v, sec.name)
        try:
            kwargs[sec.name] = replace(sec.default, **values[sec.name])
        except TypeError as e:
            raise ConfigError(f"section [{sec.name}]: {e}") from e
    return root(**kwargs)


def _coerce(cls, f: dataclasses.Field, v: Any, section: str) -> Any:
    t = _type_of(cls, f)
    if v is None:
        return v
    ok = isinstance(v, t) and not (t is not bool and isinstance(v, bool))
    if t is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if t is str and isinstance(v, list) and all(isinstance(x, str) for x in v):
        return ",".join(v)  # TOML lists of addresses
    if not ok:
        raise ConfigError(f"{section}.{f.name}={v!r} is invalid: expected {t.__name__}")
    return v


def describe(cfg) -> str:
    """The resolved configuration as TOML-like lines, printed at start-up."""
    lines = []
    for sec in fields(cfg):
        lines.append(f"[{sec.name}]")
        sub = getattr(cfg, sec.name)
        for f in _section_fields(type(sub)):
            lines.append(f"  {f.name} = {getattr(sub, f.name)!r}")
    return "\n".join(lines)
