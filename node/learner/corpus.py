"""Your data: text files, JSONL, Parquet, or a folder or glob of such shards, read into one token stream.

``--data`` names a file, a folder (every shard in it, sorted by name) or a glob (``shards/*.parquet``). A
shard's kind comes from its suffix: ``.jsonl`` (one JSON object a line, the text under ``--text-field``),
``.parquet`` (read with pyarrow, the text in column ``--text-column``), anything else plain UTF-8 text.
Documents are tokenised (``node.learner.tokenize``) and joined, each followed by the tokenizer's end of
document token where it has one, into one stream; its last 5% is the evaluation split.

The training split is cut into windows of ``seq_len + 1`` tokens, and ``Reader`` hands them out in an order
fixed by a seed: learner ``k`` of ``N`` reads every N-th window from the k-th, so the learners of a swarm
read disjoint data, and a reader's position (batches read) is all it needs to go on where it stopped.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from node.learner.tokenize import Tokenizer
from protocol.errors import ConfigError

SHARD_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".parquet")


def shard_paths(spec: str) -> list[Path]:
    """The shard files ``spec`` names: a file, a folder's shards sorted by name, or a glob's matches."""
    p = Path(spec)
    if p.is_file():
        return [p]
    if p.is_dir():
        found = sorted(q for q in p.iterdir() if q.is_file() and q.suffix.lower() in SHARD_SUFFIXES)
        if not found:
            raise ConfigError(
                f"data={spec!r} is invalid: the folder holds no shards (files ending in "
                f"{', '.join(SHARD_SUFFIXES)})"
            )
        return found
    if any(c in spec for c in "*?["):
        found = sorted(Path(q) for q in glob.glob(spec, recursive=True) if Path(q).is_file())
        if not found:
            raise ConfigError(f"data={spec!r} is invalid: the glob matches no files")
        return found
    raise ConfigError(
        f"data={spec!r} is invalid: no such file or folder; give a text/JSONL/Parquet file, a folder or a "
        "glob of shards, or omit --data to train on generated text"
    )


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not a JSON object ({e.msg})") from e
            if not isinstance(obj, dict) or field not in obj:
                raise ConfigError(
                    f"{path}:{lineno}: no text field {field!r} (keys: "
                    f"{', '.join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__}); "
                    "name the field with --text-field"
                )
            if not isinstance(obj[field], str):
                raise ConfigError(
                    f"{path}:{lineno}: field {field!r} is a {type(obj[field]).__name__}, not text"
                )
            yield obj[field]


def _parquet_documents(path: Path, column: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow: pip install 'ddiloco[hf]' ({e})") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types for a bad file
        raise ConfigError(f"{path}: not a readable Parquet file ({str(e)[:200]})") from e
    names = pf.schema_arrow.names
    if column not in names:
        raise ConfigError(
            f"{path}: no text column {column!r} (columns: {', '.join(names)}); name it with --text-column"
        )
    for batch in pf.iter_batches(columns=[column], batch_size=4096):
        for v in batch.column(0).to_pylist():
            if v is not None:
                yield str(v)


def documents(path: Path, text_field: str, text_column: str) -> Iterator[str]:
    """The documents of one shard, in file order."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_documents(path, text_field)
    elif suffix == ".parquet":
        yield from _parquet_documents(path, text_column)
    else:
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e


def read_tokens(spec: str, tok: Tokenizer, text_field: str = "text", text_column: str = "text") -> np.ndarray:
    """Every shard of ``spec`` tokenised and joined, in shard order. Raises ``ConfigError`` naming a shard
    that cannot be read or holds no text."""
    parts: list[np.ndarray] = []
    for path in shard_paths(spec):
        n0 = len(parts)
        try:
            for doc in documents(path, text_field, text_column):
                if doc:
                    parts.append(tok.encode_document(doc))
        except OSError as e:
            raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from e
        if len(parts) == n0:
            raise ConfigError(f"{path}: the shard is empty (no text in it)")
    return np.concatenate(parts).astype(np.int64)


class Corpus:
    """A token stream's training windows and its fixed evaluation batches."""

    def __init__(self, tokens: np.ndarray, seq_len: int, source: str, eval_fraction: float = 0.05) -> None:
        span = seq_len + 1
        if len(tokens) < 4 * span:
            raise ConfigError(
                f"data={source!r} is invalid: it holds {len(tokens)} tokens; seq_len={seq_len} needs at "
                f"least {4 * span}"
            )
        t = torch.from_numpy(tokens)
        cut = min(int(len(t) * (1 - eval_fraction)), len(t) - 2 * span)
        self.train, self.eval = t[:cut], t[cut:]
        self.seq_len = seq_len
        # Windows start every seq_len tokens, so each token is predicted in exactly one window.
        self.n_windows = (len(self.train) - 1) // seq_len
        if self.n_windows < 1:
            raise ConfigError(f"data={source!r} is invalid: too little text for one training window")

    def window(self, i: int) -> torch.Tensor:
        return self.train[i * self.seq_len : i * self.seq_len + self.seq_len + 1]

    def eval_batches(self, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        span = self.seq_len + 1
        n = max(1, min(batch_size * n_batches, (len(self.eval) - 1) // span))
        starts = torch.linspace(0, len(self.eval) - span, steps=n).long()
        out = []
        for chunk in starts.split(batch_size):
            w = self.eval[chunk[:, None] + torch.arange(span)]
            out.append((w[:, :-1], w[:, 1:]))
        return out


class Reader:
    """Lane ``lane`` of ``lanes``: batch ``b`` holds the windows at slots ``(b * batch + i) * lanes + lane``
    of an endless order (one seeded permutation of the windows per epoch). Disjoint from every other lane's;
    ``position`` (batches read) is its whole state."""

    def __init__(self, corpus: Corpus, batch_size: int, lane: int, lanes: int, seed: int) -> None:
        if not 0 <= lane < lanes:
            raise ConfigError(f"data part {lane}/{lanes} is invalid: need 0 <= part < parts")
        self.corpus, self.batch_size, self.lane, self.lanes, self.seed = corpus, batch_size, lane, lanes, seed
        self.position = 0
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.corpus.n_windows, generator=gen)}
        return self._perms[epoch]

    def window_ids(self, position: int) -> list[int]:
        """The (epoch, window) of each sequence of batch ``position``, as epoch * windows + window."""
        n = self.corpus.n_windows
        out = []
        for i in range(self.batch_size):
            slot = (position * self.batch_size + i) * self.lanes + self.lane
            epoch, k = divmod(slot, n)
            out.append(epoch * n + int(self._perm(epoch)[k]))
        return out

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.corpus.n_windows
        w = torch.stack([self.corpus.window(i % n) for i in self.window_ids(self.position)])
        self.position += 1
        return w[:, :-1], w[:, 1:]
