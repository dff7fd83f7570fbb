"""A replica of one global fragment: Theta_p, its outer momentum, and what re-anchors older bases.

Every node keeps one per fragment (docs/design.md, section 4, "Replicated global state"). The
synchroniser of a round turns contributions into a ``MergeRecord`` with ``make_record``; every replica, the
synchroniser's included, applies that record with ``apply_record`` and checks it lands on the record's hash.

History holds no copies of the fragment: for each of the last ``history`` rounds it keeps that round's
merged outer gradient as it travels (the record's codec, int4 by default: about 1/7 of the fragment's fp32
bytes), or a callable that decodes it again from the signed record the node logs anyway. A contribution
taken on an older base is re-anchored by walking the outer steps back from the current state
(``base``): Theta_{r-1} = Theta_r + lr (g_r + mu v_r), v_{r-1} = (v_r - g_r) / mu.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from protocol.codecs import Decoded, Encoded, fresh, get_codec, range_align, ranges, read_range
from protocol.config import ProtocolConfig
from protocol.errors import HashMismatch, ProtocolError, RejectCode
from protocol.hashing import tensors_hash
from protocol.merge import (
    anchor_tensor,
    can_step_in_place,
    check_weights,
    contribution_weight,
    mean_step,
    outer_theta,
    outer_theta_tensor,
    rda,
    stepped_momentum,
)
from protocol.norms import NormBook, global_norm, sq_norm
from protocol.record_checks import check_record, readable
from protocol.robust import agreements, new_gram, robust_parts
from protocol.schedule import RoundClock, next_clock
from protocol.synchroniser import Contribution, round_share


@dataclass(frozen=True)
class MergeRecord:
    fragment: int
    round: int
    parent_hash: str
    new_hash: str
    contributors: tuple[tuple[str, str, float, int, int], ...]  # (learner, cid, weight, c_steps, c_tokens)
    grad: Mapping[str, torch.Tensor]  # the merged outer gradient, as every replica applies it (decoded)
    codec: str = "fp32"  # how ``grad`` travels
    block: int = 64
    wire: Mapping[str, Encoded] | None = None  # ``grad`` encoded with ``codec``; None: fp32 as is
    clipped: tuple[str, ...] = ()  # contribution ids scaled down by the robust merge (local, not signed)
    agreement: tuple[float, ...] = ()  # per contributor (robust merges): protocol.robust.agreements; local
    due: float = 0.0  # when this round was taken, on the swarm's clock (protocol.schedule); signed
    period: float = 0.0  # the swarm's step period then (0: no schedule); the next round is due H periods on
    # Signed, for an audit to recompute the merge (protocol.audit): per contributor, the sha256 of the message
    # its learner signed ("" where the merge had none: the in-process runner) and the scale the merge gave it
    # (below 1: clipped against the norms the synchroniser had seen); and the round's share (``carry``).
    digests: tuple[str, ...] = ()
    scales: tuple[float, ...] = ()
    share: float = 1.0


GradSource = Mapping[str, "torch.Tensor | Encoded"] | Callable[[], Mapping[str, torch.Tensor]]


def _grad_of(src: GradSource) -> Mapping[str, torch.Tensor]:
    if callable(src):
        return src()
    if any(isinstance(v, Encoded) for v in src.values()):
        return Decoded(src)  # each tensor decoded as it is read
    return src


def _fp32(v: torch.Tensor | Encoded) -> torch.Tensor:
    """A contribution's tensor in fp32: decoded from its wire form, or as it is."""
    if isinstance(v, Encoded):
        return get_codec(v.codec).decode(v)
    return v.float()


def _owned(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).clone()


def _as_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.dtype == torch.float32 else t.detach().to(torch.float32)


