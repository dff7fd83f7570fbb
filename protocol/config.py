"""Algorithm parameters (docs/design.md, section 1) as a frozen dataclass, validated before anything runs.

Defaults are the paper's at scale (P = H = 24, tau = 2, K = 1, gamma = 0.5, outer SGD lr 0.7 Nesterov 0.9); P is
one a parameter tensor for a model of fewer than 24 tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from protocol.errors import ConfigError

MERGE_METHODS = ("rda", "mean")
FEEDBACK = ("auto", "on", "off")


DEFAULT_FRAGMENTS = 24
# The settings a node writes into its tape's ``join`` record: what ``ddiloco replay`` needs to re-decide its
# rounds with the same rules (the schedule, the quorum and grace, carry, the codecs, the history kept).
TAPE_SETTINGS = ("sync_every", "overlap", "quorum", "grace", "grace_gamma", "ema_beta", "carry", "codec",
                 "codec_block", "record_codec", "history")  # fmt: skip


@dataclass(frozen=True)
class ProtocolConfig:
    """How fragments are cut, scheduled, collected and merged."""

    fragments: int = field(
        default=0,
        metadata={
            "help": f"P: number of parameter fragments; 0: {DEFAULT_FRAGMENTS}, or one per parameter tensor "
            "when the model has fewer (the start-up log says so)"
        },
    )
    embedding_cuts: int = field(
        default=0,
        metadata={
            "help": "fragments the token embedding's rows are cut into; 0: its share of the model counted "
            "in mean fragment shares, where that is 2 or more (GPT-2's vocabulary: 7 of 24), else 1"
        },
    )
    sync_every: int = field(default=24, metadata={"help": "H: inner steps between two syncs of a fragment"})
    overlap: int = field(
        default=2, metadata={"help": "tau: steps a merged fragment is expected to take back"}
    )
    quorum: int = field(default=1, metadata={"help": "K: minimum learners merged per round"})
    grace: bool = field(default=True, metadata={"help": "wait an adaptive grace window for stragglers"})
    grace_gamma: float = field(default=0.5, metadata={"help": "gamma < 1: share of the spare budget to wait"})
    ema_beta: float = field(default=0.8, metadata={"help": "smoothing of the measured times (xi) EMAs"})
    outer_lr: float = field(default=0.7, metadata={"help": "outer SGD learning rate"})
    outer_momentum: float = field(default=0.9, metadata={"help": "outer SGD Nesterov momentum"})
    alpha: float = field(default=0.0, metadata={"help": "adoption mix: theta <- a*theta + (1-a)*Theta"})
    carry: bool = field(
        default=False,
        metadata={
            "help": "off (the paper's rule): an adopted round overwrites the learner's fragment and resets its "
            "counters. On: a learner keeps the progress the global does not hold yet through adoptions and "
            "re-syncs (rebased onto the new global), and a round's outer gradient is scaled by its share of "
            "a full round, at most 1"
        },
    )
    merge: str = field(default="rda", metadata={"help": "merge for non-embedding fragments: rda | mean"})
    codec: str = field(
        default="int4", metadata={"help": "outer gradients on the wire: fp32|bf16|int8|int4|int2"}
    )
    feedback: str = field(
        default="auto",
        metadata={
            "help": "error feedback: a learner adds what its last contribution of a fragment lost to the codec "
            "to its next one (a residual kept in int8, a quarter of the weights' fp32 bytes) | auto: on for "
            "int2, off otherwise | on | off"
        },
    )
    codec_block: int = field(default=64, metadata={"help": "elements per quantisation scale"})
    record_codec: str = field(
        default="int4",
        metadata={
            "help": "merged outer gradient in merge records: fp32|bf16|int8|int4|int2 (every replica, the "
            "synchroniser's included, steps with the decoded values)"
        },
    )
    clip_factor: float = field(
        default=3.0,
        metadata={
            "help": "robust merge: an outer gradient whose norm exceeds this multiple of the median of the "
            "learners' latest norms for the fragment (3+ learners) is scaled down to it (0: off)"
        },
    )
    refuse_factor: float = field(
        default=1000.0,
        metadata={
            "help": "refuse (too_large) an outer gradient over this multiple of that median (0: off). Honest "
            "learners differ by 100x and more (a learner still in its lr warm-up beside one past it, a "
            "learner that made many more steps): under this factor an outlier is clipped, not refused"
        },
    )
    work_factor: float = field(
        default=4.0,
        metadata={
            "help": "refuse (bad_counters) a contribution claiming more tokens a step than this multiple of "
            "the live members' median, or more steps than this multiple of what its sender's published rate "
            "allows since its last merged contribution (3+ members publishing rates; 0: off)"
        },
    )
    robust: str = field(
        default="auto",
        metadata={
            "help": "merge where learners are not trusted: auto (centered-clip in a public swarm, off in a "
            "private one and in train-local) | off | centered-clip (weighted CenteredClip of each tensor's "
            "contributions, of their directions for RDA tensors: a minority of the weight moves a merge a "
            "bounded amount whatever it sends; docs/security.md)"
        },
    )
    distrust: bool = field(
        default=True,
        metadata={
            "help": "robust merge: refuse the contributions of a learner whose outer gradients' directions "
            "stayed opposed to the rest of this node's merges, never half the learners it judged "
            "(protocol.agreement; a plain merge measures nothing and distrusts nobody)"
        },
    )
    share_cap: float = field(
        default=1.0,
        metadata={
            "help": "robust merge: a contribution's weight is at most this multiple of the low median weight "
            "of its merge (0: no cap)"
        },
    )
    max_rms: float = field(
        default=1.0,
        metadata={
            "help": "refuse (too_large) an outer gradient whose RMS per parameter exceeds this (0: off)"
        },
    )
    history: int = field(
        default=4,
        metadata={
            "help": "merge records kept per fragment (each about 1/7 of the fragment's fp32 bytes in int4), to "
            "re-anchor contributions taken on older rounds and to let peers catch up by records; a peer "
            "further behind downloads a snapshot"
        },
    )

    @property
    def error_feedback(self) -> bool:
        """Whether learners keep the residual of their contributions' codec (``feedback``)."""
        return self.feedback == "on" or (self.feedback == "auto" and self.codec == "int2")

    def __post_init__(self) -> None:
        from protocol.codecs import CODECS  # local: codecs imports torch, config should stay light

        def bad(name: str, value: object, want: str) -> ConfigError:
            return ConfigError(f"{name}={value!r} is invalid: {want}")

        if self.fragments < 0:
            raise bad(
                "fragments", self.fragments, f"need at least 1 fragment (0: {DEFAULT_FRAGMENTS} or fewer)"
            )
        if self.embedding_cuts < 0:
            raise bad("embedding_cuts", self.embedding_cuts, "need 0 (chosen by size) or at least 1")
        if self.sync_every < 1:
            raise bad("sync_every", self.sync_every, "H must be >= 1")
        if not 0 <= self.overlap < self.sync_every:
            raise bad("overlap", self.overlap, f"tau must satisfy 0 <= tau < H (H={self.sync_every})")
        if self.quorum < 1:
            raise bad("quorum", self.quorum, "K must be >= 1")
        if not 0.0 <= self.grace_gamma < 1.0:
            raise bad("grace_gamma", self.grace_gamma, "gamma must be in [0, 1)")
        if not 0.0 <= self.ema_beta < 1.0:
            raise bad("ema_beta", self.ema_beta, "beta must be in [0, 1)")
        if self.outer_lr <= 0:
            raise bad("outer_lr", self.outer_lr, "must be > 0")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise bad("outer_momentum", self.outer_momentum, "must be in [0, 1)")
        if not 0.0 <= self.alpha < 1.0:
            raise bad("alpha", self.alpha, "must be in [0, 1); 0 means overwrite")
        if self.merge not in MERGE_METHODS:
            raise bad("merge", self.merge, f"choose one of {', '.join(MERGE_METHODS)}")
        from protocol.robust import ROBUST_RULES

        if self.robust not in ROBUST_RULES:
            raise bad("robust", self.robust, f"choose one of {', '.join(ROBUST_RULES)}")
        if not self.share_cap >= 0:
            raise bad("share_cap", self.share_cap, "must be >= 0 (0: no cap)")
        if self.codec not in CODECS:
            raise bad("codec", self.codec, f"unknown codec; choose one of {', '.join(sorted(CODECS))}")
        if self.record_codec not in CODECS:
            raise bad(
                "record_codec", self.record_codec, f"unknown codec; choose one of {', '.join(sorted(CODECS))}"
            )
        from protocol.codecs import PACKED

        packed = max(PACKED.get(self.codec, 1), PACKED.get(self.record_codec, 1))
        if self.codec_block < 1 or self.codec_block % packed:
            raise bad(
                "codec_block", self.codec_block, "must be >= 1, even for int4, a multiple of 4 for int2"
            )
        if self.feedback not in FEEDBACK:
            raise bad("feedback", self.feedback, f"choose one of {', '.join(FEEDBACK)}")
        if self.clip_factor < 0 or self.refuse_factor < 0 or self.max_rms < 0:
            raise bad("clip_factor/refuse_factor", (self.clip_factor, self.refuse_factor), "must be >= 0")
        if not self.work_factor >= 0:  # NaN fails too
            raise bad("work_factor", self.work_factor, "must be >= 0 (0: no bound)")
        if 0 < self.refuse_factor <= self.clip_factor:
            raise bad("refuse_factor", self.refuse_factor, f"must exceed clip_factor={self.clip_factor}")
        if self.history < 2:
            raise bad("history", self.history, "keep at least 2 rounds")

    def fragments_for(self, tensors: int) -> int:
        """P for a model of ``tensors`` parameter tensors: as set, or (0) the default, at most one a tensor."""
        return self.fragments or min(DEFAULT_FRAGMENTS, tensors)

    def check_swarm(self, learners: int, tensors: int) -> None:
        """Validate against the run: M learners and a model with ``tensors`` parameter tensors."""
        if learners < 1:
            raise ConfigError(f"learners={learners} is invalid: need at least 1")
        if self.quorum > learners:
            raise ConfigError(f"quorum={self.quorum} is invalid: K cannot exceed the {learners} learners (M)")
        if self.fragments > tensors:  # set by the user; the default (0) takes what the model allows
            raise ConfigError(
                f"fragments={self.fragments} is invalid: the model has only {tensors} parameter tensors and a "
                f"fragment holds whole tensors; use --fragments {tensors} or fewer"
            )
        if not self.fragments and tensors < DEFAULT_FRAGMENTS:
            logging.getLogger(__name__).warning(
                "fragments: %d, one per parameter tensor (the model has fewer than the default %d); "
                "--fragments sets it",
                tensors,
                DEFAULT_FRAGMENTS,
            )
