"""Training text: a file of the user's, or generated text when none is given (no downloads, ever).

Generated text is a small synthetic language: a few hundred invented words with Zipf-like frequencies
and a sparse word-to-word transition table, arranged into capitalised sentences and lines. Spelling is
easy to learn and word order is harder, so the loss keeps falling over a long run.

Each learner draws random windows from the training split with its own seeded generator; the evaluation
split is the last 5% of the text and its batches are fixed, so every system is evaluated on the same bytes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from node.common.cache import cache_dir
from protocol.errors import ConfigError, DataError


def generated_text(n_bytes: int = 2_000_000, seed: int = 1234) -> bytes:
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
    letter_p = 1.0 / np.arange(1, len(letters) + 1) ** 0.9
    letter_p /= letter_p.sum()
    n_words = 400
    words = ["".join(rng.choice(letters, size=int(rng.integers(2, 9)), p=letter_p)) for _ in range(n_words)]
    unigram = 1.0 / np.arange(1, n_words + 1) ** 1.1
    unigram /= unigram.sum()
    succ = [rng.choice(n_words, size=6, replace=False, p=unigram) for _ in range(n_words)]
    out: list[str] = []
    size = 0
    w = int(rng.integers(n_words))
    while size < n_bytes:
        length = int(rng.integers(4, 14))
        sent = []
        for _ in range(length):
            w = int(rng.choice(succ[w])) if rng.random() < 0.8 else int(rng.choice(n_words, p=unigram))
            sent.append(words[w])
        s = " ".join(sent).capitalize() + (". " if rng.random() < 0.85 else ".\n")
        out.append(s)
        size += len(s)
    return "".join(out).encode()[:n_bytes]


GENERATOR_VERSION = 1  # bump when generated_text changes what it makes


def cached_generated_text(n_bytes: int = 2_000_000, seed: int = 1234) -> bytes:
    """``generated_text``, read from the cache when a copy there is whole (its SHA-256 beside it matches).

    Making the text takes seconds of pure Python, which every node start (and every restart after a crash)
    would pay again; a copy that is missing, cut short or altered is made anew. The cache is an
    optimisation only: where it cannot be read or written, the text is made in memory."""
    path = cache_dir() / f"generated-v{GENERATOR_VERSION}-{seed}-{n_bytes}.bin"
    digest_path = path.with_suffix(".sha256")
    try:
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() == digest_path.read_text().strip():
            return data
    except OSError:
        pass
    data = generated_text(n_bytes, seed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tag = f".{os.getpid()}.tmp"
        for target, content in ((path, data), (digest_path, hashlib.sha256(data).hexdigest().encode())):
            tmp = target.with_name(target.name + tag)
            tmp.write_bytes(content)
            os.replace(tmp, target)
    except OSError:
        pass
    return data


class TextData:
    """Byte-level train/eval splits of one text."""

    def __init__(self, text: bytes, seq_len: int, eval_fraction: float = 0.05) -> None:
        if len(text) < 4 * (seq_len + 1):
            raise DataError(
                f"text has {len(text)} bytes; need at least {4 * (seq_len + 1)} for seq_len={seq_len}"
            )
        arr = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        cut = int(len(arr) * (1 - eval_fraction))
        cut = min(cut, len(arr) - 2 * (seq_len + 1))
        self.train, self.eval = arr[:cut], arr[cut:]
        self.seq_len = seq_len

    @classmethod
    def from_source(cls, path: str | None, seq_len: int, seed: int = 1234) -> TextData:
        if path is None:
            return cls(cached_generated_text(seed=seed), seq_len)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"data={path!r} is invalid: no such file; give a text file or omit --data to "
                "train on generated text"
            )
        return cls(p.read_bytes(), seq_len)

    def batch(self, gen: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        w = self.train[idx]
        return w[:, :-1], w[:, 1:]

    def eval_batches(self, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        span = self.seq_len + 1
        n_windows = max(1, (len(self.eval) - 1) // span)
        starts = torch.linspace(0, len(self.eval) - span, steps=min(n_windows, batch_size * n_batches)).long()
        out = []
        for chunk in starts.split(batch_size):
            w = self.eval[chunk[:, None] + torch.arange(span)]
            out.append((w[:, :-1], w[:, 1:]))
        return out
