"""Configuration of one node of a real swarm (``ddiloco node``): its settings and the sections it runs with."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from node.common.heap import AUTO_MMAP_PARAMS
from node.learner.learner import InnerConfig
from node.learner.model import ModelConfig
from node.learner.task import TaskConfig
from protocol.config import ProtocolConfig
from protocol.errors import ConfigError
from protocol.systems import SYSTEMS

NODE_SYSTEMS = tuple(x for x in SYSTEMS if x != "dp")  # what a real node runs


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
    rpc_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "deadline of one request to a peer for its round trips and handler; a body it carries "
            "is allowed 2x its time at the rate measured on that peer's link on top (node.swarm.links)"
        },
    )
    link_floor_mbps: float = field(
        default=1.0,
        metadata={
            "help": "the slowest link rate (Mbit/s) a body's time is counted at, before this node has "
            "measured the peer's link and whatever it measures"
        },
    )
    checkpoint_every_s: float = field(
        default=60.0, metadata={"help": "checkpoint period, the first 10 s after joining (0: only at exit)"}
    )
    checkpoint_cpu_share: float = field(
        default=0.01,
        metadata={
            "help": "the most of one core that periodic checkpoints may take: after one that took C CPU "
            "seconds (writing and hashing), the next waits at least C / this (0: the period alone)"
        },
    )
    eval_every_s: float = field(default=60.0, metadata={"help": "evaluate the global model this often"})
    eval_cpu_share: float = field(
        default=0.01,
        metadata={
            "help": "the most of one core that periodic evaluations may take: after one that took C CPU "
            "seconds, the next waits at least C / this (0: eval_every_s alone)"
        },
    )
    malloc_mmap_mib: float = field(
        default=-1.0,
        metadata={
            "help": "give every allocation of at least this many MiB pages of its own, returned to the "
            "system when freed (glibc's M_MMAP_THRESHOLD; 0: the C library's own rule; -1: 0.25 for a model "
            f"of {AUTO_MMAP_PARAMS // 10**6}M parameters or more, else blocks up to 32 MiB from the heaps and "
            "free memory up to 1.25x the weights kept for the next step): less resident memory, more page "
            "faults (docs/node.md, Status)"
        },
    )
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
    open_learners: bool = field(
        default=False,
        metadata={
            "help": "a swarm made with 'ddiloco swarm init --open-learners': anyone may join as a learner (no "
            "certificate, never elected), synchronisers hold certificates, nothing is sealed (no "
            "--swarm-secret), and merges are robust"
        },
    )
    audit: str = field(
        default="auto",
        metadata={
            "help": "share of merge records a drawn member recomputes from their signed contributions, 0 to 1 "
            "(a record that does not follow from them bans its signer everywhere and is undone); auto: 1 "
            "where learners are not vouched for (a public or open-learners swarm), else 0 (docs/security.md)"
        },
    )
    elect: str = field(
        default="auto",
        metadata={
            "help": "who may be elected synchroniser: workers (members whose learner's work the chain this node "
            "follows credits, once it has watched the swarm merge for 3 round periods; anyone where none is), "
            "or anyone; "
            "auto: workers in a public swarm (no --authority), anyone where an authority certifies "
            "synchronisers (docs/security.md)"
        },
    )
    revoked: str = field(
        default="",
        metadata={"help": "private swarm: file of revoked peer ids, one a line (re-read on change)"},
    )
    ban_after: float = field(
        default=10.0,
        metadata={"help": "ban a peer after this many refused hostile messages (net of accepted work)"},
    )
    ban_s: float = field(default=300.0, metadata={"help": "how long a ban lasts (s)"})
    peer_inflight_mib: float = field(
        default=512.0,
        metadata={
            "help": "request bytes (MiB) one peer may have being read at once; more: refused peer_busy"
        },
    )
    snapshot_burst: int = field(
        default=0,
        metadata={
            "help": "fragment snapshots one peer may fetch at once (0: 4 x the fragments); refills "
            "at snapshots_per_min; over it: refused rate_limited"
        },
    )
    snapshots_per_min: float = field(
        default=0.0,
        metadata={
            "help": "fragment snapshots per minute one peer may fetch, sustained (0: 4 x the fragments)"
        },
    )
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
        default="",
        metadata={
            "help": "final global model file (default: STATE_DIR/model.safetensors); a transformers model "
            "also as a save_pretrained folder beside it (model.safetensors -> model-hf/)"
        },
    )
    test_hooks: bool = field(
        default=False,
        metadata={"help": "enable test-only controls (block: a partition; forget: lost contributions)"},
    )
    exit_with_parent: bool = field(
        default=False, metadata={"help": "stop when the launching process dies (set by 'ddiloco up')"}
    )

    def __post_init__(self) -> None:
        if self.open_learners and (not self.authority or self.swarm_secret):
            raise ConfigError(
                "open_learners: a swarm of open learners needs its --authority (certified synchronisers) and no "
                "--swarm-secret (nothing is sealed where anyone may join)"
            )
        if self.authority and not self.open_learners and not (self.certificate and self.swarm_secret):
            raise ConfigError(
                "authority is set (a private swarm) but certificate or swarm_secret is not: a member needs "
                "its admission certificate ('ddiloco swarm admit') and the swarm secret file"
            )
        if self.audit != "auto":
            try:
                ok = 0.0 <= float(self.audit) <= 1.0
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(f"audit={self.audit!r} is invalid: auto, or a share of records in [0, 1]")
        if self.elect not in ("auto", "workers", "anyone"):
            raise ConfigError(f"elect={self.elect!r} is invalid: auto, workers or anyone")
        if not 0 <= self.agent_nice <= 19:
            raise ConfigError(f"agent_nice={self.agent_nice} is invalid: must be in [0, 19]")
        if not 0 <= self.learner_nice <= 19:
            raise ConfigError(f"learner_nice={self.learner_nice} is invalid: must be in [0, 19]")
        if self.system not in NODE_SYSTEMS:
            raise ConfigError(
                f"system={self.system!r} is invalid: a node runs one of {', '.join(NODE_SYSTEMS)} "
                "(data-parallel runs only in the in-process runner and bench/wan.py)"
            )
        if not (0 <= self.malloc_mmap_mib <= 32 or self.malloc_mmap_mib == -1):
            raise ConfigError(
                f"malloc_mmap_mib={self.malloc_mmap_mib} is invalid: must be in [0, 32] (glibc's largest "
                "threshold is 32 MiB; 0 leaves the C library's rule) or -1 (by the model's size)"
            )
        for name in ("checkpoint_cpu_share", "eval_cpu_share"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} is invalid: must be in [0, 1)")
        if self.nproc < 1:
            raise ConfigError(f"nproc={self.nproc} is invalid: a learner unit needs at least 1 process")
        for name in (
            "heartbeat_s",
            "ttl_s",
            "failover_s",
            "rpc_timeout_s",
            "link_floor_mbps",
            "unit_timeout_s",
            "block_timeout_s",
            "ban_after",
            "ban_s",
            "eval_every_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} is invalid: must be > 0")
        if not self.peer_inflight_mib > 0:
            raise ConfigError(f"peer_inflight_mib={self.peer_inflight_mib} is invalid: must be > 0")
        if self.snapshot_burst < 0 or not self.snapshots_per_min >= 0:
            raise ConfigError(
                f"snapshot_burst={self.snapshot_burst}, snapshots_per_min={self.snapshots_per_min} are "
                "invalid: must be >= 0 (0: the default, 4 x the fragments)"
            )
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

    @property
    def trusted(self) -> bool:
        """Every learner is vouched for: a private swarm, sealed, each member with a certificate (``robust``
        ``auto`` then leaves the merge plain)."""
        return bool(self.authority) and not self.open_learners

    @property
    def elect_workers(self) -> bool:
        """Only members whose work this node's chain credits are electable (``elect``, with auto resolved):
        identities are free where no authority certifies synchronisers (a Sybil's copies would
        win elections)."""
        return self.elect == "workers" or (self.elect == "auto" and not self.authority)

    @property
    def audit_share(self) -> float:
        """The share of merge records audited (``audit``, with auto resolved)."""
        return (0.0 if self.trusted else 1.0) if self.audit == "auto" else float(self.audit)

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
