"""FSDP2 learner units: parameters, gradients and optimizer state sharded across a node's processes.

For models that do not fit one device (``ddiloco node --nproc N --shard``). ``ShardedUnit`` runs
``node.learner.unit.Unit``'s exchange over shards. The learner builds its model on the CPU; ``fully_shard`` then
takes it block by block (the elements of its ModuleLists, innermost first) and finally as a whole, so each
rank keeps its dim-0 slice of every tensor (``torch.chunk``'s layout) on its device, with the inner AdamW
state beside it. Rank 0 still speaks for the unit but no longer holds whole fragments, so everything that
reads or writes whole tensors is a collective every rank joins at the same point:

* contributions: after a step, each fragment that falls due is gathered whole (``DTensor.full_tensor``) on
  every rank, in the same order: each step's control message names the fragments rank 0 takes after that
  step (due on the swarm's schedule, which only rank 0 reads), and every rank gathers them (``after_step``).
* adoption: rank 0 broadcasts the whole new values of each adopted fragment (the global fragment; with
  alpha != 0 its mix with the fragment gathered just before) and every rank copies its own slice.
* STATE: the same broadcast of every fragment from rank 0's whole model, then the inner optimizer's state
  tensor by tensor, each rank keeping its slice.
* checkpoints (``exchange(save=True)``) and the stop: every rank joins the gather of the whole parameters
  and optimizer state onto rank 0. At the stop rank 0 becomes a single-process CPU learner holding them, so
  its final checkpoint and its last adoptions need no collective.

Checks. A slice lives on one rank only, so between adoptions there is no second copy to compare. Where rank
0 knows what every slice must hold (after STATE, after each adoption or repair), each rank digests its
slices, the digests are gathered, and rank 0 compares each with the digest of the same slice cut from the
values it sent. Equal digests mean the whole fragment the unit holds, which is what the next gather
returns, is bit for bit what rank 0 adopted. A rank that differs is counted, logged and sent the fragment
again. A DDP unit's periodic whole-model comparison has no counterpart here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from node.learner.snapshot import Snapshots
from node.learner.unit import STATE, Unit, digest
from protocol.errors import ConfigError
from protocol.merge import adopt

logger = logging.getLogger(__name__)


def check_shardable(model: nn.Module) -> None:
    """Raise ``ConfigError`` naming why FSDP2 cannot shard ``model`` as this unit does."""
    params = list(model.named_parameters())
    name = type(model).__name__
    if not params:
        raise ConfigError(f"shard=True is invalid for {name}: it has no parameters to shard")
    scalars = [n for n, p in params if p.dim() == 0]
    if scalars:
        raise ConfigError(
            f"shard=True is invalid for {name}: FSDP2 cannot shard 0-dim parameters ({', '.join(scalars[:4])}); "
            "make them 1-element tensors or run without --shard"
        )
    every = list(model.named_parameters(remove_duplicate=False))
    if len(every) > len(params):
        once = {n for n, _ in params}
        tied = [n for n, _ in every if n not in once]
        raise ConfigError(
            f"shard=True is invalid for {name}: it ties parameters across modules ({', '.join(tied[:4])} is "
            "another module's tensor, e.g. tied input and output embeddings), which this unit does not shard; "
            "untie them (tie_word_embeddings=false in config.json) or run without --shard"
        )
    dtypes = sorted({str(p.dtype) for _, p in params})
    if len(dtypes) > 1 or not params[0][1].is_floating_point():
        raise ConfigError(
            f"shard=True is invalid for {name}: its parameters are {', '.join(dtypes)}; FSDP2 gathers a "
            "block's parameters as one floating dtype: use one, or run without --shard"
        )


def check_plan(plan) -> None:
    """Raise ``ConfigError`` where the fragment plan cuts a tensor by rows (``protocol.fragments``): this
    unit gathers and scatters whole tensors."""
    if plan.sliced:
        raise ConfigError(
            "shard=True: this unit shards whole tensors and the swarm's plan cuts the embedding's rows into "
            "several fragments; run every node of the swarm with --embedding-cuts 1"
        )


def shard_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules sharded on their own before the root: the elements of the model's ModuleLists (its
    transformer blocks), innermost first, as ``fully_shard`` needs children before their parents."""
    inner = {id(m) for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml}
    return [
        m
        for m in reversed(list(model.modules()))
        if id(m) in inner and next(m.parameters(), None) is not None
    ]


