"""Your data as one token stream: training windows read from a token cache on disk, fixed evaluation batches.

The documents of ``--data`` (``node.learner.sources``) are tokenised once into a cache of flat token shards
(``node.learner.token_cache``); ``Corpus`` reads that stream through ``ShardStream``, a window at a time with
``pread`` (a memory map would count every page it touched in the node's RSS), so a node's memory does not
grow with the corpus. The stream's last 5% is the evaluation split.

The training split is cut into windows of ``seq_len + 1`` tokens, and ``Reader`` hands them out in an order
fixed by a seed: learner ``k`` of ``N`` reads every N-th window from the k-th, so the learners of a swarm
read disjoint data, and a reader's position (batches read) is all it needs to go on where it stopped. The
order shuffles whole blocks of ``BLOCK_TOKENS`` tokens, then the windows within a block, so a corpus much
larger than RAM is read a block at a time instead of at random all over the disk.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from node.learner.sources import documents, shard_paths
from node.learner.token_cache import TokenCache
from node.learner.tokenize import Tokenizer
from protocol.errors import ConfigError

BLOCK_TOKENS = 1 << 24  # 16M tokens: 32 MB of uint16 read before the order moves to another block
OPEN_SHARDS = 64


def read_tokens(spec: str, tok: Tokenizer, text_field: str = "text", text_column: str = "text") -> np.ndarray:
    """Every shard of ``spec`` tokenised in this process and joined, in shard order (no cache): the reader
    the cache is measured against, and the same tokens. Raises ``ConfigError`` naming a shard that cannot be
    read or holds no text."""
    parts: list[np.ndarray] = []
    for path in shard_paths(spec):
        n0 = len(parts)
        for doc in documents(path, text_field, text_column):
            if doc:
                parts.append(tok.encode_document(doc))
        if len(parts) == n0:
            raise ConfigError(f"{path}: the shard is empty (no text in it)")
    return np.concatenate(parts).astype(np.int64)


class ArrayStream:
    """A token stream held in memory."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.tokens[start:stop].astype(np.int64)


class ShardStream:
    """The shards of a token cache as one stream, read with ``pread`` (at most ``OPEN_SHARDS`` files open)."""

    def __init__(self, cache: TokenCache) -> None:
        self.folder, self.dtype = cache.folder, np.dtype(cache.dtype)
        self.names = [name for name, _ in cache.shards]
        self.starts = np.cumsum([0] + [n for _, n in cache.shards])
        self._fds: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _fd(self, k: int) -> int:
        if k in self._fds:
            self._fds.move_to_end(k)
            return self._fds[k]
        path = Path(self.folder, self.names[k])
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ConfigError(
                f"{path}: cannot be read ({e.strerror or e}); the token cache is damaged"
            ) from e
        self._fds[k] = fd
        if len(self._fds) > OPEN_SHARDS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=np.int64)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        at = start
        while at < stop:
            take = min(stop, int(self.starts[k + 1])) - at
            want = take * self.dtype.itemsize
            raw = os.pread(self._fd(k), want, (at - int(self.starts[k])) * self.dtype.itemsize)
            if len(raw) != want:
                raise ConfigError(
                    f"{Path(self.folder, self.names[k])}: cut short; the token cache is damaged"
                )
            out[at - start : at - start + take] = np.frombuffer(raw, dtype=self.dtype)
            at, k = at + take, k + 1
        return out

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __del__(self) -> None:
        self.close()


