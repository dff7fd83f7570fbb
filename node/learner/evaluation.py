"""Evaluating given parameters without a model copy of their own.

A node evaluates the global model from its replicas' tensors, which nothing writes to (every merge makes new
ones). ``ParamsModel`` is the task's module built on the meta device (no memory, no initialisation) whose
parameters are, for the length of one evaluation, those tensors themselves; between evaluations it holds
none, so a replica that has moved on is not kept alive by it. Tied parameters (an LM head that is the token
embedding) are set under every name they have. Buffers (masks, position tables) are real: the learner's
own model lends them, as nothing in an evaluation writes to them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from node.learner.task import Task, evaluate


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
        """The task's evaluation loss with ``params`` (every parameter, by its canonical name)."""
        missing = {c for _, c in self.names} - set(params)
        if missing:
            raise KeyError(f"no tensor for parameters {sorted(missing)[:4]}")
        with self.lock:
            try:
                for n, c in self.names:
                    value = torch.nn.Parameter(params[c].detach(), requires_grad=False)
                    _set(self.model, n, value, "_parameters")
                return evaluate(self.task, self.model)
            finally:
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
