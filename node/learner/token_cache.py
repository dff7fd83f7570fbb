"""A corpus tokenised once and kept on disk: flat token shards that learners read windows from.

A cache is a folder (under ``--token-cache``, default ``$DDILOCO_CACHE/tokens``) named after the corpus and a
digest of its source names, tokenizer and fields. It holds, per unit of the sources (``node.learner.sources``),
``shard-NNNNNN.tok`` (the unit's tokens, ``uint16`` when the vocabulary fits, else ``uint32``, each document
followed by the end-of-document token) and ``shard-NNNNNN.idx`` (``uint64`` token offsets where documents end),
and ``manifest.json``: the sources (path, size, mtime, SHA-256), the tokenizer (its SHA-256), the fields, and
each shard's token and document counts. The manifest is written last: a folder without one is a build that
has not finished, and ``build.json`` there says which units are done, so a build that was interrupted goes on
from its last whole shard.

The first process to need a cache builds it under an exclusive lock (``flock`` on ``.lock``); one that finds
the lock taken waits and then reads what was built. A cache is used only when it matches its manifest: same
sources (size and mtime; on a changed mtime the content's hash decides), same tokenizer, every shard whole.
Otherwise it is built again, and the log says why.

Units are tokenised by worker processes (``node.learner.token_workers``), each writing its shard itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from node.common.cache import cache_dir
from node.learner.sources import plan_units, shard_paths
from node.learner.token_workers import STALL_S, CacheSpec, encode_unit, run_workers, shard_names
from node.learner.tokenize import load_tokenizer, tokenizer_digest
from protocol.errors import ConfigError

logger = logging.getLogger(__name__)
FORMAT = 1
SMALL_BYTES = 8 << 20  # corpora under this are tokenised in the calling process
Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class TokenCache:
    """A whole cache: its folder, token dtype and shards (file names and token counts) in stream order."""

    folder: Path
    dtype: str
    shards: tuple[tuple[str, int], ...]
    manifest: dict
    built: bool = False  # this call built it (or finished or rebuilt it)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.shards)


def default_root() -> Path:
    return cache_dir() / "tokens"


def folder_for(spec: CacheSpec, sources: list[Path], root: Path) -> Path:
    key = json.dumps(
        [
            FORMAT,
            tokenizer_digest(spec.tokenizer),
            spec.text_field,
            spec.text_column,
            [s.name for s in sources],
        ]
    )
    stem = Path(spec.data.rstrip("/")).stem.strip("*?[]") or "corpus"
    return root / f"{stem[:40]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from e
    return h.hexdigest()


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from e
    return st.st_size, st.st_mtime_ns


def _mismatch(folder: Path, spec: CacheSpec, sources: list[Path], rehash: bool) -> str | None:
    """Why the cache in ``folder`` cannot be used (None: it can). ``rehash``: a source whose mtime moved is
    compared by content, and the manifest takes its new mtime when the content is the same."""
    try:
        m = json.loads((folder / "manifest.json").read_text())
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as e:
        return f"its manifest cannot be read ({e})"
    try:
        if m["format"] != FORMAT:
            return f"format {m['format']}, this version writes {FORMAT}"
        if m["tokenizer"]["sha256"] != tokenizer_digest(spec.tokenizer):
            return "the tokenizer changed"
        if [Path(s["path"]).name for s in m["sources"]] != [s.name for s in sources]:
            return "the source files changed"
        touched = False
        for rec, path in zip(m["sources"], sources, strict=True):
            size, mtime = _stat(path)
            if size != rec["size"]:
                return f"{path} changed ({rec['size']} -> {size} bytes)"
            if mtime != rec["mtime_ns"]:
                if not rehash:
                    return f"{path} was modified"
                if file_sha256(path) != rec["sha256"]:
                    return f"{path} changed (its content differs)"
                rec["mtime_ns"], rec["path"], touched = mtime, str(path), True
        itemsize = np.dtype(m["dtype"]).itemsize
        for s in m["shards"]:
            for name, want in ((s["file"], s["tokens"] * itemsize), (s["index"], s["docs"] * 8)):
                got = (folder / name).stat().st_size if (folder / name).exists() else None
                if got != want:
                    return f"{name} is cut short ({got} of {want} bytes)" if got else f"{name} is missing"
    except (KeyError, TypeError) as e:
        return f"its manifest lacks {e}"
    if touched:
        _write_json(folder / "manifest.json", m)
    return None


def _opened(folder: Path, built: bool = False) -> TokenCache:
    m = json.loads((folder / "manifest.json").read_text())
    return TokenCache(folder, m["dtype"], tuple((s["file"], s["tokens"]) for s in m["shards"]), m, built)


@contextlib.contextmanager
def _locked(folder: Path):
    """Holds ``folder/.lock`` exclusively; waits for another holder while its build shows progress."""
    try:
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(
            f"token cache {folder}: cannot be locked to build or check it ({e.strerror or e}); a read-only "
            "copy is used only while it matches its sources exactly (docs/data.md)"
        ) from e
    try:
        waited_since = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if waited_since is None:
                    waited_since, seen = now, _progress_mark(folder)
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
                    logger.warning("token cache %s: waiting for pid %s, which is building it", folder, holder)
                elif (mark := _progress_mark(folder)) != seen:
                    waited_since, seen = now, mark
                elif now - waited_since > STALL_S:
                    raise ConfigError(
                        f"token cache {folder}: locked by another process that showed no progress for "
                        f"{STALL_S:.0f} s; stop it or remove {folder}"
                    ) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _progress_mark(folder: Path) -> tuple:
    return tuple(
        (p.stat().st_mtime_ns if p.exists() else 0) for p in (folder / "build.json", folder / "manifest.json")
    )


def open_cache(
    spec: CacheSpec, root: Path | None = None, workers: int | None = None, progress: Progress | None = None
) -> TokenCache:
    """The cache of ``spec``, built (or finished, or rebuilt) first when it is not whole."""
    sources = shard_paths(spec.data)
    folder = folder_for(spec, sources, root or default_root())
    if _mismatch(folder, spec, sources, rehash=False) is None:
        return _opened(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"token cache {folder}: cannot be created ({e.strerror or e})") from e
    with _locked(folder):
        why = _mismatch(folder, spec, sources, rehash=True)
        if why is None:
            return _opened(folder)
        if why != "missing":
            logger.warning("token cache %s is built again: %s", folder, why)
            (folder / "manifest.json").unlink(missing_ok=True)
        _build(folder, spec, sources, workers or os.cpu_count() or 1, progress)
    return _opened(folder, built=True)


def _build(
    folder: Path, spec: CacheSpec, sources: list[Path], workers: int, progress: Progress | None
) -> None:
    t0 = time.monotonic()
    tok = load_tokenizer(spec.tokenizer)
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    stats = [_stat(p) for p in sources]
    for p, (size, _) in zip(sources, stats, strict=True):
        if size == 0:
            raise ConfigError(f"{p}: the shard is empty (no text in it)")
    units = [u for p in sources for u in plan_units(p)]
    plan = [list(asdict(u).values()) for u in units]
    # the journal names the build (spec, sources' stats, the units) by a digest: rewritten after every shard,
    # it stays a few bytes per shard however many units a corpus has
    build_id = hashlib.sha256(json.dumps([asdict(spec), stats, dtype, FORMAT, plan]).encode()).hexdigest()
    journal_path = folder / "build.json"
    done: dict[int, dict] = {}
    try:
        journal = json.loads(journal_path.read_text())
        if journal.get("id") == build_id:
            done = {int(k): v for k, v in journal["done"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    itemsize = np.dtype(dtype).itemsize
    for i, r in list(done.items()):  # a shard the journal names but the disk does not hold whole is redone
        tok_name, idx_name = shard_names(i)
        sizes = [(folder / n).stat().st_size if (folder / n).exists() else -1 for n in (tok_name, idx_name)]
        if sizes != [r["tokens"] * itemsize, r["docs"] * 8]:
            del done[i]
    if done:
        logger.warning(
            "token cache %s: resuming a build, %d of %d shards already whole", folder, len(done), len(units)
        )
    else:
        for p in folder.glob("shard-*"):
            p.unlink()
    total = sum(u.end - u.start if u.kind != "parquet" else 1 for u in units) or 1
    done_bytes = sum(u.end - u.start if u.kind != "parquet" else 1 for i, u in enumerate(units) if i in done)
    hashes: dict[Path, str] = {}
    hasher = threading.Thread(target=lambda: hashes.update({p: file_sha256(p) for p in sources}), daemon=True)
    hasher.start()

    def record(i: int, result: dict) -> None:
        nonlocal done_bytes
        done[i] = result
        done_bytes += units[i].end - units[i].start if units[i].kind != "parquet" else 1
        _write_json(journal_path, {"id": build_id, "units": len(units), "done": done})
        if progress:
            progress(done_bytes / total, f"{len(done)}/{len(units)} shards")

    todo = [i for i in range(len(units)) if i not in done]
    big = sum(units[i].end - units[i].start for i in todo if units[i].kind != "parquet") > SMALL_BYTES
    progress = progress if big else None  # a small corpus is tokenised in a moment: no progress lines
    if workers > 1 and len(todo) > 1 and (big or any(units[i].kind == "parquet" for i in todo)):
        run_workers(folder, spec, dtype, units, todo, min(workers, len(todo)), record)
    else:
        for i in todo:
            record(i, encode_unit(units[i], tok, spec, dtype, folder, i))
    hasher.join()
    if len(hashes) != len(sources):
        hashes.update(
            {p: file_sha256(p) for p in sources if p not in hashes}
        )  # the thread's error, raised here
    docs_by_source: dict[str, int] = {}
    for i, u in enumerate(units):
        docs_by_source[u.path] = docs_by_source.get(u.path, 0) + done[i]["docs"]
    for p in sources:
        if not docs_by_source.get(str(p)):
            raise ConfigError(f"{p}: the shard is empty (no text in it)")
    manifest = {
        "format": FORMAT,
        "dtype": dtype,
        "tokens": sum(r["tokens"] for r in done.values()),
        "tokenizer": {
            "path": tok.name,
            "sha256": tokenizer_digest(spec.tokenizer),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
        },
        "text_field": spec.text_field,
        "text_column": spec.text_column,
        "sources": [
            {"path": str(p), "size": s[0], "mtime_ns": s[1], "sha256": hashes[p]}
            for p, s in zip(sources, stats, strict=True)
        ],
        "shards": [
            {"file": shard_names(i)[0], "index": shard_names(i)[1], **done[i]} for i in range(len(units))
        ],
        "build_s": round(time.monotonic() - t0, 2),
    }
    _write_json(folder / "manifest.json", manifest)
    journal_path.unlink(missing_ok=True)
