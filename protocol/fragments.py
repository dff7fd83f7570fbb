"""Fragment planning and the staggered schedule (DESIGN §1).

The model's parameter tensors are bin-packed, whole, into P fragments of near-equal element count
(largest first, each into the lightest fragment); the token embedding is its own fragment. Fragment p is
due at learner step t (counted from 1) when t = offset(p) (mod H), with offsets spread evenly over [0, H).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ConfigError


@dataclass(frozen=True)
class Fragment:
    index: int
    names: tuple[str, ...]
    numel: int
    is_embedding: bool
    offset: int  # due at steps t with t % H == offset


@dataclass(frozen=True)
class FragmentPlan:
    fragments: tuple[Fragment, ...]
    sync_every: int

    @property
    def total_numel(self) -> int:
        return sum(f.numel for f in self.fragments)

    def fragment_of(self, name: str) -> int:
        for f in self.fragments:
            if name in f.names:
                return f.index
        raise KeyError(name)

    def due(self, step: int) -> list[int]:
        """Fragments due after completing ``step`` (1-based)."""
        if step < 1:
            return []
        r = step % self.sync_every
        return [f.index for f in self.fragments if f.offset == r]

    def imbalance(self) -> float:
        """Largest non-embedding fragment over the mean of non-embedding fragments (1.0 = perfect)."""
        sizes = [f.numel for f in self.fragments if not f.is_embedding]
        return max(sizes) / (sum(sizes) / len(sizes)) if sizes else 1.0


def plan_fragments(
    shapes: dict[str, int], num_fragments: int, sync_every: int, embedding: str | None = None
) -> FragmentPlan:
    """Cut tensors (name -> element count, in model order) into ``num_fragments`` fragments."""
    if num_fragments < 1:
        raise ConfigError(f"fragments={num_fragments} is invalid: need at least 1")
    if num_fragments > len(shapes):
        raise ConfigError(
            f"fragments={num_fragments} is invalid: the model has only {len(shapes)} parameter tensors "
            "and a fragment holds whole tensors"
        )
    if embedding is not None and embedding not in shapes:
        raise ConfigError(f"embedding tensor {embedding!r} is not one of the model's parameters")
    order = {name: i for i, name in enumerate(shapes)}
    bins: list[list[str]] = []
    emb_alone = embedding is not None and num_fragments > 1
    rest = [n for n in shapes if not (emb_alone and n == embedding)]
    n_bins = num_fragments - 1 if emb_alone else num_fragments
    if n_bins > len(rest):
        raise ConfigError(f"fragments={num_fragments} is invalid: not enough non-embedding tensors")
    bins = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for name in sorted(rest, key=lambda n: (-shapes[n], order[n])):
        i = min(range(n_bins), key=lambda b: (loads[b], b))
        bins[i].append(name)
        loads[i] += shapes[name]
    # Order fragments by their first tensor's position in the model, so fragment 0 sits near the input.
    groups = sorted((sorted(b, key=order.__getitem__) for b in bins), key=lambda b: order[b[0]])
    if emb_alone:
        groups.insert(0, [embedding])
    frags = []
    for i, names in enumerate(groups):
        offset = (i * sync_every) // num_fragments
        frags.append(
            Fragment(
                index=i,
                names=tuple(names),
                numel=sum(shapes[n] for n in names),
                is_embedding=(embedding is not None and names == [embedding]),
                offset=offset,
            )
        )
    return FragmentPlan(tuple(frags), sync_every)
