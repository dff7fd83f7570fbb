"""Codecs for outer gradients on the wire (DESIGN §1): fp32, bf16, int8 and 4-bit E3M0.

Each codec turns one float tensor into a few wire tensors (``Encoded``) and back into fp32; merges always
accumulate in fp32. Each also states its worst-case elementwise error, which the tests hold it to.

4-bit ("int4", E3M0-like): per block of ``block`` elements a fp32 scale s = max|x|; each element keeps a
sign bit and a 3-bit code for its magnitude relative to s, one of {0, 2^-6, 2^-5, ..., 2^-1, 1}, rounded to
the nearest level in linear terms. Two codes pack into a byte, so a value costs 4 bits + 32/block bits.
Bound: |x - q(x)| <= max(|x| / 3, s / 128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protocol.errors import ProtocolError, RejectCode

_INT4_LEVELS = torch.tensor([0.0] + [2.0**-k for k in range(6, -1, -1)])  # 8 magnitudes, code 0..7
_INT4_MIDPOINTS = (_INT4_LEVELS[1:] + _INT4_LEVELS[:-1]) / 2


@dataclass(frozen=True)
class Encoded:
    """One tensor as it travels: the codec's wire tensors plus the original shape."""

    codec: str
    shape: tuple[int, ...]
    parts: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block), pad


def _scales(blocks: torch.Tensor) -> torch.Tensor:
    s = blocks.abs().amax(dim=1, keepdim=True)
    return torch.where(s > 0, s, torch.ones_like(s))


class Fp32:
    name = "fp32"

    def encode(self, x: torch.Tensor, block: int) -> Encoded:
        return Encoded(self.name, tuple(x.shape), {"v": x.detach().to(torch.float32).reshape(-1).clone()})

    def decode(self, e: Encoded) -> torch.Tensor:
        return e.parts["v"].to(torch.float32).reshape(e.shape)

    def error_bound(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return torch.zeros_like(x, dtype=torch.float32)


class Bf16(Fp32):
    name = "bf16"

    def encode(self, x: torch.Tensor, block: int) -> Encoded:
        return Encoded(self.name, tuple(x.shape), {"v": x.detach().to(torch.bfloat16).reshape(-1).clone()})

    def error_bound(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return x.detach().abs().to(torch.float32) * 2.0**-8


class Int8:
    name = "int8"

    def encode(self, x: torch.Tensor, block: int) -> Encoded:
        b, _ = _blocks(x, block)
        s = _scales(b)
        q = torch.round(b / s * 127.0).clamp(-127, 127).to(torch.int8)
        return Encoded(self.name, tuple(x.shape), {"q": q.reshape(-1), "s": s.reshape(-1)})

    def decode(self, e: Encoded) -> torch.Tensor:
        s = e.parts["s"].to(torch.float32).reshape(-1, 1)
        q = e.parts["q"].to(torch.float32).reshape(s.shape[0], -1)
        n = _numel(e.shape)
        return (q * s / 127.0).reshape(-1)[:n].reshape(e.shape)

    def error_bound(self, x: torch.Tensor, block: int) -> torch.Tensor:
        b, _ = _blocks(x, block)
        bound = (_scales(b) / 254.0).expand_as(b).reshape(-1)[: x.numel()]
        return bound.reshape(x.shape) * (1 + 1e-6)


class Int4:
    name = "int4"

    def encode(self, x: torch.Tensor, block: int) -> Encoded:
        if block % 2:
            raise ValueError(f"int4 needs an even block size, got {block}")
        b, _ = _blocks(x, block)
        s = _scales(b)
        y = b / s
        code = torch.bucketize(y.abs(), _INT4_MIDPOINTS).to(torch.uint8)  # 0..7
        code = code | ((y < 0).to(torch.uint8) << 3)
        code = code.reshape(-1)
        packed = code[0::2] | (code[1::2] << 4)
        return Encoded(self.name, tuple(x.shape), {"q": packed, "s": s.reshape(-1)})

    def decode(self, e: Encoded) -> torch.Tensor:
        packed = e.parts["q"]
        if packed.dtype != torch.uint8:
            raise ProtocolError(RejectCode.WRONG_SHAPE, f"int4 codes must be uint8, got {packed.dtype}")
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1).long()
        s = e.parts["s"].to(torch.float32).reshape(-1, 1)
        mag = _INT4_LEVELS[codes & 7]
        val = torch.where((codes & 8) > 0, -mag, mag).reshape(s.shape[0], -1) * s
        n = _numel(e.shape)
        return val.reshape(-1)[:n].reshape(e.shape)

    def error_bound(self, x: torch.Tensor, block: int) -> torch.Tensor:
        b, _ = _blocks(x, block)
        floor = (_scales(b) / 128.0).expand_as(b).reshape(-1)[: x.numel()].reshape(x.shape)
        rel = x.detach().abs().to(torch.float32) / 3.0
        return torch.maximum(rel, floor) * (1 + 1e-6)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


CODECS = {c.name: c for c in (Fp32(), Bf16(), Int8(), Int4())}


def get_codec(name: str):
    try:
        return CODECS[name]
    except KeyError:
        raise ProtocolError(RejectCode.UNKNOWN_CODEC, f"unknown codec {name!r}") from None


def encode_tensors(tensors: dict[str, torch.Tensor], codec: str, block: int) -> dict[str, Encoded]:
    c = get_codec(codec)
    return {name: c.encode(t, block) for name, t in tensors.items()}


def decode_tensors(encoded: dict[str, Encoded]) -> dict[str, torch.Tensor]:
    out = {}
    for name, e in encoded.items():
        c = get_codec(e.codec)
        if _numel(e.shape) and not e.parts:
            raise ProtocolError(RejectCode.MALFORMED, f"tensor {name!r} has no payload")
        out[name] = c.decode(e)
    return out


def wire_bytes(encoded: dict[str, Encoded]) -> int:
    return sum(e.nbytes for e in encoded.values())


def encoded_nbytes(numel: int, codec: str, block: int) -> int:
    """Wire bytes of one tensor of ``numel`` values once encoded (``Encoded.nbytes``), without encoding it:
    fp32 4 and bf16 2 bytes a value; int8 and int4 1 and 1/2 a value over whole blocks, plus one fp32 scale
    a block."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(sorted(CODECS))}")
    if codec in ("fp32", "bf16"):
        return (4 if codec == "fp32" else 2) * numel
    blocks = math.ceil(numel / block)
    return blocks * block // (2 if codec == "int4" else 1) + 4 * blocks
