"""Codecs for outer gradients on the wire (docs/design.md, section 1): fp32, bf16, int8, 4-bit E3M0 and
2-bit Lloyd-Max.

Each codec turns one float tensor into a few wire tensors (``Encoded``) and back into fp32; merges always
accumulate in fp32. Each also states its worst-case elementwise error, which the tests hold it to.

4-bit ("int4", E3M0-like): per block of ``block`` elements a fp32 scale s = max|x|; each element keeps a
sign bit and a 3-bit code for its magnitude relative to s, one of {0, 2^-6, 2^-5, ..., 2^-1, 1}, rounded to
the nearest level in linear terms. Two codes pack into a byte, so a value costs 4 bits + 32/block bits.
Bound: |x - q(x)| <= max(|x| / 3, s / 128).

2-bit ("int2"): per block a fp32 scale s = the block's RMS; each element becomes the nearest of the four
levels {-L1, -L0, L0, L1} * s with L0 = 0.4528 and L1 = 1.5104, the Lloyd-Max quantiser of a unit Gaussian
(thresholds 0 and +-0.9816 s). Four codes pack into a byte, so a value costs 2 bits + 32/block bits, 0.56 of
int4's. Values beyond L1 * s are clipped: |x - q(x)| <= max(0.5288 s, |x| - L1 s). It drops too much to be
used without error feedback (a learner adds what its last contribution's codec dropped to its next one,
``ProtocolConfig.feedback``); docs/algorithm.md measures what it costs.

Speed (``bench/codecs.py``): int8 and int4 go over a tensor in pieces of whole blocks, about
``_CHUNK`` values each, so that their several elementwise passes stay in cache, and write straight into
slices of the output tensors. int4 encode reads each code from a 1024-entry table indexed by the sign,
exponent and top mantissa bit of y = x / s (the midpoints between levels are where those bits change), and
decode reads the two signed levels of each byte from a 256-entry table. The arithmetic is the plain one
(y = x / s, a tie to the lower level as bucketize has it; x = level * s; int8 round(x / s * 127) and
q * s / 127, in that order), so codes and decoded values are bit for bit those of the straightforward
implementation (whole-tensor passes, as the codecs were first written; tests/test_codecs.py compares
with such references).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from protocol.errors import ProtocolError, RejectCode

_INT4_LEVELS = torch.tensor([0.0] + [2.0**-k for k in range(6, -1, -1)])  # 8 magnitudes, code 0..7
_INT4_MIDPOINTS = (_INT4_LEVELS[1:] + _INT4_LEVELS[:-1]) / 2

# Values one pass of int8/int4 works on: big enough that torch's per-op overhead (some microseconds) is
# small next to the op, small enough that a piece's few buffers stay in cache (measured: bench/codecs.py).
_CHUNK = 1 << 18


# values a byte of ``q`` holds, per blocked codec: the blocks of those codecs must be a multiple of it
PACKED = {"int8": 1, "int4": 2, "int2": 4}

_INT2_LEVELS = (-1.5104, -0.4528, 0.4528, 1.5104)  # codes 0..3, times the block's RMS
_INT2_THRESHOLD = (_INT2_LEVELS[2] + _INT2_LEVELS[3]) / 2  # 0.9816: between the inner and outer levels
_INT2_SCALE_MAX = torch.finfo(torch.float32).max / 2  # so that the outer level times a scale is finite
# per blocked codec, the largest code's size, which its decode multiplies by the block's scale first (int8
# divides by 127 after): a form decodes finite where this times its largest scale is finite
TOP_LEVEL = {"int8": 127.0, "int4": 1.0, "int2": _INT2_LEVELS[3]}
_INT2_DECODE = torch.tensor(
    [[_INT2_LEVELS[(b >> (2 * k)) & 3] for k in range(4)] for b in range(256)], dtype=torch.float32
)  # each byte's four values, the lowest two bits first


def _int4_code_table() -> torch.Tensor:
    """The int4 code (sign << 3 | magnitude code) of y = x / s (|y| <= 1) as a function of
    p = ((bits(y) - 1) mod 2^32) >> 22, i.e. of the sign, the 8 exponent bits and the top mantissa bit of the
    bit pattern just below y's. The patterns with one p run from (p << 22) + 1 to (p + 1) << 22, and every
    midpoint between two levels (1.5 * 2^-k, and 2^-7 between 0 and 2^-6) is such a run's last pattern, so
    one code serves a whole run, a tie going to the lower level as with bucketize. The runs of p = 511 and
    1023 end at -0.0 and +0.0 (the rest of them are NaNs): code 0."""
    first = (torch.arange(1024, dtype=torch.int64) << 22) + 1  # each run's first pattern, as uint32
    first = torch.where(first >= 2**31, first - 2**32, first).to(torch.int32).view(torch.float32)
    code = torch.bucketize(first.abs(), _INT4_MIDPOINTS) | ((first < 0).to(torch.int64) << 3)
    code[511] = code[1023] = 0
    return code


def _int16(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 2**15, v - 2**16, v).to(torch.int16)


# Encode: each p's code as int16 code * 0x1001 (the code in bits 0-3 and 12-15): two neighbours read as one
# little-endian int32 and shifted right by 12 hold the first's code in bits 0-3 and the second's in 4-7,
# which is their packed byte. Decode: the two signed levels each byte holds, a fp32 pair read as one int64.
_INT4_ENCODE = _int16(_int4_code_table() * 0x1001)
_INT4_SIGNED = torch.cat([_INT4_LEVELS, -_INT4_LEVELS])  # by code 0..15
_INT4_DECODE = torch.stack([_INT4_SIGNED.repeat(16), _INT4_SIGNED.repeat_interleave(16)], dim=1)
_INT4_DECODE = _INT4_DECODE.contiguous().view(torch.int64).reshape(256)
_LITTLE_ENDIAN = sys.byteorder == "little"
_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_INT2_TABLES: dict[torch.device, torch.Tensor] = {}


def _int4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tables = _TABLES.get(device)
    if tables is None:
        tables = _TABLES[device] = (_INT4_ENCODE.to(device), _INT4_DECODE.to(device))
    return tables


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


def _per_piece(blocks: int, block: int, device: torch.device) -> int:
    """Blocks in one piece: about ``_CHUNK`` values on the CPU, everything at once elsewhere."""
    if device.type != "cpu":
        return max(1, blocks)
    return max(1, _CHUNK // block)


def _in_pieces(x: torch.Tensor, block: int) -> Iterator[tuple[int, torch.Tensor]]:
    """x's values as (first block, fp32 (blocks, block)) pieces in order, the last one zero-padded to whole
    blocks. A piece of a contiguous fp32 x is a view of it; others are converted one piece at a time."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    blocks = -(-n // block)
    per = _per_piece(blocks, block, flat.device)
    for b0 in range(0, blocks, per):
        b1 = min(blocks, b0 + per)
        piece = flat[b0 * block : b1 * block]
        if piece.numel() < (b1 - b0) * block:
            padded = torch.zeros((b1 - b0) * block, dtype=torch.float32, device=flat.device)
            padded[: piece.numel()] = piece
            piece = padded
        yield b0, piece.to(torch.float32).view(b1 - b0, block)


