"""The user's text files, read as documents: which files ``--data`` names, and the documents of each, whole
or in pieces ("units") that worker processes tokenise side by side. Imports neither torch nor the node, so a
tokenising worker starts in a fraction of a second.

``--data`` names a file, a folder (every shard in it, sorted by name) or a glob (``shards/*.parquet``). A
shard's kind comes from its suffix: ``.jsonl`` (one JSON object a line, the text under ``--text-field``),
``.parquet`` (read with pyarrow, the text in column ``--text-column``), anything else plain UTF-8 text (one
document a file).

A unit is a byte range of a JSONL or text file cut just after a newline (about ``UNIT_BYTES`` long), or one
row group of a Parquet file. A text file cut in pieces is still one document: only its last piece ends it.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import ConfigError

SHARD_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".parquet")
UNIT_BYTES = 32 << 20


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


@dataclass(frozen=True)
class Unit:
    """Piece ``start:end`` (bytes; for Parquet: row groups) of source file ``path``; ``last``: it ends the
    file (a text file's document ends there)."""

    path: str
    start: int
    end: int
    last: bool

    @property
    def kind(self) -> str:
        suffix = Path(self.path).suffix.lower()
        return suffix[1:] if suffix in (".jsonl", ".parquet") else "text"


def _unreadable(path: Path | str, e: OSError) -> ConfigError:
    return ConfigError(f"{path}: cannot be read ({e.strerror or e})")


def plan_units(path: Path, unit_bytes: int | None = None) -> list[Unit]:
    """``path`` cut into units of about ``unit_bytes`` (default ``UNIT_BYTES``), each ending just after a
    newline (or the file's end)."""
    unit_bytes = unit_bytes or UNIT_BYTES
    try:
        if path.suffix.lower() == ".parquet":
            n = _parquet_file(path).num_row_groups
            return [Unit(str(path), g, g + 1, g == n - 1) for g in range(n)] or [Unit(str(path), 0, 0, True)]
        size = path.stat().st_size
        cuts = [0]
        with open(path, "rb") as fh:
            while cuts[-1] + unit_bytes < size:
                fh.seek(cuts[-1] + unit_bytes)
                fh.readline()
                if fh.tell() >= size:
                    break
                cuts.append(fh.tell())
    except OSError as e:
        raise _unreadable(path, e) from e
    cuts.append(size)
    return [Unit(str(path), a, b, b == size) for a, b in zip(cuts, cuts[1:], strict=False)]


def _read_range(path: str, start: int, end: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            return fh.read(end - start)
    except OSError as e:
        raise _unreadable(path, e) from e


def _line_number(path: str, offset: int) -> int:
    """The 1-based line of byte ``offset`` (only ever computed for an error message)."""
    with open(path, "rb") as fh:
        return fh.read(offset).count(b"\n") + 1


def _where(unit: Unit, at: int) -> str:
    return f"{unit.path}:{_line_number(unit.path, unit.start + at)}"


def _jsonl_documents(unit: Unit, field: str) -> Iterator[str]:
    data = _read_range(unit.path, unit.start, unit.end)
    pos = 0
    for line in data.split(b"\n"):
        at, pos = pos, pos + len(line) + 1
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{_where(unit, at)}: not a JSON object ({e.msg})") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"{_where(unit, at)}: not UTF-8 text ({e.reason})") from e
        if not isinstance(obj, dict) or field not in obj:
            raise ConfigError(
                f"{_where(unit, at)}: no text field {field!r} (keys: "
                f"{', '.join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__}); "
                "name the field with --text-field"
            )
        if not isinstance(obj[field], str):
            raise ConfigError(
                f"{_where(unit, at)}: field {field!r} is a {type(obj[field]).__name__}, not text"
            )
        yield obj[field]


def _parquet_file(path: Path | str):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow: pip install 'ddiloco[hf]' ({e})") from None
    try:
        return pq.ParquetFile(path)
    except OSError as e:
        if not Path(path).is_file() or isinstance(e, PermissionError):
            raise _unreadable(path, e) from e
        raise ConfigError(f"{path}: not a readable Parquet file ({str(e)[:200]})") from e
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types for a bad file
        raise ConfigError(f"{path}: not a readable Parquet file ({str(e)[:200]})") from e


def _parquet_documents(unit: Unit, column: str) -> Iterator[str]:
    pf = _parquet_file(unit.path)
    names = pf.schema_arrow.names
    if column not in names:
        raise ConfigError(
            f"{unit.path}: no text column {column!r} (columns: {', '.join(names)}); name it with --text-column"
        )
    for g in range(unit.start, unit.end):
        for v in pf.read_row_group(g, columns=[column]).column(0).to_pylist():
            if v is not None:
                yield str(v)


def _text_documents(unit: Unit) -> Iterator[str]:
    data = _read_range(unit.path, unit.start, unit.end)
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{unit.path}: not UTF-8 text ({e.reason} at byte {unit.start + e.start})") from e


def unit_documents(unit: Unit, text_field: str, text_column: str) -> Iterator[str]:
    """The documents (for a text file: the piece of its one document) in ``unit``, in file order."""
    if unit.kind == "jsonl":
        return _jsonl_documents(unit, text_field)
    if unit.kind == "parquet":
        return _parquet_documents(unit, text_column)
    return _text_documents(unit)


def documents(path: Path, text_field: str, text_column: str) -> Iterator[str]:
    """The documents of one shard, in file order."""
    for unit in plan_units(path, unit_bytes=1 << 62):
        yield from unit_documents(unit, text_field, text_column)
