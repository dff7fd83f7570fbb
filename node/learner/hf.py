"""Hugging Face ``transformers`` causal LMs as the learner's model (``--model hf:PATH``, ``--model gpt2``).

``hf:PATH`` is a local ``config.json`` (a fresh model of that architecture, initialised from the task's seed)
or a local folder with a ``config.json`` (and, when it holds weights, those weights: a ``save_pretrained``
folder, e.g. an earlier export). Nothing is downloaded from the hub. ``gpt2`` is GPT-2's architecture sized
by ``--dim --layers --heads --seq-len`` with its 50257-token vocabulary (the ``gpt2-125m`` preset).

Tied input and output embeddings are one parameter (``named_parameters`` yields it once), so the fragment
planner, snapshots and replicas see one tensor, and adopting or loading copies into it in place: the tie
holds. ``save_pretrained`` writes the export ``AutoModelForCausalLM.from_pretrained`` loads.

transformers is imported only here, and only when such a model is asked for: the base install runs without.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from node.learner.tokenize import HF_EXTRA
from protocol.errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
GPT2_VOCAB = 50257


def _transformers(what: str):
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{what} needs the transformers library: {HF_EXTRA}") from None
    transformers.logging.set_verbosity_error()  # no hub or init chatter on a node's stderr
    transformers.logging.disable_progress_bar()
    return transformers


class HFModel:
    """Builds one transformers causal LM, the same initial weights on every call."""

    def __init__(self, name: str, seq_len: int, dims: tuple[int, int, int] | None = None) -> None:
        tf = _transformers(f"model={name!r}")
        self.name = name
        self.weights: Path | None = None
        if name == "gpt2":
            dim, layers, heads = dims or (768, 12, 12)
            self.source = "gpt2"
            self.config = tf.GPT2Config(
                n_embd=dim, n_layer=layers, n_head=heads, n_positions=seq_len, vocab_size=GPT2_VOCAB
            )
        else:
            self.config = self._read_config(tf, name.removeprefix("hf:"))
        self.config.use_cache = False
        try:
            with torch.device("meta"):  # only its names and tie are read here: no weights made
                m = tf.AutoModelForCausalLM.from_config(self.config)
        except ValueError as e:
            raise ConfigError(
                f"{self.source}: model_type {self.config.model_type!r} is not a causal language model "
                f"(transformers has no AutoModelForCausalLM for it): {str(e).splitlines()[0][:160]}"
            ) from None
        self.vocab_size = int(self.config.vocab_size)
        limit = getattr(self.config, "max_position_embeddings", None) or getattr(
            self.config, "n_positions", None
        )
        if limit is not None and seq_len > int(limit):
            raise ConfigError(
                f"seq_len={seq_len} is invalid for {self.source}: the model takes at most {limit} positions"
            )
        self.embedding = next(n for n, p in m.named_parameters() if p is m.get_input_embeddings().weight)
        out = m.get_output_embeddings()
        self.tied = out is not None and out.weight is m.get_input_embeddings().weight

    def _read_config(self, tf, path: str):
        p = Path(path)
        if p.is_dir():
            cfg_file = p / "config.json"
            self.weights = p if any((p / w).is_file() for w in WEIGHT_FILES) else None
        else:
            cfg_file = p
        self.source = str(cfg_file)
        if not cfg_file.is_file():
            raise ConfigError(
                f"model='hf:{path}' is invalid: {cfg_file} does not exist. ddiloco never downloads from the "
                "Hugging Face hub: give a local config.json or model folder (to use a hub model, fetch it "
                f"first, e.g. 'huggingface-cli download {path} --local-dir models/{Path(path).name}')"
            )
        try:
            doc = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{cfg_file}: not a readable JSON model config ({e})") from e
        if not isinstance(doc, dict) or "model_type" not in doc:
            raise ConfigError(f"{cfg_file}: no 'model_type' in the config; cannot tell which model it is")
        kind = doc.pop("model_type")
        try:
            return tf.AutoConfig.for_model(kind, **doc)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"{cfg_file}: model_type {kind!r} is not one transformers knows ({e!s:.120})"
            ) from e

    def new_model(self, seed: int) -> nn.Module:
        tf = _transformers(f"model={self.name!r}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if self.weights is not None:
                m = tf.AutoModelForCausalLM.from_pretrained(
                    str(self.weights), config=self.config, local_files_only=True
                )
            else:
                m = tf.AutoModelForCausalLM.from_config(self.config)
        return m.float().train()


def save_pretrained(model: nn.Module, params: Mapping[str, torch.Tensor], folder: str | Path) -> Path:
    """Write ``params`` (parameter names; a tied head is the embedding) into ``model`` and save it as a
    ``save_pretrained`` folder, replacing any there. ``AutoModelForCausalLM.from_pretrained`` loads it."""
    folder = Path(folder)
    with torch.no_grad():
        named = dict(model.named_parameters())
        missing = sorted(set(named) - set(params))
        if missing:
            raise ValueError(f"save_pretrained: no value for parameters {missing[:4]}")
        for n, p in named.items():
            p.copy_(params[n].to(p.dtype))
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder
