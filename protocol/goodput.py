"""Goodput from event records, defined once for every system (docs/design.md, section 2).

goodput = useful learner compute time / allocated learner time, summed over learners.

Records are dicts (one JSON line each). The ones read here:
  run        {t0, t1, learners: [...], shares: [fraction of parameters per fragment], overlap: tau}
  step       {learner, step, t0, t1}
  contribute {learner, fragment, step, cid}
  merge      {fragment, round, cids: [...]}
  down / up  {learner, t}        block {learner, t0, t1}

  adopt      {learner, fragment, step, kept, round, lost}   (optional; older records without ``step`` are
             ignored; ``lost``: the learner's process died at that step, so nothing of it carries over)

A step's work on fragment p reaches the global model through the learner's contributions of p at or
after that step, up to the first adoption of p that overwrites the learner's copy (an adopt record with
``kept`` false, at or after the step: whatever the learner had not contributed by then is gone). The step
counts as useful for p's share of parameters if one of those contributions was merged, and as dropped
if none was (sent and left out, or overwritten before it was sent). Steps with neither a contribution nor
an overwrite after them when the run ended are pending: they are left out of both sides of the ratio
rather than guessed.

The overlap. Under the paper's rule a learner sends fragment p, trains on, and overwrites p with the
merged round when it comes back: the steps in between are overwritten by design. The paper budgets
``tau`` of them (the overlap of its Algorithm 1: a learner applies round r tau steps after sending) and
counts them as compute, not as loss (its K = 1 + grace reaches 100% goodput under that rule). So does
``goodput`` here: a step at most ``overlap`` (tau, from the run record) steps after a contribution that
the overwriting round merged is useful (``overlap_s``). Beyond tau steps the round came back later than
the protocol budgets (the paper's learner would have blocked there): those steps are dropped and also
tallied as ``late_s``. ``strict`` counts every overwritten step as dropped: the share of the work whose
every step reached the global model.

Where the dropped work went, in four parts that sum to ``dropped_s``: ``late_s`` (above); ``killed_s``,
never sent before the learner's process died (an adopt record with ``lost``); ``left_out_s``, sent, but no
round merged any of the contributions that carried it; ``unsent_s``, overwritten by a round before the
learner sent it.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Goodput:
    goodput: float
    useful_s: float
    allocated_s: float
    down_s: float
    blocked_s: float
    dropped_s: float
    pending_s: float
    steps: int
    overlap_s: float = 0.0  # in useful_s: the tau steps the paper's rule overwrites by design
    late_s: float = 0.0  # in dropped_s: overwritten after a merged contribution, more than tau steps on
    killed_s: float = 0.0  # in dropped_s: not yet sent when the learner's process died
    left_out_s: float = 0.0  # in dropped_s: sent, and no round merged it
    unsent_s: float = 0.0  # in dropped_s: overwritten by a round before the learner sent it

    @property
    def strict(self) -> float:
        """Goodput with every overwritten step counted as lost, the overlap included."""
        return (self.useful_s - self.overlap_s) / self.allocated_s if self.allocated_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = {**vars(self), "strict": self.strict}
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}


def compute_goodput(records: Iterable[dict], detail: dict | None = None) -> Goodput:
    """``detail``, if given, is filled with each step's verdict: (learner, step) -> (t0, t1, the share of
    its time counted useful, the share dropped); the rest of it is pending."""
    run = None
    steps: dict[str, list[tuple[int, float]]] = defaultdict(list)  # learner -> [(step, duration)]
    spans: dict[tuple[str, int], tuple[float, float]] = {}
    contribs: dict[tuple[str, int], list[tuple[int, str]]] = defaultdict(
        list
    )  # (learner, p) -> [(step, cid)]
    merged: dict[str, set[int]] = defaultdict(set)  # cid -> the rounds that merged it
    overwrites: dict[tuple[str, int], list[tuple[int, int | None, bool]]] = defaultdict(
        list
    )  # (learner, p) -> [(step, round, lost with the process)]
    down_s = blocked_s = 0.0
    down_at: dict[str, float] = {}
    for r in records:
        kind = r.get("kind")
        if kind == "run":
            run = r
        elif kind == "step":
            steps[r["learner"]].append((r["step"], r["t1"] - r["t0"]))
            if detail is not None:
                spans[(r["learner"], r["step"])] = (r["t0"], r["t1"])
        elif kind == "contribute":
            contribs[(r["learner"], r["fragment"])].append((r["step"], r["cid"]))
        elif kind == "merge":
            for cid in r["cids"]:
                merged[cid].add(r.get("round"))
        elif kind == "adopt" and "step" in r and not r.get("kept", False):
            overwrites[(r["learner"], r["fragment"])].append((r["step"], r.get("round"), bool(r.get("lost"))))
        elif kind == "down":
            down_at[r["learner"]] = r["t"]
        elif kind == "up" and r["learner"] in down_at:
            down_s += r["t"] - down_at.pop(r["learner"])
        elif kind == "block":
            blocked_s += r["t1"] - r["t0"]
    if run is None:
        raise ValueError("event records have no 'run' record; cannot compute goodput")
    for t in down_at.values():
        down_s += run["t1"] - t
    shares = run["shares"]
    tau = int(run.get("overlap", 0))
    useful = pending = overlap = 0.0
    lost: dict[str, float] = defaultdict(float)  # dropped, by where it went
    n_steps = 0
    for learner, lst in steps.items():
        for p, share in enumerate(shares):
            cl = sorted(contribs.get((learner, p), []))
            keys = [s for s, _ in cl]
            reached = [0]  # reached[i]: how many of the contributions cl[:i] were merged
            for _, cid in cl:
                reached.append(reached[-1] + (cid in merged))
            ow = sorted(overwrites.get((learner, p), []), key=lambda x: x[0])
            ow_steps = [s for s, _, _ in ow]
            for step, dur in lst:
                before_useful, before_lost = useful, sum(lost.values())
                i = bisect.bisect_left(keys, step)  # first contribution at or after the step
                k = bisect.bisect_left(ow_steps, step)  # first overwrite at or after it
                j = (
                    bisect.bisect_right(keys, ow_steps[k]) if k < len(ow) else len(keys)
                )  # contributions before it
                if j > i and reached[j] > reached[i]:
                    useful += dur * share
                elif j > i or k < len(ow):
                    # Overwritten in flight: after the learner's last contribution (cl[i - 1]), by the round
                    # that merged it?
                    sent = i > 0 and j == i and ow[k][1] in merged.get(cl[i - 1][1], ())
                    if sent and step - keys[i - 1] <= tau:
                        useful += dur * share
                        overlap += dur * share
                    elif sent:
                        lost["late"] += dur * share
                    elif j > i:
                        lost["left_out"] += dur * share
                    else:
                        lost["killed" if ow[k][2] else "unsent"] += dur * share
                else:
                    pending += dur * share
                if detail is not None and dur > 0:
                    t0, t1 = spans.get((learner, step), (0.0, 0.0))
                    _, _, u, d = detail.get((learner, step), (t0, t1, 0.0, 0.0))
                    u += (useful - before_useful) / dur
                    d += (sum(lost.values()) - before_lost) / dur
                    detail[(learner, step)] = (t0, t1, u, d)
        n_steps += len(lst)
    allocated = (run["t1"] - run["t0"]) * len(run["learners"]) - pending
    return Goodput(
        goodput=useful / allocated if allocated > 0 else 0.0,
        useful_s=useful,
        allocated_s=allocated,
        down_s=down_s,
        blocked_s=blocked_s,
        dropped_s=sum(lost.values()),
        pending_s=pending,
        steps=n_steps,
        overlap_s=overlap,
        late_s=lost["late"],
        killed_s=lost["killed"],
        left_out_s=lost["left_out"],
        unsent_s=lost["unsent"],
    )
