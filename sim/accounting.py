"""Goodput of a simulated run, counted as ``protocol.goodput`` counts it (docs/design.md, section 2),
without the records.

``protocol.goodput.compute_goodput`` reads event records: one learner's steps, its contributions of each
fragment, and the merges. A step's work on fragment p is useful (for p's share of parameters) if the
learner's next contribution of p at or after that step was merged (the simulated learners overwrite on
adoption, the paper's rule, and their records say so); steps with no later contribution are
pending and leave both sides of the ratio. The simulator's unit of allocated time is a chip, so its records
name every chip ("learner" ``L3.17`` is chip 17 of block 3), and at a million chips for a week that would
be billions of records. ``Tally`` keeps the same sums in chip-seconds instead:

  * a block's completed steps add ``chips x duration`` to its running busy total B;
  * a contribution of fragment p covers ``(B - B at the block's previous contribution of p) x share(p)``,
    which is exactly the steps ``compute_goodput`` maps to it (every chip of a block, including one away
    for repair, emits the block's contributions: the block's parameters hold that chip's earlier work);
  * a merged contribution turns what it covers into useful time; one never merged (replaced while pending,
    refused, lost with its learner, or still waiting when the run ends) is dropped;
  * at the end, what each block did after its last contribution of p is pending.

``RecordSink`` writes the per-chip records themselves, for small runs (tests check that ``compute_goodput``
over them equals the tally) and for ``ddiloco sim --events``. The engine calls both with the same events.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from protocol.goodput import Goodput


class Tally:
    """Aggregated goodput accounting. ``busy`` is per block; ``marks[b][p]`` is B at b's last p."""

    def __init__(self, blocks: int, shares: list[float]) -> None:
        self.shares = shares
        self.busy = [0.0] * blocks
        self.marks = [[0.0] * len(shares) for _ in range(blocks)]
        self.outstanding: dict[str, tuple[int, float]] = {}  # cid -> (block, chip-seconds it covers)
        self.useful_by_block = [0.0] * blocks
        self.down_s = 0.0
        self.blocked_s = 0.0
        self.lost_s = 0.0  # chip-seconds of steps aborted by a failure (in allocated, never a step)
        self.contributions = 0

    def step(self, b: int, chip_s: float, wait_chip_s: float = 0.0) -> None:
        self.busy[b] += chip_s
        if wait_chip_s:
            self.blocked_s += wait_chip_s

    def contribute(self, b: int, p: int, cid: str) -> None:
        mark = self.marks[b]
        self.outstanding[cid] = (b, (self.busy[b] - mark[p]) * self.shares[p])
        mark[p] = self.busy[b]
        self.contributions += 1

    def merged(self, cid: str) -> None:
        hit = self.outstanding.pop(cid, None)
        if hit is not None:
            self.useful_by_block[hit[0]] += hit[1]

    def finish(self, duration_s: float, block_chips: list[int]) -> tuple[Goodput, list[float]]:
        """The run's goodput, and each block's own goodput (useful over its allocated chip-seconds)."""
        pending_by_block = [
            sum((busy - m) * s for m, s in zip(marks, self.shares))
            for busy, marks in zip(self.busy, self.marks)
        ]
        useful = sum(self.useful_by_block)
        pending = sum(pending_by_block)
        allocated = duration_s * sum(block_chips) - pending
        per_block = [
            u / a if (a := duration_s * n - pb) > 0 else 0.0
            for u, n, pb in zip(self.useful_by_block, block_chips, pending_by_block)
        ]
        g = Goodput(
            goodput=useful / allocated if allocated > 0 else 0.0,
            useful_s=useful,
            allocated_s=allocated,
            down_s=self.down_s,
            blocked_s=self.blocked_s,
            dropped_s=sum(a for _, a in self.outstanding.values()),
            pending_s=pending,
            steps=0,  # the tally counts chip-seconds, not per-chip steps; the engine reports block steps
        )
        return g, per_block


class RecordSink:
    """Per-chip event records in ``protocol.goodput``'s format (small runs only: one record per chip-step)."""

    def __init__(self, block_chips: list[int], path: str | None = None) -> None:
        self.names = [[f"L{b}.{i}" for i in range(n)] for b, n in enumerate(block_chips)]
        self.records: list[dict] = []
        self.path = path

    def step(self, b: int, step: int, t0: float, t1: float, t_group: float, away: Iterable[int]) -> None:
        skip = set(away)
        for i, name in enumerate(self.names[b]):
            if i in skip:
                continue
            self.records.append({"kind": "step", "learner": name, "step": step, "t0": t0, "t1": t1})
            if t_group > t1:
                self.records.append({"kind": "block", "learner": name, "t0": t1, "t1": t_group})

    def contribute(self, b: int, p: int, step: int, cid: str, lost: bool = False) -> None:
        extra = {"lost": True} if lost else {}
        for name in self.names[b]:
            self.records.append(
                {"kind": "contribute", "learner": name, "fragment": p, "step": step, "cid": cid, **extra}
            )
            # The simulated learners follow the paper's rule (no carry): the merge they adopt next
            # overwrites fragment p, so this contribution is the only one that can carry these steps.
            self.records.append(
                {"kind": "adopt", "learner": name, "fragment": p, "step": step, "kept": False}
            )

    def merge(self, p: int, round_: int, cids: list[str], t: float) -> None:
        self.records.append({"kind": "merge", "fragment": p, "round": round_, "cids": cids, "t": t})

    def down(self, b: int, i: int, t: float) -> None:
        self.records.append({"kind": "down", "learner": self.names[b][i], "t": t})

    def up(self, b: int, i: int, t: float) -> None:
        self.records.append({"kind": "up", "learner": self.names[b][i], "t": t})

    def pause(self, b: int, t0: float, t1: float, away: Iterable[int]) -> None:
        """The block's present chips wait for their group (a restart or a resize) from t0 to t1."""
        skip = set(away)
        for i, name in enumerate(self.names[b]):
            if i not in skip and t1 > t0:
                self.records.append({"kind": "block", "learner": name, "t0": t0, "t1": t1})

    def run(self, system: str, duration_s: float, shares: list[float]) -> None:
        learners = [n for names in self.names for n in names]
        self.records.append(
            {
                "kind": "run",
                "system": system,
                "t0": 0.0,
                "t1": duration_s,
                "learners": learners,
                "shares": shares,
            }
        )
        if self.path:
            p = Path(self.path)
            p.parent.mkdir(parents=True, exist_ok=True)
            with p.open("w") as fh:
                for r in self.records:
                    fh.write(json.dumps(r) + "\n")
