"""Checkpoints (docs/design.md, section 6): one safetensors file of tensors plus JSON metadata, written
atomically.

A checkpoint holds named tensor groups (global fragments, outer momentum, learner parameters, inner optimizer
state, data-generator state) and a JSON document (rounds, hashes, counters, step, swarm id). The JSON
carries a SHA-256 of every tensor, and the JSON's own SHA-256 sits beside it in the file's metadata, so a
flipped bit anywhere — tensor data, tensor header or document — is caught on load, not trained on.

Writing: temp file in the same folder, fsync, rename, fsync the folder — a crash mid-write leaves the previous
checkpoint as the newest valid one. Loading: newest first; a file that is truncated, corrupt, from another
swarm or of another format version is skipped with a logged reason.

``export_model`` writes plain safetensors of a model's parameters, loadable with
``safetensors.torch.load_file`` and ``model.load_state_dict`` by any PyTorch or Hugging Face user; for a
transformers model (a task with ``save_pretrained``) ``export_pretrained`` writes, beside it, the folder
``AutoModelForCausalLM.from_pretrained`` loads (``model.safetensors`` -> ``model-hf/``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from protocol.errors import DDiLoCoError
from protocol.hashing import tensors_hash

logger = logging.getLogger(__name__)

FORMAT = "ddiloco-checkpoint/2"  # /2: the JSON document carries its own SHA-256
_NAME = re.compile(r"^ckpt-(\d{10})\.safetensors$")


class CheckpointError(DDiLoCoError):
    """A checkpoint file cannot be used; the message says which file and why."""


@dataclass
class Checkpoint:
    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict
    path: Path | None = None


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    folder: str | Path, step: int, tensors: Mapping[str, torch.Tensor], meta: dict, swarm: str, keep: int = 3
) -> Path:
    """Write ``ckpt-<step>.safetensors`` atomically; keep the newest ``keep`` files."""
    pending = PendingCheckpoint(folder, step, tensors, meta, swarm, keep)
    try:
        pending.write(tensors)
        return pending.finish()
    except BaseException:
        pending.abandon()
        raise


_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_READ_CHUNK = 8 << 20  # bytes read back at a time to hash a checkpoint
_PLACEHOLDER = "0" * 64  # a SHA-256 in hex, before it is known: the header keeps its length


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` on the host, without a copy where it already is a contiguous host tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _layout(tensors: Mapping[str, torch.Tensor], what: str) -> tuple[dict[str, dict], int]:
    """The safetensors header entries of ``tensors`` (sorted by name, packed in that order) and their bytes."""
    entries: dict[str, dict] = {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise CheckpointError(f"{what} tensor {name}: dtype {t.dtype} is not one we write")
        n = t.numel() * t.element_size()
        entries[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    return entries, offset


class PendingCheckpoint:
    """A checkpoint written in parts, straight from the tensors, with no copy of the model made for it.

    The layout (names, dtypes, shapes, offsets) is fixed first, so each tensor's bytes go to their place in
    a temporary file when its holder can hand them over: a learner writes its live parameters and optimizer
    state between two steps (its tensors change at the next one), while the node's replicas, which a merge
    replaces rather than writes to, are written from another thread. ``finish`` then reads the file back
    to hash the tensors as ``protocol.hashing.tensors_hash`` does, writes the header over its placeholder
    (same length), fsyncs and renames. The file is a plain safetensors file (``load_checkpoint``,
    ``safetensors.torch.load_file``)."""

    def __init__(
        self,
        folder: str | Path,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        meta: dict,
        swarm: str,
        keep: int = 3,
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.step, self.meta, self.swarm, self.keep = step, meta, swarm, keep
        self.final = self.folder / f"ckpt-{step:010d}.safetensors"
        self.tmp = self.folder / f".{self.final.name}.{os.getpid()}.{id(self)}.tmp"
        self.entries, offset = _layout(tensors, "checkpoint")
        self.dtypes = {name: tensors[name].dtype for name in self.entries}
        self.header = self._header(_PLACEHOLDER)
        self.data_start = 8 + len(self.header)
        self.written: set[str] = set()
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, self.data_start + offset)

    def _header(self, tensors_sha256: str) -> bytes:
        doc = {
            "format": FORMAT,
            "swarm": self.swarm,
            "step": self.step,
            "tensors_sha256": tensors_sha256,
            "meta": self.meta,
        }
        header = {"__metadata__": checkpoint_metadata(doc), **self.entries}
        raw = json.dumps(header, separators=(",", ":")).encode()
        return raw + b" " * (-len(raw) % 8)  # safetensors pads its header with spaces to 8 bytes

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write these tensors' bytes now (any thread; each must be one the layout names, as it was laid)."""
        for name, t in tensors.items():
            e = self.entries.get(name)
            if e is None or list(t.shape) != e["shape"] or t.dtype != self.dtypes[name]:
                raise CheckpointError(
                    f"checkpoint tensor {name} is not the one laid out ({t.dtype}, {t.shape})"
                )
            buf = _host_bytes(t)
            at, end = self.data_start + e["data_offsets"][0], self.data_start + e["data_offsets"][1]
            while at < end:
                n = os.pwrite(self.fd, buf[at - self.data_start - e["data_offsets"][0] :], at)
                at += n
            self.written.add(name)

    def _hash(self) -> str:
        """``tensors_hash`` of the tensors as written, read back from the file through one small buffer (a
        map of the file would count the whole checkpoint in the process's resident memory)."""
        h = hashlib.sha256()
        buf = bytearray(_READ_CHUNK)
        view = memoryview(buf)
        for name, e in self.entries.items():  # sorted by name when laid out
            a, b = e["data_offsets"]
            h.update(name.encode())
            h.update(str(self.dtypes[name]).encode())
            h.update(repr(tuple(e["shape"])).encode())
            at, end = self.data_start + a, self.data_start + b
            while at < end:
                n = os.preadv(self.fd, [view[: min(_READ_CHUNK, end - at)]], at)
                if n <= 0:
                    raise CheckpointError(f"checkpoint {self.final.name}: short read at byte {at}")
                h.update(view[:n])
                at += n
        return h.hexdigest()

    def finish(self) -> Path:
        """Hash, write the header, fsync, rename; keep the newest ``keep`` checkpoints. Every tensor must have
        been written."""
        missing = set(self.entries) - self.written
        if missing:
            raise CheckpointError(
                f"checkpoint {self.final.name}: tensors never written: {sorted(missing)[:4]}"
            )
        header = self._header(self._hash())
        if len(header) != len(self.header):
            raise CheckpointError(f"checkpoint {self.final.name}: its header changed length")
        os.pwrite(self.fd, struct.pack("<Q", len(header)) + header, 0)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.final)
        _fsync_dir(self.folder)
        for old in list_checkpoints(self.folder)[self.keep :]:
            old.unlink(missing_ok=True)
        return self.final

    def abandon(self) -> None:
        """Close and remove the temporary file (after a failure); the previous checkpoints stay."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoint files in ``folder``, newest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_metadata(doc: dict) -> dict[str, str]:
    """The safetensors metadata of a checkpoint: its JSON document and the document's SHA-256."""
    text = json.dumps(doc)
    return {"ddiloco": text, "ddiloco_sha256": hashlib.sha256(text.encode()).hexdigest()}


