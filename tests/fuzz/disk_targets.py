"""Fuzz targets for checkpoints on disk (``node.swarm.checkpoint``): one file loaded alone, and the newest of a
folder whose older checkpoint is valid (``load_latest``)."""

from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from node.swarm import checkpoint as ckpt
from protocol.hashing import tensors_hash
from tests.fuzz.harness import (
    BYTE_MUTATORS,
    SWARM,
    Target,
    mutate_st_header,
    mutate_st_tensors,
    st_dump,
    st_meta,
)


# checkpoints ----------------------------------------------------------------------------------------------
class CheckpointDir:
    """A scratch folder holding an older valid checkpoint (step 1) and, per input, the newest (step 2)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ddiloco-fuzz-"))
        self.folder = self.root / "ckpts"
        self.old = ckpt.save_checkpoint(self.folder, 1, checkpoint_tensors(1), {"rounds": [1]}, SWARM)
        self.seed = ckpt.save_checkpoint(self.folder, 2, checkpoint_tensors(2), {"rounds": [2, 3]}, SWARM)
        self.seed_bytes = self.seed.read_bytes()
        self.single = self.root / "one" / self.seed.name
        self.single.parent.mkdir()

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def checkpoint_tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "global/0/w": torch.randn(16, 8, generator=g),
        "opt/exp_avg": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "opt/step": torch.tensor([step], dtype=torch.int64),
    }


@functools.cache
def checkpoint_dir() -> CheckpointDir:
    d = CheckpointDir()
    atexit.register(d.close)  # one scratch folder a process, removed when it exits
    return d


def reseal_checkpoint(rng: random.Random, raw: bytes) -> bytes:
    """Recompute the checksums a checkpoint carries over its (mutated) tensors and document."""
    tensors, meta = dict(st_load(raw)), dict(st_meta(raw))
    doc = json.loads(meta["ddiloco"])
    try:
        doc["tensors_sha256"] = tensors_hash(tensors)
    except TypeError:  # a dtype numpy cannot hash (float8): the loader must refuse it all the same
        doc["tensors_sha256"] = ""
    doc["meta"]["resealed"] = True  # valid by construction now: ``check`` cannot expect the seed's contents
    return st_dump(tensors, metadata=ckpt.checkpoint_metadata(doc))


def other_swarm(rng: random.Random, raw: bytes) -> bytes:
    tensors, meta = dict(st_load(raw)), dict(st_meta(raw))
    doc = json.loads(meta["ddiloco"])
    doc["swarm"] = rng.choice(["other", "", SWARM + " ", SWARM.upper()])
    return st_dump(tensors, metadata=ckpt.checkpoint_metadata(doc))


def load_checkpoint_bytes(raw: bytes) -> ckpt.Checkpoint:
    d = checkpoint_dir()
    d.single.write_bytes(raw)
    return ckpt.load_checkpoint(d.single, SWARM)


def load_latest_bytes(raw: bytes) -> ckpt.Checkpoint | None:
    d = checkpoint_dir()
    d.seed.write_bytes(raw)
    return ckpt.load_latest(d.folder, SWARM)


def same_checkpoint(ck: ckpt.Checkpoint, step: int, meta: dict) -> bool:
    want = checkpoint_tensors(step)
    return (
        ck.step == step
        and ck.meta == meta
        and set(ck.tensors) == set(want)
        and all(torch.equal(ck.tensors[k], want[k]) and ck.tensors[k].dtype == want[k].dtype for k in want)
    )


def _check_checkpoint(ck: ckpt.Checkpoint) -> None:
    assert type(ck.step) is int and isinstance(ck.meta, dict) and isinstance(ck.tensors, dict)
    if not ck.meta.get("resealed"):  # damage only: what loads must be exactly what was saved
        assert same_checkpoint(ck, 2, {"rounds": [2, 3]}), "accepted a checkpoint whose contents changed"


def _check_latest(ck: ckpt.Checkpoint | None) -> None:
    assert ck is not None, "the older valid checkpoint was not used"
    if ck.path is not None and ck.path.name == checkpoint_dir().seed.name:
        _check_checkpoint(ck)
    else:
        assert same_checkpoint(ck, 1, {"rounds": [1]}), "the older checkpoint's contents differ"


CHECKPOINT_REASONS = (
    "unreadable or truncated",
    "no ddiloco metadata",
    "not an object",
    "format",
    "metadata does not match",
    "belongs to swarm",
    "unexpected dtype",
    "tensor data does not match",
    "step",
)


def _which(ck: ckpt.Checkpoint | None) -> str:
    if ck is None or ck.path is None:
        return "none"
    return "newest used" if ck.path.name == checkpoint_dir().seed.name else "fell back to previous"


CHECKPOINT_MUTATORS = [mutate_st_header, mutate_st_tensors, other_swarm] + BYTE_MUTATORS
CHECKPOINT = Target(
    "checkpoint",
    lambda: [checkpoint_dir().seed_bytes],
    load_checkpoint_bytes,
    (ckpt.CheckpointError,),
    _check_checkpoint,
    CHECKPOINT_MUTATORS,
    finish=reseal_checkpoint,
    reasons=CHECKPOINT_REASONS,
    describe=lambda ck: "resealed" if ck.meta.get("resealed") else "intact",
)
LATEST = Target(
    "load_latest",
    lambda: [checkpoint_dir().seed_bytes],
    load_latest_bytes,
    (),  # never raises: a bad newest file is skipped with a logged reason
    _check_latest,
    CHECKPOINT_MUTATORS,
    finish=reseal_checkpoint,
    describe=_which,
)
