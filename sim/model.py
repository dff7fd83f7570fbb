"""What a simulated cluster is made of, and how long its recoveries take (docs/design.md, section 3,
driver 1).

A cluster of ``chips`` accelerators is cut into M equal blocks of chips (the remainder spread over the first
blocks). In Decoupled DiLoCo each block is a learner; in the two data-parallel systems the blocks step
together as one job and exist only so that speed heterogeneity means the same chips in every system.

Failures. Every running chip is interrupted at rate 1 / ``mtbi_s`` (exponential, one failure per chip-year by
default). The failures of a group of n running chips are one exponential process of rate n / mtbi, so the
engine draws one clock per group and never looks at chips one by one. Only running chips are interrupted: a
chip that sits idle while its group recovers is not (equivalently, a recovery sweeps up every chip that
failed during it). A step in progress when its group is interrupted is lost and redone.

What an interruption costs (one set of times for every system and size; docs/chaos.md says why). A failed
chip takes its host (``host_chips`` chips) out with it. A job is given healthy hosts when it is (re)started,
so a system that restarts comes back at full size on a spare host, while one that shrinks and trains on
gets the host back only when it is repaired (``repair_s``, hours).

  dp           non-elastic data-parallel: every chip stops; a spare host takes the failed one's place
               (``spare_s``), then the whole job restarts from its latest checkpoint (``restart_s``)
  elastic-dp   the job drops the failed host and re-forms its collectives (``resize_s``), then trains on
               without it; the host rejoins at a step boundary when repaired (a planned join costs no pause)
  decoupled    only the failed chip's learner stops. ``learner_recovery = resize`` (default): the learner is
               an elastic group of its own and recovers like elastic-dp, keeping its state and its place in
               the swarm; ``restart``: the learner restarts like a small non-elastic job
               (``spare_s + restart_s``), leaves the live set meanwhile, and loses the work it had not yet
               contributed. The other learners keep training; the synchroniser of every fragment
               (``protocol.synchroniser``) merges with quorum K and its grace window.

Hosts out for repair are in their long-run steady state from t = 0 (``sim.blocks.seed_repairs``), so a
short run measures what a long one would.

Slowdowns. ``slow_learners`` blocks run ``slow_factor`` times slower per step, every step is scaled by a
uniform factor in [1 - jitter, 1 + jitter], and transient slowdowns hit chips at rate 1 /
``slowdown_mtbi_s`` each, making their block ``slowdown_factor`` times slower for ``slowdown_s`` (from the
step after it starts). A data-parallel job steps at the pace of its slowest block.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from protocol.config import ProtocolConfig
from protocol.errors import ConfigError

MINUTE_S = 60.0
HOUR_S = 3600.0
DAY_S = 86400.0
YEAR_S = 365.0 * DAY_S

SYSTEMS = ("dp", "elastic-dp", "decoupled")
RECOVERIES = ("resize", "restart")


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Times are virtual seconds."""

    system: str = field(default="decoupled", metadata={"help": "dp | elastic-dp | decoupled"})
    chips: int = field(default=1_200_000, metadata={"help": "accelerators in the cluster"})
    learners: int = field(default=8, metadata={"help": "M: blocks of chips (learners in decoupled)"})
    duration_s: float = field(default=7 * DAY_S, metadata={"help": "simulated wall-clock time"})
    mtbi_s: float = field(default=YEAR_S, metadata={"help": "mean time between interruptions, per chip"})
    step_s: float = field(default=5.0, metadata={"help": "one inner step (a DP step) at speed 1"})
    host_chips: int = field(default=8, metadata={"help": "chips per host: a failed chip takes its host out"})
    spare_s: float = field(default=25.0, metadata={"help": "a restarting job gets a spare host in place"})
    restart_s: float = field(default=40.0, metadata={"help": "a job restarts from its latest checkpoint"})
    resize_s: float = field(default=15.0, metadata={"help": "an elastic group drops a host and goes on"})
    repair_s: float = field(default=48 * HOUR_S, metadata={"help": "a failed host is repaired and back"})
    learner_recovery: str = field(default="resize", metadata={"help": "decoupled: resize | restart"})
    slow_learners: int = field(default=0, metadata={"help": "blocks that step slow_factor times slower"})
    slow_factor: float = field(default=1.0, metadata={"help": "step-time multiplier of the slow blocks"})
    jitter: float = field(default=0.0, metadata={"help": "each step scaled by U[1 - jitter, 1 + jitter]"})
    slowdown_mtbi_s: float = field(default=math.inf, metadata={"help": "mean time between slowdowns/chip"})
    slowdown_s: float = field(default=60.0, metadata={"help": "how long a transient slowdown lasts"})
    slowdown_factor: float = field(default=2.0, metadata={"help": "step-time multiplier while slowed"})
    quorum: int = field(default=1, metadata={"help": "K: minimum learners merged per round"})
    grace: bool = field(default=True, metadata={"help": "adaptive grace window for stragglers"})
    grace_gamma: float = field(default=0.5, metadata={"help": "share of the spare budget to wait"})
    fragments: int = field(default=24, metadata={"help": "P: parameter fragments"})
    sync_every: int = field(default=24, metadata={"help": "H: steps between two syncs of a fragment"})
    overlap: int = field(default=2, metadata={"help": "tau: steps a merged fragment takes back"})
    contrib_s: float = field(default=1.0, metadata={"help": "a contribution's trip to the synchroniser"})
    sync_s: float = field(default=1.0, metadata={"help": "a merge and its hand-back to the learners"})
    seed: int = field(default=0, metadata={"help": "random seed (a run is deterministic for it)"})

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> ConfigError:
            return ConfigError(f"{name}={getattr(self, name)!r} is invalid: {want}")

        if self.system not in SYSTEMS:
            raise bad("system", f"choose one of {', '.join(SYSTEMS)}")
        if self.learner_recovery not in RECOVERIES:
            raise bad("learner_recovery", f"choose one of {', '.join(RECOVERIES)}")
        if self.chips < 1:
            raise bad("chips", "need at least 1 chip")
        if self.learners < 1:
            raise bad("learners", "M must be >= 1")
        if self.learners > self.chips:
            raise bad("learners", f"every learner needs at least one chip and there are {self.chips}")
        if self.quorum < 1:
            raise bad("quorum", "K must be >= 1")
        if self.quorum > self.learners:
            raise bad("quorum", f"K cannot exceed the {self.learners} learners (M)")
        if not 0 <= self.slow_learners <= self.learners:
            raise bad("slow_learners", f"must be between 0 and the {self.learners} learners")
        for name in ("duration_s", "mtbi_s", "step_s", "slowdown_mtbi_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0 (use inf for 'never')")
        if not math.isfinite(self.duration_s) or not math.isfinite(self.step_s):
            raise bad("duration_s" if not math.isfinite(self.duration_s) else "step_s", "must be finite")
        if self.host_chips < 1:
            raise bad("host_chips", "need at least 1 chip per host")
        for name in ("spare_s", "restart_s", "resize_s", "repair_s", "slowdown_s", "contrib_s", "sync_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise bad(name, "must be a finite time >= 0")
        if self.slow_factor <= 0 or self.slowdown_factor <= 0:
            raise bad("slow_factor" if self.slow_factor <= 0 else "slowdown_factor", "must be > 0")
        if not 0 <= self.jitter < 1:
            raise bad("jitter", "must be in [0, 1)")
        self.protocol()  # validates P, H, tau, gamma against the protocol's own rules

    def protocol(self) -> ProtocolConfig:
        """The synchroniser's configuration (the codec settings do not matter: nothing is encoded)."""
        return ProtocolConfig(
            fragments=self.fragments,
            sync_every=self.sync_every,
            overlap=self.overlap,
            quorum=self.quorum,
            grace=self.grace,
            grace_gamma=self.grace_gamma,
        )

    def block_chips(self) -> list[int]:
        base, extra = divmod(self.chips, self.learners)
        return [base + (1 if m < extra else 0) for m in range(self.learners)]

    def block_factor(self, m: int) -> float:
        """Step-time multiplier of block m (the last ``slow_learners`` blocks are the slow ones)."""
        return self.slow_factor if m >= self.learners - self.slow_learners else 1.0

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}