def _out_pieces(out: torch.Tensor, blocks: int, block: int) -> Iterator[tuple[int, torch.Tensor]]:
    """The fp32 vector ``out`` of ``blocks`` whole blocks as (first block, (blocks, block) view) pieces."""
    if not blocks:
        return
    per = _per_piece(blocks, block, out.device)
    for b0 in range(0, blocks, per):
        b1 = min(blocks, b0 + per)
        yield b0, out[b0 * block : b1 * block].view(b1 - b0, block)


def _piece_scales(xb: torch.Tensor, work: torch.Tensor, s: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
    """Each row's max |x| into ``s`` (``one`` where that is 0 or NaN, so a division by it is harmless), as in
    ``_scales``; ``work`` is scratch of xb's shape. Returns ``s`` as a column."""
    torch.amax(torch.abs(xb, out=work), dim=1, out=s)
    torch.where(s > 0, s, one, out=s)
    return s.unsqueeze(1)


def _scratch(buf: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype, device: torch.device):
    """A (buf, view of shape) pair: buf reused while it is big enough, else a new one."""
    n = math.prod(shape)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype, device=device)
    return buf, buf[:n].view(shape)


def _wire_blocks(e: Encoded, values_per_q: int) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """(numel, blocks it takes, block, q, s) of an int8/int4 tensor, its block read off its parts: q holds
    the codes of whole blocks, one scale each, and they cover the shape."""
    q, s = e.parts["q"].reshape(-1), e.parts["s"].to(torch.float32).reshape(-1)
    n, blocks, values = _numel(e.shape), s.numel(), q.numel() * values_per_q
    block = values // blocks if blocks else 0
    if blocks * block != values or n > values or (n and not block) or block % values_per_q:
        raise ProtocolError(
            RejectCode.WRONG_SHAPE,
            f"{e.codec} parts q{list(e.parts['q'].shape)} s{list(e.parts['s'].shape)} do not fit "
            f"shape {list(e.shape)}",
        )
    return n, (-(-n // block) if n else 0), block, q, s


def _int2_table(device: torch.device) -> torch.Tensor:
    """``_INT2_DECODE`` on ``device``, copied there once (as ``_int4_tables``)."""
    table = _INT2_TABLES.get(device)
    if table is None:
        table = _INT2_TABLES[device] = _INT2_DECODE.to(device)
    return table


def _rms_scales(xb: torch.Tensor, work: torch.Tensor, s: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
    """Each row's RMS into ``s``, computed on the row divided by its max |x| so that no square overflows, at
    most ``_INT2_SCALE_MAX``: 0 for a row of zeros, NaN for one holding a NaN or an inf (its scale then tells
    a receiver the tensor is not finite). ``work`` is scratch of xb's shape. Returns the divisor of each row
    as a column: ``s``, or ``one`` where that is 0 or NaN."""
    a = _piece_scales(xb, work, s, one).clone()  # max |x|, 1 where 0 or NaN
    torch.div(xb, a, out=work).square_()
    torch.mean(work, dim=1, out=s)
    s.sqrt_().mul_(a.squeeze(1)).clamp_(max=_INT2_SCALE_MAX)
    return torch.where(s > 0, s, one).unsqueeze(1)


class Fp32:
    name = "fp32"

    def encode(self, x: torch.Tensor, block: int) -> Encoded:
        # Always a copy, never x itself: callers go on changing their tensors after encoding them.
        v = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x.detach())
        return Encoded(self.name, tuple(x.shape), {"v": v.reshape(-1)})

    def decode(self, e: Encoded) -> torch.Tensor:
        return e.parts["v"].to(torch.float32).reshape(e.shape)

    def error_bound(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return torch.zeros_like(x, dtype=torch.float32)


class Bf16(Fp32):
    name = "bf16"

    def encode(self, x: torch.Tensor, block: int) -> Encoded:
        v = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device).copy_(x.detach())
        return Encoded(self.name, tuple(x.shape), {"v": v.reshape(-1)})

    def error_bound(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return x.detach().abs().to(torch.float32) * 2.0**-8


class Int8:
    name = "int8"

    def encode(self, x: torch.Tensor, block: int) -> Encoded:
        blocks = math.ceil(x.numel() / block)
        q = torch.empty(blocks * block, dtype=torch.int8, device=x.device)
        s = torch.empty(blocks, dtype=torch.float32, device=x.device)
        work, one = None, torch.ones((), device=x.device)
        for b0, xb in _in_pieces(x, block):
            b1 = b0 + xb.shape[0]
            work, w = _scratch(work, xb.shape, torch.float32, x.device)
            sc = _piece_scales(xb, w, s[b0:b1], one)
            # |x / s| <= 1 but in a block holding a NaN (s = 1 there), so the clamp is for those only.
            torch.div(xb, sc, out=w).mul_(127.0).round_().clamp_(-127.0, 127.0)
            q[b0 * block : b1 * block].view(w.shape).copy_(w)
        return Encoded(self.name, tuple(x.shape), {"q": q, "s": s})

    def decode(self, e: Encoded) -> torch.Tensor:
        n, blocks, block, q, s = _wire_blocks(e, 1)
        out = torch.empty(blocks * block, dtype=torch.float32, device=q.device)  # whole blocks, as q
        for b0, o in _out_pieces(out, blocks, block):
            b1 = b0 + o.shape[0]
            o.copy_(q[b0 * block : b1 * block].view(o.shape)).mul_(s[b0:b1].unsqueeze(1)).div_(127.0)
        return out[:n].view(e.shape)

    def error_bound(self, x: torch.Tensor, block: int) -> torch.Tensor:
        b, _ = _blocks(x, block)
        bound = (_scales(b) / 254.0).expand_as(b).reshape(-1)[: x.numel()]
        return bound.reshape(x.shape) * (1 + 1e-6)


class Int4:
    name = "int4"

    def encode(self, x: torch.Tensor, block: int) -> Encoded:
        if block % 2:
            raise ValueError(f"int4 needs an even block size, got {block}")
        blocks = math.ceil(x.numel() / block)
        q = torch.empty(blocks * block // 2, dtype=torch.uint8, device=x.device)
        s = torch.empty(blocks, dtype=torch.float32, device=x.device)
        table, _ = _int4_tables(x.device)
        work = codes = None
        one = torch.ones((), device=x.device)
        for b0, xb in _in_pieces(x, block):
            b1 = b0 + xb.shape[0]
            work, w = _scratch(work, xb.shape, torch.float32, x.device)
            codes, c = _scratch(codes, (xb.numel(),), torch.int16, x.device)
            sc = _piece_scales(xb, w, s[b0:b1], one)
            p = torch.div(xb, sc, out=w).view(-1).view(torch.int32)  # y = x / s, |y| <= 1
            p.sub_(1).bitwise_right_shift_(22).bitwise_and_(0x3FF)  # see _int4_code_table
            torch.index_select(table, 0, p, out=c)
            packed = q[b0 * block // 2 : b1 * block // 2]
            if _LITTLE_ENDIAN:
                torch.bitwise_right_shift(c.view(torch.int32), 12, out=packed)
            else:
                torch.bitwise_or(c[0::2] & 0xF, (c[1::2] & 0xF) << 4, out=packed)
        return Encoded(self.name, tuple(x.shape), {"q": q, "s": s})

    def decode(self, e: Encoded) -> torch.Tensor:
        if e.parts["q"].dtype != torch.uint8:
            raise ProtocolError(RejectCode.WRONG_SHAPE, f"int4 codes must be uint8, got {e.parts['q'].dtype}")
        n, blocks, block, q, s = _wire_blocks(e, 2)
        _, table = _int4_tables(q.device)
        out = torch.empty(blocks * block, dtype=torch.float32, device=q.device)  # whole blocks, as q
        idx = None
        for b0, o in _out_pieces(out, blocks, block):
            b1 = b0 + o.shape[0]
            idx, i = _scratch(idx, (o.numel() // 2,), torch.int32, q.device)
            i.copy_(q[b0 * block // 2 : b1 * block // 2])
            torch.index_select(table, 0, i, out=o.view(-1).view(torch.int64))  # each byte's two values
            o.mul_(s[b0:b1].unsqueeze(1))
        return out[:n].view(e.shape)

    def error_bound(self, x: torch.Tensor, block: int) -> torch.Tensor:
        b, _ = _blocks(x, block)
        floor = (_scales(b) / 128.0).expand_as(b).reshape(-1)[: x.numel()].reshape(x.shape)
        rel = x.detach().abs().to(torch.float32) / 3.0
        return torch.maximum(rel, floor) * (1 + 1e-6)


class Int2:
    name = "int2"

    def encode(self, x: torch.Tensor, block: int) -> Encoded:
        if block % 4:
            raise ValueError(f"int2 needs a block size that is a multiple of 4, got {block}")
        blocks = math.ceil(x.numel() / block)
        q = torch.empty(blocks * block // 4, dtype=torch.uint8, device=x.device)
        s = torch.empty(blocks, dtype=torch.float32, device=x.device)
        work = codes = None
        one = torch.ones((), device=x.device)
        for b0, xb in _in_pieces(x, block):
            b1 = b0 + xb.shape[0]
            work, w = _scratch(work, xb.shape, torch.float32, x.device)
            codes, c = _scratch(codes, xb.shape, torch.uint8, x.device)
            sc = _rms_scales(xb, w, s[b0:b1], one)
            y = torch.div(xb, sc, out=w)
            # the code is how many of the three thresholds y lies above (a tie goes to the lower level)
            torch.gt(y, -_INT2_THRESHOLD, out=c)
            c.add_(y > 0).add_(y > _INT2_THRESHOLD)
            four = c.view(-1, 4)
            packed = q[b0 * block // 4 : b1 * block // 4]
            packed.copy_(four[:, 0]).bitwise_or_(four[:, 1] << 2).bitwise_or_(four[:, 2] << 4)
            packed.bitwise_or_(four[:, 3] << 6)
        return Encoded(self.name, tuple(x.shape), {"q": q, "s": s})

    def decode(self, e: Encoded) -> torch.Tensor:
        if e.parts["q"].dtype != torch.uint8:
            raise ProtocolError(RejectCode.WRONG_SHAPE, f"int2 codes must be uint8, got {e.parts['q'].dtype}")
        n, blocks, block, q, s = _wire_blocks(e, 4)
        table = _int2_table(q.device)
        out = torch.empty(blocks * block, dtype=torch.float32, device=q.device)  # whole blocks, as q
        for b0, o in _out_pieces(out, blocks, block):
            b1 = b0 + o.shape[0]
            codes = q[b0 * block // 4 : b1 * block // 4].to(torch.int64)
            torch.index_select(table, 0, codes, out=o.view(-1, 4))
            o.mul_(s[b0:b1].unsqueeze(1))
        return out[:n].view(e.shape)

    def error_bound(self, x: torch.Tensor, block: int) -> torch.Tensor:
        b, _ = _blocks(x, block)
        a = _scales(b)
        rms = ((b / a).square().mean(dim=1, keepdim=True).sqrt() * a).clamp(max=_INT2_SCALE_MAX)
        s = torch.where(rms > 0, rms, torch.ones_like(rms)).expand_as(b).reshape(-1)[: x.numel()]
        s = s.reshape(x.shape)
        inner = (_INT2_LEVELS[3] - _INT2_LEVELS[2]) / 2 * s
        clipped = x.detach().abs().to(torch.float32) - _INT2_LEVELS[3] * s
        return torch.maximum(inner, clipped) * (1 + 1e-5) + 1e-30


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


CODECS = {c.name: c for c in (Fp32(), Bf16(), Int8(), Int4(), Int2())}


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
    fp32 4 and bf16 2 bytes a value; int8, int4 and int2 1, 1/2 and 1/4 a value over whole blocks, plus one
    fp32 scale a block."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(sorted(CODECS))}")
    if codec in ("fp32", "bf16"):
        return (4 if codec == "fp32" else 2) * numel
    blocks = math.ceil(numel / block)
    return blocks * block // PACKED[codec] + 4 * blocks


def wire_block(e: Encoded) -> int:
    """The values one scale of ``e`` covers (1 for fp32 and bf16): where a range of it may start."""
    if e.codec in ("fp32", "bf16"):
        return 1
    return max(1, _wire_blocks(e, PACKED[e.codec])[2])


def decode_range(e: Encoded, start: int, stop: int) -> torch.Tensor:
    """Values [start, stop) of ``e``, flattened, in fp32: ``decode(e).reshape(-1)[start:stop]`` without
    decoding the rest (``start`` on a block boundary). For fp32 a view of the wire tensor: read it only."""
    if e.codec in ("fp32", "bf16"):
        return e.parts["v"].reshape(-1)[start:stop].to(torch.float32)
    per = PACKED[e.codec]
    _, _, block, q, s = _wire_blocks(e, per)
    if start % block or not 0 <= start <= stop <= _numel(e.shape):
        raise ValueError(f"range [{start}, {stop}) of {list(e.shape)} is not on a block of {block}")
    b0, b1 = start // block, -(-stop // block)
    part = Encoded(e.codec, (stop - start,), {"q": q[b0 * block // per : b1 * block // per], "s": s[b0:b1]})
    return get_codec(e.codec).decode(part)


class Decoded(Mapping):
    """Tensors kept in their wire form and read as fp32: each is decoded when it is looked up, and let go
    by whoever read it (a merged gradient of a large fragment is not held decoded). ``encoded``: the wire
    form itself, for code that reads it a range at a time (``protocol.merge.outer_step``)."""

    def __init__(self, encoded: Mapping[str, Encoded]) -> None:
        self.encoded = dict(encoded)

    def __getitem__(self, name: str) -> torch.Tensor:
        e = self.encoded[name]
        return get_codec(e.codec).decode(e)

    def __iter__(self):
        return iter(self.encoded)

    def __len__(self) -> int:
        return len(self.encoded)


# Values a pass over part of a large tensor covers (4 MiB of fp32): merges, outer steps, checks.
RANGE = 1 << 20


def ranges(numel: int, align: int = 1) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of about ``RANGE`` values covering ``numel``, each starting on a multiple of
    ``align`` (a block of the wire forms read with ``read_range``)."""
    step = max(align, RANGE // align * align)
    for a in range(0, numel, step):
        yield a, min(numel, a + step)


def range_align(*sources: torch.Tensor | Encoded) -> int:
    """The alignment ranges over all of ``sources`` need: a multiple of each wire form's block."""
    return math.lcm(1, *(wire_block(v) for v in sources if isinstance(v, Encoded)))


def read_range(v: torch.Tensor | Encoded, start: int, stop: int) -> torch.Tensor:
    """fp32 values [start, stop) of a tensor (flattened) or of its wire form: read only (may be a view)."""
    if isinstance(v, Encoded):
        return decode_range(v, start, stop)
    return v.detach().reshape(-1)[start:stop].to(torch.float32)


def fresh(v: torch.Tensor | Encoded) -> bool:
    """Whether ``read_range`` of ``v`` makes new tensors (decoded, or converted), which a reader may write."""
    if isinstance(v, Encoded):
        return v.codec not in ("fp32",)
    return v.dtype != torch.float32