def load_checkpoint(path: str | Path, swarm: str) -> Checkpoint:
    """Load and verify one file. Raises CheckpointError naming the file and the reason."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({str(e)[:200]})") from e
    try:
        text = header["ddiloco"]
        doc = json.loads(text)
    except (KeyError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: no ddiloco metadata; not a checkpoint of ours") from e
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: ddiloco metadata is a {type(doc).__name__}, not an object")
    if doc.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {repr(doc.get('format'))[:80]}, expected {FORMAT!r}")
    # The tensors' SHA-256 lives in the document, so the document needs its own: a flipped bit in a step,
    # a round or a counter would otherwise load as a different, valid-looking checkpoint.
    if hashlib.sha256(text.encode()).hexdigest() != header.get("ddiloco_sha256"):
        raise CheckpointError(f"{path}: metadata does not match its recorded SHA-256 (corrupted on disk)")
    if doc.get("swarm") != swarm:
        raise CheckpointError(f"{path}: belongs to swarm {repr(doc.get('swarm'))[:80]}, not {swarm!r}")
    try:
        intact = tensors_hash(tensors) == doc.get("tensors_sha256")
    except TypeError as e:  # a dtype numpy cannot view (float8, uint16, ...): not a tensor we write
        raise CheckpointError(f"{path}: tensor of an unexpected dtype ({e})") from e
    if not intact:
        raise CheckpointError(f"{path}: tensor data does not match its recorded SHA-256 (corrupted on disk)")
    step, meta = doc.get("step"), doc.get("meta", {})
    if type(step) is not int or step < 0 or not isinstance(meta, dict):
        raise CheckpointError(
            f"{path}: step {repr(step)[:40]} or meta of type {type(meta).__name__} is invalid"
        )
    return Checkpoint(step, tensors, meta, path)


def load_latest(folder: str | Path, swarm: str) -> Checkpoint | None:
    """The newest checkpoint that loads and verifies; bad ones are skipped with a warning."""
    for path in list_checkpoints(folder):
        try:
            return load_checkpoint(path, swarm)
        except CheckpointError as e:
            logger.warning("skipping checkpoint: %s", e)
    return None


def export_model(
    path: str | Path, params: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None = None
) -> Path:
    """Plain safetensors of model parameters (state-dict names), written atomically, tensor by tensor from
    the tensors themselves (``safetensors.torch.save_file`` first makes bytes of every tensor: a second copy
    of the model in memory at the end of a run)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    entries, _ = _layout(params, "export")
    header = {"__metadata__": {str(k): str(v) for k, v in (meta or {}).items()}, **entries}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in entries:
            f.write(_host_bytes(params[name]))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


def pretrained_folder(path: str | Path) -> Path:
    """Where ``export_pretrained`` puts the folder for the export file ``path``: ``runs/m.safetensors`` ->
    ``runs/m-hf``."""
    path = Path(path)
    return path.with_name(f"{path.stem}-hf")


def export_pretrained(task, path: str | Path, params: Mapping[str, torch.Tensor]) -> Path | None:
    """Beside the export file ``path``, the task's ``save_pretrained`` folder of ``params``; None when the
    task's model is not a transformers model."""
    save = getattr(task, "save_pretrained", None)
    if save is None or getattr(task, "hf", None) is None:
        return None
    folder = pretrained_folder(path)
    save(dict(params), folder)
    return folder
