"""The merge records a node keeps (its record log and what re-anchors an old base), on disk, not in memory.

A node keeps the signed bytes of each fragment's last ``history`` records: to serve catch-up by records, and
to decode a round's merged gradient again when a contribution taken on an older round must be re-anchored.
Both are rare, and a round's record is about 1/7 of its fragment's fp32 bytes (int4): at 124M parameters and
``history`` 4 the log grew to 143 MiB of each node's memory, 0.3x the weights. ``SignedFiles.keep`` writes the
bytes to a file of the node's state folder and hands back a ``SignedFile``, which reads them when asked; the file
is removed when the last holder of its ``SignedFile`` lets go (the log and the replica's history both hold it). A
disk that refuses the write (full, read-only) leaves the bytes in memory, as before: the node goes on.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import weakref
from pathlib import Path

logger = logging.getLogger(__name__)


class SignedFile:
    """Signed bytes kept in a file; ``bytes(x)`` reads them, ``len(x)`` is their size."""

    __slots__ = ("path", "size", "__weakref__")

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        weakref.finalize(self, _remove, str(path))

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        data = self.path.read_bytes()
        if len(data) != self.size:
            raise OSError(f"{self.path}: {len(data)} bytes on disk, {self.size} written")
        return data


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def in_memory(raw: bytes | SignedFile) -> int:
    """The bytes ``raw`` holds in this process's memory (a spilled record: none)."""
    return 0 if isinstance(raw, SignedFile) else len(raw)


class SignedFiles:
    """A folder of spilled records; emptied when made (what a previous life of the node left is stale)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        shutil.rmtree(folder, ignore_errors=True)
        self._ids = itertools.count()
        self._warned = False

    def keep(self, raw: bytes, name: str) -> bytes | SignedFile:
        path = self.folder / f"{next(self._ids)}-{name}.rec"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(raw)
        except OSError as e:
            _remove(str(path))
            if not self._warned:
                logger.warning("records kept in memory, not in %s: %s", self.folder, e)
                self._warned = True
            return raw
        return SignedFile(path, len(raw))
