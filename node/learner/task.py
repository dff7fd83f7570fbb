"""What a learner trains: model, data and loss, behind one small interface.

The default task is a causal LM on text: the model is the built-in byte-level transformer
(``node.learner.model``) or a transformers model (``node.learner.hf``); the data is generated text
(``node.learner.data``, random windows) or the user's files, tokenised as bytes or with their tokenizer and
read in a recorded, disjoint order (``node.learner.corpus``). A user brings their own task with ``--task
module:function``: ``function(TaskConfig) -> Task``, where the returned object has the attributes and
methods of ``Task`` below. See docs/custom-task.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from node.learner.data import TextData, cached_generated_text
from node.learner.model import ModelConfig, TinyGPT, lm_loss
from node.learner.presets import PRESETS
from protocol.errors import ConfigError

Batch = Any


@dataclass(frozen=True)
class TaskConfig:
    data: str | None = field(
        default=None,
        metadata={
            "help": "what to train on: a text, JSONL (.jsonl) or Parquet (.parquet) file, a folder of them, or a "
            "glob such as 'shards/*.parquet' (default: generated text)"
        },
    )
    text_field: str = field(default="text", metadata={"help": "JSONL shards: the field holding the text"})
    text_column: str = field(default="text", metadata={"help": "Parquet shards: the column holding the text"})
    tokenizer: str = field(
        default="",
        metadata={
            "help": "a local tokenizer.json, read with the tokenizers library; empty: bytes (256 tokens)"
        },
    )
    token_cache: str = field(
        default="",
        metadata={
            "help": "the folder of tokenised corpora (--data is tokenised once and kept there; see "
            "docs/data.md); empty: $DDILOCO_CACHE/tokens, else ~/.cache/ddiloco/tokens"
        },
    )
    data_part: str = field(
        default="",
        metadata={
            "help": "K/N: this learner reads part K of N of the data (every N-th window from the K-th), for "
            "nodes that must read disjoint data; unset: the whole data in an order seeded by the data seed "
            "(train-local gives learner m of M part m/M)"
        },
    )
    preset: str = field(
        default="",
        metadata={
            "help": f"a model and batch size: {', '.join(PRESETS)} (tiny is the default's; small about 10M "
            "parameters, for CPUs; gpt2-125m GPT-2 small, for a GPU); flags and TOML settings override it"
        },
    )
    batch_size: int = field(default=16, metadata={"help": "sequences per inner step per learner"})
    eval_batches: int = field(default=8, metadata={"help": "fixed evaluation batches"})
    seed: int = field(default=0, metadata={"help": "model init and data seed"})
    model: ModelConfig = ModelConfig()

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} is invalid: must be >= 1")
        if self.preset and self.preset not in PRESETS:
            raise ConfigError(f"preset={self.preset!r} is invalid: choose from {', '.join(PRESETS)}")
        self.part()  # validates

    def part(self) -> tuple[int, int] | None:
        if not self.data_part:
            return None
        k, sep, n = self.data_part.partition("/")
        try:
            k_, n_ = int(k), int(n)
        except ValueError:
            k_, n_ = -1, 0
        if not sep or not 0 <= k_ < n_:
            raise ConfigError(
                f"data_part={self.data_part!r} is invalid: expected K/N with 0 <= K < N, e.g. 0/4"
            )
        return k_, n_


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
    """A causal LM: the built-in model or a transformers one, on generated text or the user's data."""

    def __init__(self, cfg: TaskConfig) -> None:
        from node.learner.tokenize import load_tokenizer

        self.cfg = cfg
        m = cfg.model
        self.tok = load_tokenizer(cfg.tokenizer or None)
        self.hf = None
        if m.name == "tiny":
            self.model_cfg = replace(m, vocab=max(m.vocab, self.tok.vocab_size))
            self.embedding = TinyGPT.embedding_name
        else:
            from node.learner.hf import HFModel

            self.hf = HFModel(m.name, m.seq_len, (m.dim, m.layers, m.heads))
            if self.tok.vocab_size > self.hf.vocab_size:
                raise ConfigError(
                    f"tokenizer {self.tok.name} does not fit the model: it has {self.tok.vocab_size} tokens, "
                    f"{self.hf.source} a vocabulary of {self.hf.vocab_size}"
                )
            self.embedding = self.hf.embedding
        self.tokens_per_batch = cfg.batch_size * m.seq_len
        self.data_part = cfg.part()
        self.data: TextData | None = None
        self.corpus = None
        if cfg.data is None and not cfg.tokenizer:
            self.data = TextData.from_source(None, m.seq_len)  # generated text, random windows
            self._eval = self.data.eval_batches(cfg.batch_size, cfg.eval_batches)
        else:
            self.corpus = self._corpus(cfg, m.seq_len)
            self._eval = self.corpus.eval_batches(cfg.batch_size, cfg.eval_batches)

    def _corpus(self, cfg: TaskConfig, seq_len: int):
        """The user's data through its token cache (built on first use), or generated text in memory."""
        from node.learner.corpus import ArrayStream, Corpus, ShardStream

        if cfg.data is None:
            stream = ArrayStream(self.tok.encode_document(cached_generated_text().decode()))
            return Corpus(stream, seq_len, "generated text")
        from pathlib import Path

        from node.common.progress import Bar
        from node.learner.token_cache import CacheSpec, open_cache

        bar = Bar("tokenise")
        try:
            spec = CacheSpec(cfg.data, cfg.tokenizer or None, cfg.text_field, cfg.text_column)
            cache = open_cache(spec, Path(cfg.token_cache) if cfg.token_cache else None, progress=bar)
        finally:
            bar.close()
        return Corpus(ShardStream(cache), seq_len, cfg.data)

    def new_model(self) -> nn.Module:
        if self.hf is not None:
            return self.hf.new_model(self.cfg.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            return TinyGPT(self.model_cfg)

    def reader(self, part: tuple[int, int], seed: int | None):
        """A ``corpus.Reader`` of data part ``part`` (k, n), its order seeded by ``seed`` (None: the task's
        seed, shared by the swarm); None when this task draws random windows (generated bytes)."""
        if self.corpus is None:
            return None
        from node.learner.corpus import Reader

        return Reader(
            self.corpus, self.cfg.batch_size, part[0], part[1], self.cfg.seed if seed is None else seed
        )

    def batch(self, gen: torch.Generator) -> Batch:
        if self.data is None:  # a driver without a reader (data-parallel): random windows of the corpus
            idx = torch.randint(0, self.corpus.n_windows, (self.cfg.batch_size,), generator=gen)
            w = torch.stack([self.corpus.window(int(i)) for i in idx])
            return w[:, :-1], w[:, 1:]
        return self.data.batch(gen, self.cfg.batch_size)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        dev = next(model.parameters()).device
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        if self.hf is None:
            return lm_loss(model, x, y)
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def save_pretrained(self, params: dict[str, torch.Tensor], folder) -> None:
        """Export ``params`` as a ``save_pretrained`` folder (transformers models only)."""
        from node.learner.hf import save_pretrained

        save_pretrained(self.new_model(), params, folder)

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
