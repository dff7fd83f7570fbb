"""Evaluating given parameters without a model copy of their own.

A node evaluates the global model from its replicas' tensors, which nothing writes to (every merge makes new
ones). ``ParamsModel`` is the task's module built on the meta device (no memory, no initialisation) whose
parameters are, for the length of one evaluation, those tensors themselves; between evaluations it holds
none, so a replica that has moved on is not kept alive by it. Tied parameters (an LM head that is the token
embedding) are set under every name they have. Buffers (masks, position tables) are real: the learner's
own model lends them, as nothing in an evaluation writes to them.

A tensor handed in as fragments of its rows (``name[a:b]``, a token embedding cut by the fragment plan) is
not joined into a whole copy when the modules that use it are an ``nn.Embedding`` (the lookup reads each
token's row from its cut) or a bias-free ``nn.Linear`` (the tied head: its logits are the cuts' logits side
by side); any other use of it gets the joined tensor. At 124M the joined embedding was 147 MiB more for the
length of every evaluation.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from node.learner.task import Task, evaluate
from protocol.fragments import join_rows, split_cuts

Cuts = list[tuple[int, int, torch.Tensor]]  # (first row, end row, rows), in row order


def _cut_lookup(cuts: Cuts):
    def forward(self: torch.nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*idx.shape, cuts[0][2].shape[1], dtype=cuts[0][2].dtype)
        for a, b, rows in cuts:
            hit = (idx >= a) & (idx < b)
            out[hit] = F.embedding(idx[hit] - a, rows)
        return out

    return forward


def _cut_head(cuts: Cuts):
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x, rows) for _, _, rows in cuts], dim=-1)

    return forward


def _cut_forward(module: torch.nn.Module, leaf: str, cuts: Cuts):
    """A forward for ``module`` reading its parameter ``leaf`` from ``cuts``, or None where it needs it whole."""
    if leaf != "weight":
        return None
    if type(module) is torch.nn.Embedding and module.max_norm is None:
        return _cut_lookup(cuts)
    if type(module) is torch.nn.Linear and module.bias is None:
        return _cut_head(cuts)
    return None


def _set(model: torch.nn.Module, name: str, value: torch.Tensor, kind: str) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    getattr(mod, kind)[leaf] = value


class ParamsModel:
    """Evaluates ``task`` on parameter tensors handed in per call (see the module's docstring)."""

    def __init__(self, task: Task, lender: torch.nn.Module) -> None:
        self.task = task
        with torch.device("meta"):
            self.model = task.new_model()
        # every name of every parameter, grouped by the parameter it is (ties share one)
        canonical = {id(p): n for n, p in self.model.named_parameters()}
        self.names = [(n, canonical[id(p)]) for n, p in self.model.named_parameters(remove_duplicate=False)]
        self.placeholders = {n: p for n, p in self.model.named_parameters(remove_duplicate=False)}
        lent = dict(lender.named_buffers())
        for n, b in self.model.named_buffers():
            if n not in lent or tuple(lent[n].shape) != tuple(b.shape):
                raise ValueError(f"the learner's model has no buffer {n} of shape {tuple(b.shape)}")
            _set(self.model, n, lent[n].detach().to("cpu"), "_buffers")
        self.lock = threading.Lock()

    def evaluate(self, params: Mapping[str, torch.Tensor]) -> float:
        """The task's evaluation loss with ``params`` (every parameter, by its canonical name, or as
        fragments of its rows)."""
        whole, cuts = split_cuts(params)
        missing = {c for _, c in self.names} - set(whole) - set(cuts)
        if missing:
            raise KeyError(f"no tensor for parameters {sorted(missing)[:4]}")
        patched: list[torch.nn.Module] = []
        with self.lock:
            try:
                for n, c in self.names:
                    if c in cuts:
                        mod_name, _, leaf = n.rpartition(".")
                        mod = self.model.get_submodule(mod_name) if mod_name else self.model
                        forward = _cut_forward(mod, leaf, cuts[c])
                        if forward is not None:
                            mod.forward = types.MethodType(forward, mod)
                            patched.append(mod)
                            # its weight is never read: one zero seen at its shape, so that what asks the
                            # model for its device or dtype (a transformers model does) hears the cuts'
                            first = cuts[c][0][2]
                            shape = (sum(b - a for a, b, _ in cuts[c]), *first.shape[1:])
                            stand_in = torch.zeros((), dtype=first.dtype, device=first.device).expand(shape)
                            _set(
                                self.model,
                                n,
                                torch.nn.Parameter(stand_in, requires_grad=False),
                                "_parameters",
                            )
                            continue
                        if c not in whole:  # a use that needs the tensor whole: join its rows once
                            whole[c] = join_rows(c, cuts[c])
                    value = torch.nn.Parameter(whole[c].detach(), requires_grad=False)
                    _set(self.model, n, value, "_parameters")
                return evaluate(self.task, self.model)
            finally:
                for mod in patched:
                    mod.__dict__.pop("forward", None)
                for n, p in self.placeholders.items():
                    _set(self.model, n, p, "_parameters")

    def tensors(self) -> list[torch.Tensor]:
        """What it holds of its own between evaluations (nothing but meta placeholders)."""
        return [p for p in self.model.parameters() if not p.is_meta]


def eval_model(task: Task, lender: torch.nn.Module) -> ParamsModel | torch.nn.Module:
    """A ``ParamsModel``; where the task's model cannot be built on the meta device, a copy of the model
    of its own (the old way: one more model's weights in memory)."""
    try:
        return ParamsModel(task, lender)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return task.new_model()
