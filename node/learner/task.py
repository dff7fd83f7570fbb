"""What a learner trains: model, data and loss, behind one small interface.

The default task is the byte-level transformer on text (``node.learner.model``, ``node.learner.data``). A user brings their
own with ``--task module:function``: ``function(TaskConfig) -> Task``, where the returned object has the
attributes and methods of ``Task`` below. See docs/custom-task.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from node.learner.data import TextData
from node.learner.model import ModelConfig, TinyGPT, lm_loss
from protocol.errors import ConfigError

Batch = Any


@dataclass(frozen=True)
class TaskConfig:
    data: str | None = field(
        default=None, metadata={"help": "text file to train on (default: generated text)"}
    )
    batch_size: int = field(default=16, metadata={"help": "sequences per inner step per learner"})
    eval_batches: int = field(default=8, metadata={"help": "fixed evaluation batches"})
    seed: int = field(default=0, metadata={"help": "model init and data seed"})
    model: ModelConfig = ModelConfig()

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} is invalid: must be >= 1")


class Task(Protocol):
    embedding: str | None  # name of the token-embedding parameter (its own fragment), or None
    tokens_per_batch: int

    def new_model(self) -> nn.Module:
        """A fresh model; every call returns the same initial weights."""

    def batch(self, gen: torch.Generator) -> Batch:
        """One training batch drawn with ``gen``."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor: ...

    def eval_batches(self) -> list[Batch]: ...


class TextLMTask:
    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self.data = TextData.from_source(cfg.data, cfg.model.seq_len)
        self.embedding = TinyGPT.embedding_name
        self.tokens_per_batch = cfg.batch_size * cfg.model.seq_len
        self._eval = self.data.eval_batches(cfg.batch_size, cfg.eval_batches)

    def new_model(self) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            return TinyGPT(self.cfg.model)

    def batch(self, gen: torch.Generator) -> Batch:
        return self.data.batch(gen, self.cfg.batch_size)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        dev = next(model.parameters()).device
        return lm_loss(model, x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))

    def eval_batches(self) -> list[Batch]:
        return self._eval


def text_lm(cfg: TaskConfig) -> Task:
    return TextLMTask(cfg)


def load_task(spec: str | None, cfg: TaskConfig) -> Task:
    """``None`` -> the default text LM; ``"pkg.mod:fn"`` -> ``fn(cfg)``."""
    if spec is None:
        return text_lm(cfg)
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ConfigError(f"task={spec!r} is invalid: expected 'module:function', e.g. 'mytasks:make_task'")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"task={spec!r} could not be loaded: {e}") from e
    task = fn(cfg)
    for attr in ("embedding", "tokens_per_batch", "new_model", "batch", "loss", "eval_batches"):
        if not hasattr(task, attr):
            raise ConfigError(f"task={spec!r} returned {type(task).__name__}, which lacks '{attr}'")
    return task


def evaluate(task: Task, model: torch.nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        losses = [task.loss(model, b).item() for b in task.eval_batches()]
    model.train()
    return sum(losses) / len(losses)
