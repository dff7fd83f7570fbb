"""Checkpoints (DESIGN §6): one safetensors file of tensors plus JSON metadata, written atomically.

A checkpoint holds named tensor groups (global fragments, outer momentum, learner parameters, inner optimizer
state, data-generator state) and a JSON document (rounds, hashes, counters, step, swarm id). The JSON also
carries a SHA-256 of every tensor, so a flipped bit is caught on load, not trained on.

Writing: temp file in the same folder, fsync, rename, fsync the folder — a crash mid-write leaves the previous
checkpoint as the newest valid one. Loading: newest first; a file that is truncated, corrupt, from another
swarm or of another format version is skipped with a logged reason.

``export_model`` writes plain safetensors of a model's parameters, loadable with
``safetensors.torch.load_file`` and ``model.load_state_dict`` by any PyTorch or Hugging Face user.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from protocol.errors import DDiLoCoError
from protocol.hashing import tensors_hash

logger = logging.getLogger(__name__)

FORMAT = "ddiloco-checkpoint/1"
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
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    doc = {"format": FORMAT, "swarm": swarm, "step": step, "tensors_sha256": tensors_hash(flat), "meta": meta}
    final = folder / f"ckpt-{step:010d}.safetensors"
    tmp = folder / f".{final.name}.{os.getpid()}.tmp"
    try:
        save_file(flat, str(tmp), metadata={"ddiloco": json.dumps(doc)})
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(folder)
    finally:
        if tmp.exists():
            tmp.unlink()
    for old in list_checkpoints(folder)[keep:]:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoint files in ``folder``, newest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load_checkpoint(path: str | Path, swarm: str) -> Checkpoint:
    """Load and verify one file. Raises CheckpointError naming the file and the reason."""
    path = Path(path)
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({e})") from e
    try:
        doc = json.loads(header["ddiloco"])
    except (KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: no ddiloco metadata; not a checkpoint of ours") from e
    if doc.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {doc.get('format')!r}, expected {FORMAT!r}")
    if doc.get("swarm") != swarm:
        raise CheckpointError(f"{path}: belongs to swarm {doc.get('swarm')!r}, not {swarm!r}")
    if tensors_hash(tensors) != doc.get("tensors_sha256"):
        raise CheckpointError(f"{path}: tensor data does not match its recorded SHA-256 (corrupted on disk)")
    return Checkpoint(int(doc["step"]), tensors, doc.get("meta", {}), path)


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
    """Plain safetensors of model parameters (state-dict names), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in params.items()}, str(tmp), metadata=dict(meta or {})
    )
    os.replace(tmp, path)
    return path
