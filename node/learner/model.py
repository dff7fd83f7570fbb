"""The default model: a small byte-level causal transformer LM (GPT-style, pre-LayerNorm).

Sized by ``ModelConfig``; the default (dim 128, 4 layers) has about 0.9M parameters and trains at a useful
pace on two CPU cores. The token embedding is ``tok_emb.weight``; the output head is a separate tensor so
the embedding can be a fragment of its own.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from protocol.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    dim: int = field(default=128, metadata={"help": "transformer width"})
    layers: int = field(default=4, metadata={"help": "transformer blocks"})
    heads: int = field(default=4, metadata={"help": "attention heads (must divide dim)"})
    seq_len: int = field(default=128, metadata={"help": "context length in tokens"})
    vocab: int = 256
    name: str = field(
        default="tiny",
        metadata={
            "help": "tiny (the built-in byte-level transformer, sized by --dim --layers --heads) | gpt2 (GPT-2's "
            "architecture at those sizes, 50257-token vocabulary) | hf:PATH (any transformers causal LM from "
            "a local config.json, or a local model folder with its weights; never downloaded); gpt2 and hf: "
            "need pip install 'ddiloco[hf]'"
        },
    )

    def __post_init__(self) -> None:
        for name in ("dim", "layers", "heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.name not in ("tiny", "gpt2") and not (self.name.startswith("hf:") and len(self.name) > 3):
            raise ConfigError(f"model={self.name!r} is invalid: expected tiny, gpt2 or hf:PATH")
        if self.dim % self.heads:
            raise ConfigError(f"heads={self.heads} is invalid: it must divide dim={self.dim}")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    embedding_name = "tok_emb.weight"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.apply(self._init)
        nn.init.normal_(self.pos_emb, std=0.02)

    @staticmethod
    def numel(cfg: ModelConfig) -> int:
        """Its parameter count, without making it: embedding, positions, blocks, final norm, head."""
        d = cfg.dim
        return 2 * cfg.vocab * d + cfg.seq_len * d + cfg.layers * (12 * d * d + 13 * d) + 2 * d

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def tied_lookup(model: nn.Module) -> nn.Embedding | None:
    """The input embedding of a model whose output head is the same tensor (GPT-2's tie), else None.

    Its lookup can leave the tensor's gradient to the head and add the rows it read afterwards
    (``lean_lookup``, ``flush_lookup``)."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    emb, out = get_in(), get_out()
    if not isinstance(emb, nn.Embedding) or out is None or getattr(out, "weight", None) is not emb.weight:
        return None
    if emb.max_norm is not None or emb.scale_grad_by_freq:
        return None
    return emb


def lean_lookup(model: nn.Module, on: bool) -> None:
    """Give a model's tied lookup (``tied_lookup``) a gradient of its own rows only, or its dense one back,
    for the forward passes to come. Only for a plain model on the CPU: a DDP or FSDP wrapper expects dense
    gradients from every use of a parameter.

    Lean, the lookup reads the tensor detached and its output is a leaf of the graph; ``flush_lookup``, after
    the backward pass, adds that leaf's gradient into the rows it read of the tensor's gradient, in place.
    Left to autograd, both uses of the tensor meet in one gradient, summed out of place: a dense lookup
    gradient is a whole zero-filled vocab x dim tensor beside the head's and their sum (two more at the
    end of each backward), and a sparse one (``nn.Embedding.sparse``, as before) still one for the sum: at
    124M, 147 MiB over the learner's peak, for a tenth of a second at the end of every backward."""
    emb = tied_lookup(model)
    if emb is None:
        return
    if on:
        emb.forward = types.MethodType(_detached_lookup, emb)
    else:
        emb.__dict__.pop("forward", None)
        emb.__dict__.pop("_lean_out", None)


def _detached_lookup(self: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    out = F.embedding(idx, self.weight.detach(), self.padding_idx)
    if torch.is_grad_enabled() and self.weight.requires_grad:
        out.requires_grad_()
        self._lean_out = (idx, out)
    return out


def flush_lookup(model: nn.Module) -> None:
    """After a backward pass with ``lean_lookup`` on: add the lookup's gradient into the rows of the tied
    tensor's gradient it read (the head's, already there), in place; nothing when it has none."""
    emb = tied_lookup(model)
    stash = emb.__dict__.pop("_lean_out", None) if emb is not None else None
    if stash is None or stash[1].grad is None:
        return
    idx, out = stash
    w = emb.weight
    rows, at = out.grad.reshape(-1, out.shape[-1]).to(w.dtype), idx.reshape(-1)
    if emb.padding_idx is not None:  # the padding row takes no gradient, as in F.embedding
        keep = at != emb.padding_idx
        rows, at = rows[keep], at[keep]
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    w.grad.index_add_(0, at, rows)