class FragmentReplica:
    def __init__(
        self,
        index: int,
        theta: Mapping[str, torch.Tensor],
        is_embedding: bool,
        history: int = 4,
        norms: NormBook | None = None,
        copy: bool = True,
    ):
        """``copy=False``: take ``theta``'s fp32 tensors as they are (the caller never writes to them)."""
        self.index = index
        self.is_embedding = is_embedding
        self.theta = {k: (_owned if copy else _as_fp32)(v) for k, v in theta.items()}
        self.momentum = {k: torch.zeros_like(v) for k, v in self.theta.items()}
        self.round = 0
        self._history_len = history
        # round r -> (how to get round r's merged gradient again, outer lr, outer momentum)
        self._past: OrderedDict[int, tuple[GradSource, float, float]] = OrderedDict()
        self._hash = tensors_hash(self.theta)
        # The outcome of the record this replica made last: applying its own record needs no recompute.
        self._made: tuple[MergeRecord, dict[str, torch.Tensor]] | None = None
        self.norms = norms if norms is not None else NormBook()  # shared by a node's fragments
        self.numel = sum(t.numel() for t in self.theta.values())
        self.clock: RoundClock | None = None  # when the open round is due (None: no record says yet)
        # >0 while another thread reads the momentum (a checkpoint, a snapshot): records step it out of place
        self.lent = 0

    def norm_reference(self) -> float | None:
        """The norm a typical learner's outer gradient for this fragment has (None until 3 learners known)."""
        rms = self.norms.reference_rms()
        return None if rms is None else rms * math.sqrt(self.numel)

    @property
    def hash(self) -> str:
        return self._hash

    def load_state(
        self,
        round_: int,
        theta: Mapping[str, torch.Tensor],
        momentum: Mapping[str, torch.Tensor],
        clock: RoundClock | None = None,
        copy: bool = True,
    ) -> None:
        """Replace this replica's state by a verified snapshot (join or re-sync); history restarts there.
        ``clock``: when the round after it is due, as the snapshot's donor holds it. ``copy=False``: take
        fp32 tensors as they are (freshly decoded ones nobody else holds)."""
        if set(theta) != set(self.theta) or set(momentum) != set(self.theta):
            raise ProtocolError(
                RejectCode.WRONG_SHAPE, f"snapshot of fragment {self.index} names other tensors"
            )
        for k, v in self.theta.items():
            if tuple(theta[k].shape) != tuple(v.shape) or tuple(momentum[k].shape) != tuple(v.shape):
                raise ProtocolError(RejectCode.WRONG_SHAPE, f"snapshot tensor {k} has the wrong shape")
        own = _owned if copy else _as_fp32
        self.theta = {k: own(t) for k, t in theta.items()}
        self.momentum = {k: own(t) for k, t in momentum.items()}
        self.round = round_
        self._hash = tensors_hash(self.theta)
        self._made = None
        self._past.clear()
        self.clock = clock if clock is not None and clock.round == round_ + 1 else None

    def keeps(self, round_: int) -> bool:
        """Whether a contribution taken on global round ``round_`` can still be re-anchored here."""
        return round_ == self.round or (
            round_ < self.round and all(r in self._past for r in range(round_ + 1, self.round + 1))
        )

    def history_tensors(self) -> list[torch.Tensor]:
        """The tensors the history holds (for the node's memory account)."""
        out = []
        for src, _, _ in list(self._past.values()):
            if isinstance(src, Mapping):
                for v in src.values():
                    out.extend(v.parts.values() if isinstance(v, Encoded) else [v])
        return out

    def base(self, round_: int) -> dict[str, torch.Tensor]:
        """Global round ``round_`` of this fragment: the current state, or rebuilt by walking the outer
        steps of the rounds since back (fp32; within a few ulps of the state that round had)."""
        return self.theta if round_ == self.round else self.walk_back(round_, momentum=False)[0]

    def walk_back(
        self, round_: int, momentum: bool = True
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Theta and the outer momentum at round ``round_``, walked back through the outer steps a range at a
        time into a copy of each (whole tensors held 8x the fragment at 85M). ``momentum=False``: the
        momentum is not walked through the last step."""
        steps = self.past_steps(round_)
        if not steps:
            return dict(self.theta), dict(self.momentum)
        theta = {k: v.clone(memory_format=torch.contiguous_format) for k, v in self.theta.items()}
        own = momentum or len(steps) > 1  # the momentum is written: a copy of its own
        mom = {
            k: v.clone(memory_format=torch.contiguous_format) if own else v for k, v in self.momentum.items()
        }
        for i, (grad, lr, mu) in enumerate(steps):
            walk_mom = momentum or i + 1 < len(steps)
            for k, g in readable(grad).items():
                th, mo = theta[k].view(-1), mom[k].reshape(-1)
                for a, b in ranges(th.numel(), range_align(g)):
                    gr = read_range(g, a, b)
                    th[a:b].add_(mo[a:b], alpha=lr * mu).add_(gr, alpha=lr)  # + lr (g + mu v)
                    if walk_mom:  # v <- (v - g) / mu
                        mo[a:b].sub_(gr).div_(mu) if mu != 0 else mo[a:b].zero_()
        return theta, mom

    def rewind(self, round_: int, momentum: bool = True) -> None:
        """Undo the rounds after ``round_`` (a convicted record and those on top of it), walking the state back
        through their outer steps (within a few ulps, so under a hash of its own); history keeps the rounds up
        to it. ``momentum=False`` (an audit's view, which never steps): see ``walk_back``."""
        theta, mom = self.walk_back(round_, momentum)
        self.theta, self.momentum, self.round = theta, mom, round_
        self._hash, self._made = tensors_hash(theta), None
        self._past = OrderedDict((r, s) for r, s in self._past.items() if r <= round_)
        self.clock = None

    def past_steps(self, round_: int) -> list[tuple[Mapping[str, torch.Tensor], float, float]]:
        """The outer steps from round ``round_`` to now, newest first: (merged gradient, each tensor decoded
        as it is read; outer lr; outer momentum). Raises ``stale_base`` where the history no longer has them."""
        if not self.keeps(round_):
            raise ProtocolError(
                RejectCode.STALE_BASE,
                f"fragment {self.index} no longer keeps round {round_} (now at {self.round})",
            )
        return [(_grad_of(self._past[r][0]), *self._past[r][1:]) for r in range(self.round, round_, -1)]

    def check_delta(
        self,
        delta: Mapping[str, torch.Tensor | Encoded],
        cfg: ProtocolConfig | None = None,
        learner: str | None = None,
    ) -> float:
        """Shape, name and finiteness checks of an outer gradient against this fragment (fp32 tensors, or
        their wire form, decoded here one tensor at a time), and with ``cfg`` its norm against ``max_rms``
        and ``refuse_factor`` times the learners' typical one. Returns its global norm (the same pass).

        ``learner``: whose it is. A size refused against the reference is still that learner's size now, and
        is entered in the norm book as such: the book otherwise learnt only from what was merged, and a book
        seeded by a swarm's first contributions (a few steps at the start of the lr warm-up, 1,000-15,000x
        smaller than a minute later) refused every honest contribution after them, learnt nothing more, and
        its node banned every honest peer (a ``ddiloco up`` run in a suite). The reference is the median over
        learners of each one's median: a liar's refused sizes raise its own median alone."""
        if set(delta) != set(self.theta):
            raise ProtocolError(
                RejectCode.WRONG_SHAPE,
                f"fragment {self.index} expects tensors {sorted(self.theta)}, got {sorted(delta)}",
            )
        sq = 0.0
        for k, d in delta.items():
            if tuple(d.shape) != tuple(self.theta[k].shape):
                raise ProtocolError(
                    RejectCode.WRONG_SHAPE, f"{k}: shape {tuple(d.shape)} != {tuple(self.theta[k].shape)}"
                )
            part = sq_norm(d)  # finite exactly when every value is
            if not math.isfinite(part):
                raise ProtocolError(RejectCode.NOT_FINITE, f"{k} contains NaN or inf")
            sq += part
        n = math.sqrt(sq)
        if cfg is None:
            return n
        rms = n / math.sqrt(max(1, self.numel))
        if cfg.max_rms > 0 and rms > cfg.max_rms:
            raise ProtocolError(
                RejectCode.TOO_LARGE,
                f"outer gradient RMS {rms:.3g} per parameter exceeds max_rms {cfg.max_rms:g}",
            )
        ref = self.norm_reference() if cfg.refuse_factor > 0 else None
        if ref is not None and n > cfg.refuse_factor * ref:
            if learner is not None:
                self.norms.add(learner, rms)
            raise ProtocolError(
                RejectCode.TOO_LARGE,
                f"outer gradient norm {n:.3g} is {n / ref:.0f}x the fragment's recent median {ref:.3g} "
                f"(limit {cfg.refuse_factor:g}x)",
            )
        return n

    def make_record(
        self,
        round_: int,
        contributions: Sequence[Contribution],
        cfg: ProtocolConfig,
        live: int = 0,
        due: float = 0.0,
        period: float = 0.0,
        given: MergeRecord | None = None,
    ) -> MergeRecord:
        """Merge ``contributions`` into round ``round_`` (docs/design.md, section 1, steps 3-6). With
        ``cfg.carry`` and ``live`` learners known, the merged outer gradient is scaled by ``round_share``.
        ``due`` and ``period``: the round's moment and the swarm's step period, for the schedule
        (``protocol.schedule``).

        The robust merge measures each learner's own outer gradient (against the base it was taken on) and
        scales that part alone: Theta_now - theta_m = (Theta_now - base) + s * delta. The part the global
        itself moved since that base is no learner's to clip.

        ``given``: an audit's recompute of it (``protocol.audit``): its scales and share; the gradient alone."""
        if round_ != self.round + 1:
            raise ProtocolError(RejectCode.STALE_BASE, f"merge of round {round_} on replica at {self.round}")
        weights = [contribution_weight(c.c_tokens, c.c_steps) for c in contributions]
        rebuilt = {r: self.base(r) for r in {c.base_round for c in contributions}}  # each old base once
        bases = [rebuilt[c.base_round] for c in contributions]
        clipped = []
        ref = self.norm_reference() if cfg.clip_factor > 0 else None
        scales = []
        for c in contributions if given is None else ():
            n = c.norm if c.norm is not None else global_norm(c.delta)
            scale = 1.0
            if ref is not None and n > cfg.clip_factor * ref:
                scale = cfg.clip_factor * ref / n
                clipped.append(c.cid)
            scales.append(scale)
            self.norms.add(c.learner, n / math.sqrt(max(1, self.numel)))
        if given is not None:
            scales = list(given.scales)

        def anchored(k: str) -> Iterator[torch.Tensor]:
            """Each contribution's outer gradient of tensor ``k`` at the current global, decoded one at a time
            and the merge's own (a tensor it holds is copied): one fp32 contribution of one tensor at a time."""
            for c, base, scale in zip(contributions, bases, scales):
                v = c.delta[k]
                d = _fp32(v)
                if scale != 1.0:
                    d = d * scale
                elif base is self.theta and not fresh(v):
                    d = d.clone()  # still the contribution's own tensor (fp32 decodes to a view)
                yield anchor_tensor(self.theta[k], base[k], d, base is self.theta)
                del d

        check_weights(len(contributions), weights)
        share = (
            given.share if given is not None else round_share(contributions, cfg, live) if cfg.carry else 1.0
        )
        # Quantised once here; every replica, this one too, steps with the decoded values: one new hash anywhere
        codec = None if cfg.record_codec == "fp32" else get_codec(cfg.record_codec)
        lr, mu = cfg.outer_lr, cfg.outer_momentum
        grad, new_theta = {}, {}
        gram = new_gram(cfg, len(contributions))  # their inner products, if robust (in an audit too)
        for k, theta in self.theta.items():
            mean = self.is_embedding or cfg.merge == "mean"  # a range at a time, whatever the tensor's size
            if mean or cfg.robust == "centered-clip":
                parts = [
                    (c.delta[k], None if b is self.theta else b[k], s)
                    for c, b, s in zip(contributions, bases, scales)
                ]
                parts, ws = robust_parts(theta, parts, weights, cfg, radial=not mean, gram=gram)
                grad[k], new_theta[k] = mean_step(
                    theta, self.momentum[k], parts, ws, share, codec, cfg.codec_block, lr, mu, given is None
                )
                continue
            g = rda(anchored(k), weights, owned=True)  # RDA needs each contribution's whole tensor
            if share < 1.0:
                g = g * share
            grad[k] = g if codec is None else codec.encode(g, cfg.codec_block)
            del g
            if given is None:  # an audit compares gradients: no outer step
                new_theta[k] = outer_theta_tensor(theta, self.momentum[k], grad[k], lr, mu)
        rec = MergeRecord(
            fragment=self.index,
            round=round_,
            parent_hash=self._hash,
            new_hash=tensors_hash(new_theta) if given is None else "",  # an audit compares gradients only
            contributors=tuple(
                (c.learner, c.cid, w, c.c_steps, c.c_tokens) for c, w in zip(contributions, weights)
            ),
            grad=grad if codec is None else Decoded(grad),
            codec=cfg.record_codec,
            block=cfg.codec_block,
            wire=None if codec is None else grad,
            clipped=tuple(clipped),
            agreement=() if gram is None else agreements(gram),
            due=float(due),
            period=float(period),
            digests=tuple(c.digest for c in contributions),
            scales=tuple(float(s) for s in scales),
            share=float(share),
        )
        self._made = (rec, new_theta) if given is None else None  # the momentum steps when it is applied
        return rec

    def take_made(self, view: FragmentReplica) -> None:
        """Adopt the outcome of the record last made on ``view`` (a ``protocol.audit.frozen_view`` of this
        replica, merged off the applying thread): applying that record here needs no recompute."""
        self._made = view._made

    def check_record(self, rec: MergeRecord, cfg: ProtocolConfig) -> None:
        """What a replica checks of another node's merge record before applying it (``protocol.record_checks``)."""
        check_record(self, rec, cfg)

    def apply_record(self, rec: MergeRecord, cfg: ProtocolConfig, source: GradSource | None = None) -> None:
        """Apply ``rec`` (raises ProtocolError if it does not follow this replica or misses its hash).
        ``source``: how to get the record's merged gradient again later, e.g. by decoding the signed record
        its caller keeps (default: the record's wire tensors, else its decoded gradient)."""
        if rec.round != self.round + 1 or rec.parent_hash != self._hash:
            raise ProtocolError(
                RejectCode.STALE_BASE,
                f"record for round {rec.round} (parent "
                f"{rec.parent_hash[:8]}) does not follow round {self.round} ({self._hash[:8]})",
            )
        grad, lr, mu = readable(rec.grad), cfg.outer_lr, cfg.outer_momentum
        if self._made is not None and self._made[0] is rec:
            theta, new_hash = self._made[1], rec.new_hash
        else:
            theta = outer_theta(self.theta, self.momentum, grad, lr, mu)
            new_hash = tensors_hash(theta)
        if new_hash != rec.new_hash:
            raise HashMismatch(
                f"round {rec.round} of fragment {self.index} lands on "
                f"{new_hash[:8]}, record says {rec.new_hash[:8]}"
            )
        # the momentum steps once the hash is right: in place, unless another thread reads it now
        in_place = not self.lent and can_step_in_place(self.momentum)
        mom = stepped_momentum(self.momentum, grad, mu, in_place)
        self.theta, self.momentum, self.round, self._hash = theta, mom, rec.round, new_hash
        self._made = None
        if source is None:
            source = dict(rec.wire) if rec.wire is not None else dict(readable(rec.grad))
        self._past[rec.round] = (source, cfg.outer_lr, cfg.outer_momentum)
        self.clock = next_clock(rec.round, rec.due, rec.period, cfg.sync_every, before=self.clock)
        while len(self._past) > self._history_len:
            self._past.popitem(last=False)
