"""A stable hash of fragment state, so replicas can check they hold the same global model
(docs/design.md, section 4).

SHA-256 over, for each tensor in name order: its name, dtype, shape and contiguous little-endian bytes.
The same tensors give the same hex digest in any process on any machine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def tensors_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        # flat: numpy views at most 64 dimensions; the same bytes, read in place (no copy of the tensor)
        h.update(memoryview(t.reshape(-1).numpy()).cast("B"))
    return h.hexdigest()


def model_hash(fragment_hashes: list[str]) -> str:
    """One digest for the whole global model from its fragments' digests, in fragment order."""
    return hashlib.sha256("".join(fragment_hashes).encode()).hexdigest()
