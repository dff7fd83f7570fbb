"""Fragment planning and the staggered schedule (docs/design.md, section 1).

The model's parameter tensors are bin-packed, whole, into P fragments of near-equal element count
(largest first, each into the lightest fragment); the token embedding is its own fragment. Where the
embedding alone is more than twice a fragment's mean share, its rows are cut into k fragments of their own
(``name[a:b]``: rows a to b), k its share over the mean, and the other tensors go into the remaining P - k: at
GPT-2 small's vocabulary the embedding is a third of the model, and as one fragment every round of it (a
snapshot, a merge, an audit, a base kept until adopted) held copies ten times another fragment's size.
Fragment p is due at learner step t (counted from 1) when t = offset(p) (mod H), with offsets spread evenly
over [0, H).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.errors import ConfigError

if TYPE_CHECKING:
    import torch

_ROWS = re.compile(r"^(.+)\[(\d+):(\d+)\]$")


def row_slice(name: str) -> tuple[str, int, int] | None:
    """(tensor, first row, end row) of a fragment name that is rows of a tensor, else None."""
    m = _ROWS.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def split_cuts(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, list[tuple[int, int, torch.Tensor]]]]:
    """Fragment tensors by name: the whole ones, and per cut tensor its rows as (first, end, rows) in row
    order."""
    whole: dict[str, torch.Tensor] = {}
    cuts: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    for n, t in tensors.items():
        cut = row_slice(n)
        if cut is None:
            whole[n] = t
        else:
            cuts.setdefault(cut[0], []).append((cut[1], cut[2], t))
    for rows in cuts.values():
        rows.sort(key=lambda r: r[0])
    return whole, cuts


def join_rows(name: str, rows: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """Tensor ``name`` from its cuts (``split_cuts``' order) as one new tensor; KeyError if rows are missing."""
    import torch  # local: the plan itself needs no torch

    if rows[0][0] != 0 or any(x[1] != y[0] for x, y in zip(rows, rows[1:])):
        raise KeyError(f"rows of {name} missing: have {[(a, b) for a, b, _ in rows]}")
    return torch.cat([t for _, _, t in rows])


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

    @property
    def sliced(self) -> bool:
        """Whether some fragment holds rows of a tensor rather than whole tensors."""
        return any(row_slice(n) for f in self.fragments for n in f.names)

    @staticmethod
    def tensor(params: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        """Fragment tensor ``name`` of a model's ``params`` (by parameter name): the parameter itself, or a
        view of its rows (writing to it writes the parameter)."""
        cut = row_slice(name)
        if cut is None:
            return params[name]
        whole, a, b = cut
        return params[whole][a:b]

    @staticmethod
    def whole(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fragment tensors (every fragment's, by fragment name) as model parameters: row slices joined in
        row order (a new tensor), the rest as they are. KeyError if a tensor's rows do not all appear."""
        out, cuts = split_cuts(tensors)
        out.update({n: join_rows(n, rows) for n, rows in cuts.items()})
        return out

    def imbalance(self) -> float:
        """Largest non-embedding fragment over the mean of non-embedding fragments (1.0 = perfect)."""
        sizes = [f.numel for f in self.fragments if not f.is_embedding]
        return max(sizes) / (sum(sizes) / len(sizes)) if sizes else 1.0


def plan_fragments(
    shapes: dict[str, int],
    num_fragments: int,
    sync_every: int,
    embedding: str | None = None,
    embedding_rows: int | None = None,
    embedding_cuts: int = 0,
) -> FragmentPlan:
    """Cut tensors (name -> element count, in model order) into ``num_fragments`` fragments; the
    embedding's rows (``embedding_rows`` of them; None: never cut) into ``embedding_cuts`` fragments (0: its
    share of the model in mean fragment shares, where that is 2 or more)."""
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
    cuts = 1
    if emb_alone and embedding_rows:
        # k fragments of rows: the embedding's share of the model in fragments' mean shares, when two or more
        share = shapes[embedding] * num_fragments // sum(shapes.values())
        room = min(embedding_rows, num_fragments - 1)
        want = embedding_cuts or (min(share, room) if share >= 2 else 1)
        if want > room:
            raise ConfigError(
                f"embedding_cuts={want} is invalid: the embedding has {embedding_rows} rows and "
                f"{num_fragments} fragments leave room for at most {num_fragments - 1} cuts of it"
            )
        cuts = want
    n_bins = num_fragments - cuts if emb_alone else num_fragments
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
    numel = dict(shapes)
    if emb_alone and cuts > 1:
        rows = embedding_rows or 1
        edges = [i * rows // cuts for i in range(cuts + 1)]
        sliced = [f"{embedding}[{a}:{b}]" for a, b in zip(edges, edges[1:])]
        for n, a, b in zip(sliced, edges, edges[1:]):
            numel[n] = shapes[embedding] // rows * (b - a)
        groups[:0] = [[n] for n in sliced]
    elif emb_alone:
        groups.insert(0, [embedding])
    frags = []
    for i, names in enumerate(groups):
        offset = (i * sync_every) // num_fragments
        frags.append(
            Fragment(
                index=i,
                names=tuple(names),
                numel=sum(numel[n] for n in names),
                is_embedding=emb_alone and i < cuts,
                offset=offset,
            )
        )
    return FragmentPlan(tuple(frags), sync_every)
