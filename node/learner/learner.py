"""A learner: one model training on its own data with its own AdamW, never waiting on peers
(docs/design.md, section 1).

The learner owns its parameters, its inner optimizer and ``LearnerBook`` counters. It hands out fragment
contributions (outer gradient against the global fragment it last received, encoded by the wire codec) and
adopts merged global fragments when they arrive. Transport, clock and scheduling belong to whoever drives it:
the in-process runner or a node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from node.learner.inner import InnerConfig, lr_lambda  # noqa: F401 - InnerConfig, lr_lambda are imported from here too
from node.learner.learner_state import learner_state, load_learner_state
from node.learner.model import flush_lookup, lean_lookup
from node.learner.snapshot import Snapshots
from node.learner.task import Task
from protocol.codecs import Encoded, get_codec
from protocol.config import ProtocolConfig
from protocol.fragments import FragmentPlan, plan_fragments
from protocol.learner_book import LearnerBook
from protocol.merge import adopt

SENT_KEPT = 4  # carry: contributions per fragment remembered until a round merges them
RESIDUAL_CODEC = "int8"  # how error feedback keeps what the wire codec dropped


def plan_for(task: Task, model: torch.nn.Module, pcfg: ProtocolConfig) -> FragmentPlan:
    params = dict(model.named_parameters())
    shapes = {n: p.numel() for n, p in params.items()}
    rows = params[task.embedding].shape[0] if task.embedding in params else None
    return plan_fragments(
        shapes,
        pcfg.fragments_for(len(shapes)),
        pcfg.sync_every,
        embedding=task.embedding,
        embedding_rows=rows,
        embedding_cuts=pcfg.embedding_cuts,
    )


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _held(g: torch.Tensor) -> torch.Tensor:
    """A global fragment's tensor as a base: itself when fp32 on the host (a merge makes new tensors, and
    those handed to a learner are never written to), else an fp32 copy; so a base shares the replica's memory."""
    g = g.detach()
    return g if g.device.type == "cpu" and g.dtype == torch.float32 else g.to("cpu", torch.float32)


@dataclass
class StepResult:
    loss: float
    tokens: int
    due: list[int]


