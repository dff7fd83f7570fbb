"""What the node's dashboard draws (``GET /history``; docs/design.md, section 7): the learner's loss
curve, its evaluations, tokens per second and goodput over the node's life, recent merges and recent
refusals.

Fed by the node's event stream (``EventLog.subscribe``), so nothing on the training path calls it: ``step``
records give the loss curve and tokens/s, ``eval`` the evaluation curve, ``merge`` and ``reject`` the recent
lists. Goodput is not an event; the status endpoint samples it (``sample``) when it rebuilds its document.
Memory is bounded for a node that runs for days: the step curve keeps at most ``MAX_POINTS`` points and,
when full, drops every other one and records only every second step from then on (and so on), so it always
covers the whole run at an even stride.
"""

from __future__ import annotations

import threading
from collections import deque

MAX_POINTS = 1000  # points of the step curve kept (the whole run, thinned evenly)
RATE_WINDOW = 20  # steps over which tokens/s of a point is measured


class History:
    def __init__(self, tokens_per_step: int, max_points: int = MAX_POINTS) -> None:
        if max_points < 2:
            raise ValueError(f"max_points={max_points} is invalid: a curve needs at least 2 points")
        self.tokens_per_step = tokens_per_step
        self.max_points = max_points
        self.stride = 1  # a step is kept when its index is a multiple of stride
        self.steps: list[dict] = []  # {"step", "t", "loss", "tokens_per_s"}
        self.evals: deque[dict] = deque(maxlen=max_points)  # {"step", "t", "tokens", "loss"}
        self.samples: deque[dict] = deque(maxlen=max_points)  # {"t", "goodput", "tokens_per_s"}
        self.merges: deque[dict] = deque(maxlen=30)
        self.refusals: deque[dict] = deque(maxlen=30)
        self._recent: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW + 1)  # (t1, step) of the last steps
        self._lock = threading.Lock()  # records come from the learner thread and the event loop

    def on_event(self, rec: dict) -> None:
        kind = rec.get("kind")
        with self._lock:
            if kind == "step":
                self._step(rec)
            elif kind == "eval":
                self.evals.append(
                    {"step": rec.get("step"), "t": rec["t"], "tokens": rec.get("tokens"), "loss": rec["loss"]}
                )
            elif kind == "merge":
                self.merges.append(
                    {
                        "t": rec["t"],
                        "fragment": rec["fragment"],
                        "round": rec["round"],
                        "signer": rec.get("signer"),
                        "learners": sorted(set(rec.get("learners", []))),
                    }
                )
            elif kind == "reject":
                self.refusals.append(
                    {"t": rec["t"], "peer": rec.get("peer"), "code": rec.get("code"), "why": rec.get("why")}
                )

    def _step(self, rec: dict) -> None:
        t1, step = float(rec["t1"]), int(rec["step"])
        self._recent.append((t1, step))
        if step % self.stride:
            return
        rate = None
        (t_old, s_old) = self._recent[0]
        if t1 > t_old:
            rate = self.tokens_per_step * (step - s_old) / (t1 - t_old)
        self.steps.append({"step": step, "t": t1, "loss": rec.get("loss"), "tokens_per_s": rate})
        if len(self.steps) >= self.max_points:
            self.stride *= 2
            self.steps = [p for p in self.steps if p["step"] % self.stride == 0]

    def sample(self, t: float, goodput: float | None, tokens_per_s: float) -> None:
        """A point of the goodput curve (from the status document)."""
        with self._lock:
            self.samples.append({"t": t, "goodput": goodput, "tokens_per_s": tokens_per_s})

    def doc(self) -> dict:
        with self._lock:
            return {
                "stride": self.stride,
                "steps": list(self.steps),
                "evals": list(self.evals),
                "samples": list(self.samples),
                "merges": list(self.merges),
                "refusals": list(self.refusals),
            }