def slices(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """The slice each rank holds of a tensor placed ``Shard(0)``: ``torch.chunk``'s pieces, and nothing for
    the ranks past the last piece."""
    parts = list(torch.chunk(t, world, dim=0))
    return parts + [t[:0]] * (world - len(parts))


@dataclass(frozen=True)
class _Slice:
    """Stands in a broadcast optimizer state for a tensor shaped like its parameter, sent on its own."""

    dtype: torch.dtype


@dataclass
class ShardedUnit(Unit):
    """An FSDP2 unit: every rank holds a slice of each tensor."""

    saved: tuple | None = None  # rank 0: (parameters, optimizer state) gathered by the last save
    _expected: dict[int, dict[str, torch.Tensor]] = field(
        default_factory=dict
    )  # rank 0: sent, not yet verified
    _start_opt: dict | None = None  # rank 0: its optimizer state before sharding, for STATE
    mode: ClassVar[str] = "fsdp"

    def model_device(self) -> torch.device:
        return torch.device("cpu")  # fully_shard moves each block's slices to the unit's device

    def attach(self, learner) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = learner.model
        check_shardable(model)
        check_plan(learner.plan)
        if self.lead:  # rank 0's whole model and optimizer state: what STATE hands every rank
            self._expected = {
                f.index: {n: learner.params[n].detach().to("cpu").clone() for n in f.names}
                for f in learner.plan.fragments
            }
            self._start_opt = learner.opt.state_dict()
        mesh = init_device_mesh(self.device().type, (self.world,))
        try:
            for m in shard_blocks(model):
                fully_shard(m, mesh=mesh)
            fully_shard(model, mesh=mesh)
        except (ValueError, AssertionError, RuntimeError, TypeError) as e:
            raise ConfigError(
                f"shard=True: FSDP2 could not shard {type(model).__name__}: {e}; run the node without --shard"
            ) from e
        learner.params = dict(model.named_parameters())
        for n, p in learner.params.items():
            want = slices(torch.empty(p.shape, device="meta"), self.world)[self.rank].shape
            if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),) or p.to_local().shape != want:
                raise ConfigError(f"shard=True: FSDP2 laid out {n} in a way this unit does not handle")
        learner.forward_model = model
        learner.device = self.device()
        learner.snaps = Snapshots(learner.device)
        learner.sharded = True
        learner._new_optimizer()  # over the shards; STATE fills it

    def after_step(self, learner, due: list[int]) -> None:
        for p in due:  # rank 0 gathers the same fragments, in the same order, for its snapshot
            learner.fragment_params(p)

    # ------------------------------------------------------------------ whole tensors in, slices kept
    def _scatter(self, param: DTensor, full: torch.Tensor | None, dtype: torch.dtype) -> DTensor:
        """Rank 0's whole tensor (``full``, None elsewhere) broadcast; this rank's slice of it, as a DTensor
        laid out like ``param``."""
        dev = self.device()
        buf = full.to(dev) if self.lead else torch.empty(param.shape, dtype=dtype, device=dev)
        dist.broadcast(buf, 0)
        return distribute_tensor(buf, param.device_mesh, param.placements, src_data_rank=None)

    def _send(self, learner, frags: list[int], fresh: set[int], carried: set[int]) -> None:
        if not frags:
            return
        alpha = learner.pcfg.alpha
        for p in frags:
            # the new values depend on the old ones: every rank joins the gather, one fragment at a time
            with torch.no_grad():
                old = learner.fragment_params(p) if p in carried or alpha != 0.0 else None
            if self.lead and (p in fresh or p not in self._expected):  # else a repair: values already sent
                theta = learner.base[p]
                moved = learner.shift.pop(p, None)  # carried: keep the unit's progress, add the change
                dtype = {n: learner.params[n].dtype for n in theta}
                self._expected[p] = {
                    n: (old[n].cpu().float() + moved[n]).to(dtype[n])
                    if moved
                    else adopt(old[n].cpu(), theta[n], alpha)
                    if alpha != 0.0
                    else theta[n].to(dtype[n])
                    for n in learner.plan.fragments[p].names
                }
            del old
        learner.snaps.fence()
        with torch.no_grad():
            for p in frags:
                for n in learner.plan.fragments[p].names:
                    param = learner.params[n]
                    mine = self._scatter(param, self._expected[p][n] if self.lead else None, param.dtype)
                    param.to_local().copy_(mine.to_local())

    def _state(self, learner) -> None:
        self._send(learner, list(range(len(learner.plan.fragments))), set(), set())
        names = list(learner.params)
        head, opt = None, None
        if self.lead:
            opt, self._start_opt = self._start_opt, None
            state = {}
            for i, st in opt["state"].items():
                shape = learner.params[names[i]].shape
                state[i] = {
                    k: _Slice(v.dtype) if torch.is_tensor(v) and v.dim() > 0 and v.shape == shape else v
                    for k, v in st.items()
                }
            head = {
                "state": state,
                "param_groups": opt["param_groups"],
                "seed": learner.seed,
                "data_position": learner.data_position(),
            }
        box = [head]
        dist.broadcast_object_list(box, 0, device=self.device())
        head = box[0]
        state = {}
        for i in sorted(head["state"]):
            param = learner.params[names[i]]
            state[i] = {}
            for k in sorted(head["state"][i]):
                v = head["state"][i][k]
                if isinstance(v, _Slice):
                    v = self._scatter(param, opt["state"][i][k] if self.lead else None, v.dtype)
                state[i][k] = v
        learner.load_optimizer({"state": state, "param_groups": head["param_groups"]})
        if not self.lead:
            learner.gen.manual_seed(head["seed"] + 1_000_003 * self.rank)  # each rank its own batches
            learner.seed = head["seed"]
            learner.use_lane(self.rank, self.world, head["data_position"])  # its own part of the data

    def _gather(self, learner) -> tuple[dict[str, torch.Tensor], dict] | None:
        """Every rank: join the gather of the whole parameters and optimizer state; rank 0 gets them (CPU)."""
        params = {}
        for n, p in learner.params.items():
            full = p.full_tensor()
            if self.lead:
                params[n] = full.detach().to("cpu")
        osd = learner.opt.state_dict()
        layout = sorted((i, sorted(st)) for i, st in osd["state"].items())
        every = [None] * self.world
        dist.all_gather_object(every, layout)
        if any(x != layout for x in every):  # the same answer on every rank: all raise together
            raise RuntimeError(
                "the unit's ranks hold optimizer state for different parameters; cannot gather it"
            )
        state = {}
        for i, keys in layout:
            state[i] = {}
            for k in keys:
                v = osd["state"][i][k]
                if isinstance(v, DTensor):
                    v = v.full_tensor()
                if self.lead:
                    state[i][k] = v.detach().to("cpu").clone() if torch.is_tensor(v) else v
        return (params, {"state": state, "param_groups": osd["param_groups"]}) if self.lead else None

    def _save(self, learner) -> None:
        self.saved = self._gather(learner)

    def take_saved(self) -> tuple[dict[str, torch.Tensor], dict]:
        saved, self.saved = self.saved, None
        if saved is None:
            raise RuntimeError("no state was gathered: ask for it with exchange(..., save=True)")
        return saved

    def _stop(self, learner) -> None:
        full = self._gather(learner)
        if self.lead:
            learner.unshard(*full)

    # ------------------------------------------------------------------ checks
    def _to_check(self, learner, op: int, frags: list[int], check_all: bool) -> list[int]:
        return list(range(len(learner.plan.fragments))) if op == STATE else frags

    def _digest(self, learner, frags: list[int]) -> torch.Tensor:
        return digest(learner.params[n].to_local() for p in frags for n in learner.plan.fragments[p].names)

    def _expect(self, learner, frags: list[int], got: list[torch.Tensor]) -> list[torch.Tensor]:
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        for p in frags:
            for n in learner.plan.fragments[p].names:
                for r, s in enumerate(slices(self._expected[p][n], self.world)):
                    per_rank[r].append(s)
        return [digest(ts) for ts in per_rank]

    def _checked(self, frags: list[int]) -> None:
        for p in frags:
            self._expected.pop(p, None)