class Learner:
    def __init__(
        self,
        name: str,
        task: Task,
        pcfg: ProtocolConfig,
        inner: InnerConfig,
        total_steps: int,
        seed: int,
        device: torch.device | None = None,
        plan: FragmentPlan | None = None,
        data_part: tuple[int, int] | None = None,
    ) -> None:
        self.name = name
        self.task = task
        self.pcfg = pcfg
        self.inner = inner
        self.device = device or default_device()
        self.model = task.new_model().to(self.device)
        self.params = dict(self.model.named_parameters())
        self.plan = plan or plan_for(task, self.model, pcfg)
        self.total_steps = total_steps
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)
        # The task's data reader, when it has one (the user's data): part k of n of it, or the whole in an
        # order of the learner's own seed. Its position goes into the checkpoint.
        self.data_part = data_part if data_part is not None else getattr(task, "data_part", None)
        self.reader = None
        self.use_lane(0, 1)
        self.forward_model: torch.nn.Module = self.model  # a DDP wrapper when the learner spans processes
        self.sharded = False  # set by an FSDP2 unit: ``params`` are this rank's shards (DTensors)
        self.snaps = Snapshots(self.device)  # due fragments on their way to the host
        self.tokens_per_step = task.tokens_per_batch  # the whole unit's tokens in one inner step
        self.book = LearnerBook(self.plan)
        self.steps = 0  # inner steps over the learner's life; drives the lr schedule, survives rejoins
        self._lr = lr_lambda(total_steps, inner)
        self._new_optimizer()
        # The global fragment last received, per fragment: contributions are measured against it.
        self.base = [self._fragment_fp32(f.index) for f in self.plan.fragments]
        # Sharded + carry: per adopted fragment, the global change the unit must still add to every slice
        # (None: the fragment was overwritten, the unit writes the base).
        self.shift: dict[int, dict[str, torch.Tensor] | None] = {}
        # Carry: per fragment, its latest contributions not known to be merged: ((c_steps, c_tokens) as sent,
        # c_steps, c_tokens, delta) with the last three less what an older merged contribution held.
        self.sent: dict[int, list[tuple[tuple[int, int], int, int, dict[str, torch.Tensor]]]] = {}
        self.overwrites = [0] * len(self.plan.fragments)  # per fragment: adoptions that did not keep
        self.kept = False  # the last adoption kept the learner's unmerged progress (carry)
        # Error feedback (``ProtocolConfig.feedback``): per fragment, what its contributions' codec dropped
        # and the next contribution of it has not sent yet, kept in int8 on the host (a quarter of the fp32
        # weights; its own error, at most 1/254 of each block's largest value, is far below int2's).
        self.residual: dict[int, dict[str, Encoded]] = {}
        self.last_loss = float("nan")

    def attach_unit(self, unit) -> None:
        """Span a ``node.learner.unit.Unit``: gradients averaged over its ranks (DDP, or FSDP2 shards), steps count
        the unit's tokens."""
        unit.attach(self)
        self.tokens_per_step = self.task.tokens_per_batch * unit.world
        self.use_lane(unit.rank, unit.world)

    def use_lane(self, rank: int, world: int, position: int | None = None) -> None:
        """Read the data part of rank ``rank`` of a unit of ``world`` ranks: the unit's part split ``world``
        ways (disjoint), at ``position`` (batches read; default: where the reader is)."""
        if not hasattr(self.task, "reader"):
            return
        k, n = self.data_part or (0, 1)
        old = self.reader
        # part k of n is the slots = k (mod n); rank r of w takes every w-th of those from the r-th
        self.reader = self.task.reader((rank * n + k, n * world), None if self.data_part else self.seed)
        if self.reader is not None:
            self.reader.position = position if position is not None else (old.position if old else 0)

    def data_position(self) -> int:
        return self.reader.position if self.reader is not None else 0

    def unshard(self, params: dict[str, torch.Tensor], opt_state: dict) -> None:
        """Become a single-process learner on the CPU again, from the unit's gathered whole state (rank 0 of
        a sharded unit at its stop, so the final checkpoint and adoptions need no collective)."""
        model = self.task.new_model()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
        self.model = self.forward_model = model
        self.params = dict(model.named_parameters())
        self.device = torch.device("cpu")
        self.snaps = Snapshots(self.device)
        self.sharded = False
        self.load_optimizer(opt_state)

    def load_optimizer(self, state: dict) -> None:
        self._new_optimizer()
        self.opt.load_state_dict(state)

    def _new_optimizer(self) -> None:
        # fused: one pass over each tensor and no whole-model temporaries (the default foreach kernels make
        # several); on a CPU its step took 0.2 s against 1.0 s for GPT-2 small's 124M parameters
        fused = not self.sharded and all(p.device.type in ("cpu", "cuda") for p in self.model.parameters())
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.inner.lr,
            betas=(0.9, 0.95),
            weight_decay=self.inner.weight_decay,
            fused=fused or None,
        )

    def _fragment_fp32(self, p: int) -> dict[str, torch.Tensor]:
        """Fragment p as an fp32 copy on the host, where every base lives (contributions are measured there)."""
        return {
            n: self.tensor(n).detach().to("cpu", torch.float32).clone() for n in self.plan.fragments[p].names
        }

    def tensor(self, name: str) -> torch.Tensor:
        """Fragment tensor ``name``: a parameter, or a view of rows of one (see ``protocol.fragments``)."""
        return self.plan.tensor(self.params, name)

    def train_step(self) -> StepResult:
        batch = self.reader.next() if self.reader is not None else self.task.batch(self.gen)
        lean_lookup(
            self.model, self.forward_model is self.model and not self.sharded and self.device.type == "cpu"
        )
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.task.loss(self.forward_model, batch)
        for g in self.opt.param_groups:
            g["lr"] = self.inner.lr * self._lr(self.steps)
        self.opt.zero_grad(set_to_none=True)  # none left unless the last step stopped half-way
        loss.backward()
        flush_lookup(self.model)
        if self.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
        self.snaps.fence()  # a GPU copy of a due fragment may still be reading the parameters
        self.opt.step()
        # free the gradients now, not at the next step: they would live beside the next forward's activations
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        self.last_loss = loss.item()
        due = self.book.on_step(self.tokens_per_step)
        return StepResult(self.last_loss, self.tokens_per_step, due)

    def outer_gradient(self, p: int) -> dict[str, torch.Tensor]:
        """base - theta for fragment p, fp32 on the CPU, now (the in-process runner's synchronous path)."""
        base = self.base[p]
        full = self.fragment_params(p)
        return {n: (base[n] - full[n].to("cpu", torch.float32)) for n in base}

    def contribution(self, p: int) -> dict[str, Encoded]:
        delta = self.outer_gradient(p)
        c = self.book.counters[p]
        self._remember(p, delta, c.c_steps, c.c_tokens)
        return self._encode(p, delta)

    def _encode(self, p: int, delta: dict[str, torch.Tensor]) -> dict[str, Encoded]:
        """Fragment p's outer gradient in the wire codec; with error feedback, the gradient plus what the codec
        dropped of p's earlier contributions, and what it drops now is kept for the next one (``residual``).
        ``delta`` itself is left as it is (carry keeps it)."""
        codec, block = get_codec(self.pcfg.codec), self.pcfg.codec_block
        if not self.pcfg.error_feedback:
            return {n: codec.encode(d, block) for n, d in delta.items()}
        kept, held = self.residual.setdefault(p, {}), get_codec(RESIDUAL_CODEC)
        out = {}
        for n, d in delta.items():
            r = kept.get(n)
            x = d + held.decode(r).view_as(d) if r is not None else d.clone()
            out[n] = codec.encode(x, block)
            kept[n] = held.encode(x.sub_(codec.decode(out[n])), block)
        return out

    def fragment_params(self, p: int) -> dict[str, torch.Tensor]:
        """Fragment p's whole parameters on the learner's device: the live parameters themselves, or, when
        sharded, gathered from every rank's shard (a collective: every rank of the unit calls this at the
        same point, see ``Unit.after_step``)."""
        names = self.plan.fragments[p].names
        if self.sharded:
            return {n: self.params[n].full_tensor() for n in names}
        return {n: self.tensor(n).detach() for n in names}

    def snapshot(self, p: int, tag: object = None) -> None:
        """Start taking fragment p's contribution as of now; ``ready_contributions`` hands it out once its
        copy to the host is done (at once on the CPU). The base it is measured against is the one held now."""
        c = self.book.counters[p]
        mark = (tag, c.c_steps, c.c_tokens, self.overwrites[p])
        self.snaps.take(p, self.fragment_params(p), self.base[p], mark, live=not self.sharded)

    def ready_contributions(self, wait: bool = False) -> list[tuple[object, int, dict[str, Encoded]]]:
        """(tag, fragment, encoded base - theta) of every snapshot whose copy is done, oldest first."""
        out = []
        for s in self.snaps.collect(wait):
            tag, c_steps, c_tokens, overwrites = s.tag
            # base - theta, written over the snapshot's own host copy where it is fp32 (no second tensor)
            delta = {
                n: torch.sub(s.base[n], h, out=h) if h.dtype == torch.float32 else s.base[n] - h.float()
                for n, h in s.host.items()
            }
            if overwrites == self.overwrites[s.fragment]:  # else what it measured is gone already
                self._remember(s.fragment, delta, c_steps, c_tokens)
            out.append((tag, s.fragment, self._encode(s.fragment, delta)))
        return out

    def _remember(self, p: int, delta: dict[str, torch.Tensor], c_steps: int, c_tokens: int) -> None:
        """Carry: keep what this contribution of p holds (its progress and counters), until a round merges
        it; the last ``SENT_KEPT`` per fragment."""
        if self.pcfg.carry:
            kept = self.sent.setdefault(p, [])
            kept.append(((c_steps, c_tokens), c_steps, c_tokens, delta))
            del kept[:-SENT_KEPT]

    def _merged_share(self, p: int, merged: list[tuple[int, int]]) -> tuple[int, int, dict | None]:
        """Of this learner's contributions of p, the newest that ``merged`` (its (c_steps, c_tokens) in a
        round) names: its counters and progress. It and older ones leave ``sent``; newer ones, which hold
        its progress too, drop that part (the global has it now)."""
        kept = self.sent.get(p, [])
        # An entry is known by the counters it was *sent* with (what a merge record names), and holds what
        # of it the global does not have yet: after an older contribution merged, a newer one keeps its key
        # but its counters and progress drop that part.
        hit = max((i for i, (key, *_) in enumerate(kept) if key in merged), default=None)
        if hit is None:
            return 0, 0, None
        _, cs, ct, delta = kept[hit]
        rest = [(key, a - cs, b - ct, {n: d[n] - delta[n] for n in d}) for key, a, b, d in kept[hit + 1 :]]
        self.sent[p] = [r for r in rest if r[1] > 0]
        return cs, ct, delta

    def adopt(
        self, p: int, round_: int, theta: dict[str, torch.Tensor], merged: list[tuple[int, int]] | None = None
    ) -> bool:
        """Adopt merged global fragment p of ``round_``; False if it is older than what we hold.

        ``merged``: the (c_steps, c_tokens) of each of this learner's contributions the round merged (empty:
        none; None: unknown). With ``carry`` on and ``merged`` known, the learner keeps what the global does
        not hold yet: theta += (Theta_new - base) + delta_merged, where delta_merged = base - theta at the
        merged contribution (zero when the round left this learner out). Its counters keep counting, less
        the merged contribution's. Otherwise the global overwrites (alpha = 0) or mixes in."""
        keep = self.pcfg.carry and merged is not None
        if round_ <= self.book.counters[p].base_round:
            return False
        cs, ct, delta = self._merged_share(p, merged) if keep and merged else (0, 0, None)
        self.book.on_receive(p, round_, keep=keep, spent=(cs, ct))
        self.kept = keep
        if not keep:
            self.overwrites[p] += 1
            self.sent.pop(p, None)
        change = {}
        if keep:
            for n, g in theta.items():
                change[n] = g.detach().to("cpu", torch.float32) - self.base[p][n]
                if delta is not None:
                    change[n] += delta[n]
        # A sharded learner holds a slice of each tensor: its unit writes every rank's slice in its next
        # exchange, from the base set here (so of two rounds adopted between steps, only the newer is mixed)
        # or, when carrying, by adding the summed change kept in ``shift``.
        if self.sharded:
            if not keep:
                self.shift[p] = None  # overwritten: the unit writes the base, whatever is carried after
            elif self.shift.get(p, {}) is not None:
                moved = self.shift.setdefault(p, {})
                for n, c in change.items():
                    moved[n] = moved.get(n, 0) + c
        else:
            self.snaps.fence()
            with torch.no_grad():
                for n, g in theta.items():
                    mine = self.tensor(n)
                    if keep:
                        mine.add_(change[n].to(self.device, mine.dtype))
                    elif (
                        self.pcfg.alpha == 0.0
                    ):  # overwrite straight from the global (adopt's clone is a copy)
                        mine.copy_(g)
                    else:
                        mine.copy_(adopt(mine.detach(), g.to(self.device), self.pcfg.alpha))
        self.base[p] = {n: _held(g) for n, g in theta.items()}
        return True

    def join(self, rounds: list[int], thetas: list[dict[str, torch.Tensor]], schedule_step: int = 0) -> None:
        """(Re)join: take the whole global model, start fresh counters and a fresh inner optimizer.

        ``schedule_step`` puts the learner's fragment schedule in phase with the swarm's (a donor's step), so
        systems whose learners wait for each other's fragments keep contributing the same fragment together.
        """
        self._whole("join the swarm")
        self.book = LearnerBook(self.plan, step=schedule_step)
        self.sent.clear()
        self.residual.clear()  # owed to a model this learner no longer holds
        self.overwrites = [n + 1 for n in self.overwrites]
        self.snaps.fence()
        with torch.no_grad():
            for p, (r, theta) in enumerate(zip(rounds, thetas)):
                for n, g in theta.items():
                    self.tensor(n).copy_(g.to(self.device))
                self.base[p] = {n: _held(g) for n, g in theta.items()}
                self.book.counters[p].base_round = r
        self._new_optimizer()

    def resync(self, p: int, round_: int, theta: dict[str, torch.Tensor]) -> None:
        """Take global fragment p of ``round_`` whatever round we hold (the swarm settled on another chain).
        With carry the learner's own progress moves onto that chain, as after any round that left it out;
        without, the chain's fragment overwrites."""
        self.book.counters[p].base_round = round_ - 1
        self.adopt(p, round_, theta, merged=[])

    def drop_unmerged(self) -> None:
        """Go back to the global fragments last received, with fresh counters (AdamW state is kept).

        For a learner restored from a checkpoint after a crash: what it had trained and not yet merged when
        the checkpoint was written may have been merged since, before the crash, so sending it again would
        count it twice."""
        self._whole("drop its unmerged progress")
        self.snaps.fence()
        with torch.no_grad():
            for p, base in enumerate(self.base):
                for n, t in base.items():
                    mine = self.tensor(n)
                    mine.copy_(t.to(self.device, mine.dtype))
                c = self.book.counters[p]
                c.c_steps = c.c_tokens = 0
        self.sent.clear()

    def _whole(self, what: str) -> None:
        if self.sharded:
            raise RuntimeError(
                f"cannot {what} while the learner is sharded: a sharded unit takes whole state at its start "
                "exchange (STATE) and gathers it with exchange(save=True)"
            )

    # ---- checkpoints: tensors (flat names) and JSON metadata (``node.learner.learner_state``)
    def state(
        self, full: tuple[dict[str, torch.Tensor], dict] | None = None, copy: bool = True
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """The learner's checkpoint; see ``learner_state``."""
        return learner_state(self, full, copy)

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        load_learner_state(self, tensors, meta)