class Corpus:
    """A token stream's training windows and its fixed evaluation batches."""

    def __init__(
        self, stream: ArrayStream | ShardStream, seq_len: int, source: str, eval_fraction: float = 0.05
    ) -> None:
        span, n = seq_len + 1, len(stream)
        if n < 4 * span:
            raise ConfigError(
                f"data={source!r} is invalid: it holds {n} tokens; seq_len={seq_len} needs at least {4 * span}"
            )
        self.stream, self.seq_len = stream, seq_len
        self.cut = min(int(n * (1 - eval_fraction)), n - 2 * span)  # [0, cut) trains, [cut, n) evaluates
        self.n_tokens = n
        # Windows start every seq_len tokens, so each token is predicted in exactly one window.
        self.n_windows = (self.cut - 1) // seq_len
        if self.n_windows < 1:
            raise ConfigError(f"data={source!r} is invalid: too little text for one training window")

    def window(self, i: int) -> torch.Tensor:
        a = i * self.seq_len
        return torch.from_numpy(self.stream.read(a, a + self.seq_len + 1))

    def eval_batches(self, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        span = self.seq_len + 1
        n_eval = self.n_tokens - self.cut
        n = max(1, min(batch_size * n_batches, (n_eval - 1) // span))
        starts = torch.linspace(0, n_eval - span, steps=n).long() + self.cut
        out = []
        for chunk in starts.split(batch_size):
            w = torch.stack([torch.from_numpy(self.stream.read(int(s), int(s) + span)) for s in chunk])
            out.append((w[:, :-1], w[:, 1:]))
        return out


def _perm(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


class Reader:
    """Lane ``lane`` of ``lanes``: batch ``b`` holds the windows at slots ``(b * batch + i) * lanes + lane``
    of an endless order (per epoch: a seeded order of the blocks, and of the windows within each block).
    Disjoint from every other lane's; ``position`` (batches read) is its whole state."""

    def __init__(self, corpus: Corpus, batch_size: int, lane: int, lanes: int, seed: int) -> None:
        if not 0 <= lane < lanes:
            raise ConfigError(f"data part {lane}/{lanes} is invalid: need 0 <= part < parts")
        self.corpus, self.batch_size, self.lane, self.lanes, self.seed = corpus, batch_size, lane, lanes, seed
        self.position = 0
        n = corpus.n_windows
        self.block = max(1, BLOCK_TOKENS // corpus.seq_len)
        self.n_blocks = -(-n // self.block)
        self._epoch: tuple[int, torch.Tensor, np.ndarray] | None = None  # epoch, block order, slot starts
        self._within: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()

    def _seed(self, epoch: int, block: int = -1) -> int:
        base = self.seed * 1_000_003 + epoch
        return base if block < 0 else (base * 1_000_033 + block) % (1 << 62)

    def _slot(self, epoch: int, k: int) -> int:
        """The window at slot ``k`` of epoch ``epoch``."""
        n = self.corpus.n_windows
        if self.n_blocks == 1:  # one block: one permutation of every window
            return int(self._block_perm(epoch, -1, n)[k])
        if self._epoch is None or self._epoch[0] != epoch:
            order = _perm(self.n_blocks, self._seed(epoch))
            sizes = np.array([min(self.block, n - int(b) * self.block) for b in order])
            self._epoch = (epoch, order, np.concatenate([[0], np.cumsum(sizes)]))
        _, order, starts = self._epoch
        j = int(np.searchsorted(starts, k, side="right")) - 1
        b = int(order[j])
        size = min(self.block, n - b * self.block)
        return b * self.block + int(self._block_perm(epoch, b, size)[k - int(starts[j])])

    def _block_perm(self, epoch: int, block: int, size: int) -> torch.Tensor:
        key = (epoch, block)
        if key not in self._within:
            self._within[key] = _perm(size, self._seed(epoch, block))
            if len(self._within) > 2:
                self._within.popitem(last=False)
        return self._within[key]

    def window_ids(self, position: int) -> list[int]:
        """The (epoch, window) of each sequence of batch ``position``, as epoch * windows + window."""
        n = self.corpus.n_windows
        out = []
        for i in range(self.batch_size):
            slot = (position * self.batch_size + i) * self.lanes + self.lane
            epoch, k = divmod(slot, n)
            out.append(epoch * n + self._slot(epoch, k))
        return out

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.corpus.n_windows
        w = torch.stack([self.corpus.window(i % n) for i in self.window_ids(self.position)])
        self.position += 1
        return w[:, :-1], w[:, 1:]
