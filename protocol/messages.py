"""Contribution messages on the wire: a JSON header plus the codec's tensors, as one safetensors blob.

``encode_contribution`` packs what a learner sends; ``decode_contribution`` is the only way in, and checks
everything before a tensor reaches the synchroniser: total size, that the blob parses, header fields and
types, tensor names against the fragment, declared shapes, each part's dtype and element count for its
codec and block size, and finiteness after decoding. Any failure raises ``ProtocolError`` with its code.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from protocol.codecs import CODECS, PACKED, TOP_LEVEL, Encoded, get_codec, range_align, ranges, read_range
from protocol.errors import ProtocolError, RejectCode

MAX_MESSAGE_BYTES = 256 * 1024 * 1024

_PART_DTYPES = {
    "fp32": {"v": torch.float32},
    "bf16": {"v": torch.bfloat16},
    "int8": {"q": torch.int8, "s": torch.float32},
    "int4": {"q": torch.uint8, "s": torch.float32},
    "int2": {"q": torch.uint8, "s": torch.float32},
}


CID_PEER_CHARS = 10  # a contribution id names its sender by the last this many characters of its peer id


def contribution_id(peer_id: str, fragment: int, step: int, t: float) -> str:
    """A contribution's id: who, which fragment, the step, and the moment the step ended in ms, which makes
    ids unique and growing through a node's lives (``node.swarm.sender.OwnCids``)."""
    return f"{sender_tag(peer_id)}:{fragment}:{step}:{int(t * 1000)}"


def sender_tag(peer_id: str) -> str:
    """How a contribution id names its sender: the last ``CID_PEER_CHARS`` characters of its peer id."""
    return peer_id[-CID_PEER_CHARS:]


def cid_moment(cid: str) -> int | None:
    """The moment (ms on its sender's wall clock) a contribution id ends with; None where it names none."""
    try:
        return int(cid.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def cid_sender(cid: str) -> str:
    """The sender a contribution id names (``sender_tag``)."""
    return cid.split(":", 1)[0]


@dataclass(frozen=True)
class ContributionHeader:
    learner: str
    fragment: int
    base_round: int
    c_steps: int
    c_tokens: int
    step_time_s: float
    codec: str
    block: int
    cid: str


_HEADER_FIELDS = typing.get_type_hints(ContributionHeader)


def encode_contribution(h: ContributionHeader, encoded: dict[str, Encoded]) -> bytes:
    shapes = {}
    for name, e in encoded.items():
        if e.codec != h.codec:
            raise ValueError(f"tensor {name} encoded with {e.codec}, header says {h.codec}")
        shapes[name] = list(e.shape)
    tensors = encoded_parts(encoded)
    meta = {"header": json.dumps(vars(h)), "shapes": json.dumps(shapes)}
    return st_save(tensors, metadata=meta)


def _short(x: object) -> str:
    """A value from the wire, for an error message: its repr, cut to 80 characters (a refusal is logged and
    sent back, so it must not echo a megabyte the sender chose)."""
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def _part_sizes(codec: str, numel: int, block: int) -> dict[str, int]:
    if codec in ("fp32", "bf16"):
        return {"v": numel}
    blocks = math.ceil(numel / block)
    return {"q": blocks * block // PACKED[codec], "s": blocks}


def _metadata(raw: bytes) -> dict:
    # safetensors layout: u64 little-endian header length, then the JSON header.
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]).get("__metadata__") or {}


def decode_contribution(
    raw: bytes, spec: dict[str, tuple[int, ...]], max_bytes: int = MAX_MESSAGE_BYTES, decode: bool = True
) -> tuple[ContributionHeader, dict[str, torch.Tensor] | dict[str, Encoded]]:
    """Validate and decode. ``spec`` maps the fragment's tensor names to their shapes. ``decode=False``: the
    tensors stay in their wire form (``Encoded``), checked for everything but finiteness, which the
    caller's check of their values (``FragmentReplica.check_delta``) makes as it decodes them one by one."""
    if len(raw) > max_bytes:
        raise ProtocolError(RejectCode.TOO_LARGE, f"message of {len(raw)} bytes exceeds {max_bytes}")
    try:
        tensors = st_load(raw)
        meta = _metadata(raw)
        hdr = json.loads(meta["header"])
        shapes = json.loads(meta["shapes"])
    except Exception as e:  # safetensors raises several types for garbage; all mean the same here
        raise ProtocolError(
            RejectCode.MALFORMED, f"not a contribution message: {type(e).__name__}: {str(e)[:200]}"
        ) from e
    if not isinstance(hdr, dict) or set(hdr) != set(_HEADER_FIELDS):
        raise ProtocolError(
            RejectCode.MALFORMED,
            f"header fields {_short(sorted(hdr) if isinstance(hdr, dict) else hdr)} != {sorted(_HEADER_FIELDS)}",
        )
    for k, t in _HEADER_FIELDS.items():
        v = hdr[k]
        if t is float and isinstance(v, int) and not isinstance(v, bool):
            hdr[k] = v = float(v)
        if not isinstance(v, t) or isinstance(v, bool):
            raise ProtocolError(RejectCode.MALFORMED, f"header field {k}={_short(v)} is not {t.__name__}")
    h = ContributionHeader(**hdr)
    _check_counters(h)
    _check_codec(h.codec, h.block)
    if not isinstance(shapes, dict) or set(shapes) != set(spec):
        raise ProtocolError(
            RejectCode.WRONG_SHAPE,
            f"tensors {_short(sorted(shapes) if isinstance(shapes, dict) else '?')} != fragment's {sorted(spec)}",
        )
    for name, shape in spec.items():
        declared = shapes[name]
        if not (
            isinstance(declared, list) and all(type(d) is int for d in declared) and declared == list(shape)
        ):
            raise ProtocolError(RejectCode.WRONG_SHAPE, f"{name}: shape {_short(declared)} != {list(shape)}")
    if not decode:
        return h, wire_parts(tensors, h.codec, h.block, spec)
    return h, decode_parts(tensors, h.codec, h.block, spec)


def _check_counters(h: ContributionHeader) -> None:
    """Rounds and counters a contribution cannot have: a negative base round (there is no round before 0; one
    that got past the decoder would be taken into a merge whose base no replica holds), negative step or
    token counts, and a step time that is negative or not finite."""
    if h.base_round < 0:
        raise ProtocolError(RejectCode.MALFORMED, f"base_round={h.base_round} is negative")
    if h.c_steps < 0 or h.c_tokens < 0:
        raise ProtocolError(
            RejectCode.BAD_COUNTERS, f"c_steps={h.c_steps} c_tokens={h.c_tokens} must not be negative"
        )
    if not (math.isfinite(h.step_time_s) and h.step_time_s >= 0):
        raise ProtocolError(
            RejectCode.BAD_COUNTERS, f"step_time_s={h.step_time_s} is not a finite, non-negative duration"
        )


def _check_codec(codec: object, block: object) -> None:
    if not isinstance(codec, str) or codec not in CODECS:
        raise ProtocolError(RejectCode.UNKNOWN_CODEC, f"unknown codec {_short(codec)}")
    if type(block) is not int or not 1 <= block <= 1 << 20 or block % PACKED.get(codec, 1):
        raise ProtocolError(RejectCode.MALFORMED, f"block={_short(block)} is not valid for {codec}")


def decode_parts(
    tensors: dict[str, torch.Tensor], codec: str, block: int, spec: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Decode a codec's wire tensors, named ``NAME::PART``, into fp32 tensors of the shapes in ``spec``.

    Checks what ``wire_parts`` checks, and finiteness after decoding; raises ProtocolError otherwise."""
    out = {}
    for name, e in wire_parts(tensors, codec, block, spec).items():
        d = get_codec(codec).decode(e)
        if not torch.isfinite(d).all():
            raise ProtocolError(RejectCode.NOT_FINITE, f"{name} contains NaN or inf")
        out[name] = d
    return out


def all_finite(e: Encoded) -> bool:
    """Whether every value of ``e`` decodes finite. An int8, int4 or int2 value is a code of bounded size
    times its block's scale (``TOP_LEVEL``), as the decode multiplies them: the scales tell, without a
    decode. Other forms are decoded a range at a time."""
    if e.codec in TOP_LEVEL:
        s = e.parts["s"].to(torch.float32)
        if not bool(torch.isfinite(s).all()):
            return False
        return s.numel() == 0 or bool(torch.isfinite(s.abs().max() * TOP_LEVEL[e.codec]))
    return all(
        bool(torch.isfinite(read_range(e, a, b)).all()) for a, b in ranges(math.prod(e.shape), range_align(e))
    )


def finite_parts(
    tensors: dict[str, torch.Tensor], codec: str, block: int, spec: dict[str, tuple[int, ...]]
) -> dict[str, Encoded]:
    """``wire_parts``, and finite once decoded (``all_finite``: from the scales, or a range at a time):
    nothing is kept decoded (a merged gradient of a large fragment is read a range at a time where applied)."""
    out = wire_parts(tensors, codec, block, spec)
    for name, e in out.items():
        if not all_finite(e):
            raise ProtocolError(RejectCode.NOT_FINITE, f"{name} contains NaN or inf")
    return out


def wire_parts(
    tensors: dict[str, torch.Tensor], codec: str, block: int, spec: dict[str, tuple[int, ...]]
) -> dict[str, Encoded]:
    """A codec's wire tensors, named ``NAME::PART``, as one ``Encoded`` per tensor of ``spec``, undecoded.

    Checks the codec, the block size, that exactly the expected parts are present, and each part's dtype and
    element count; raises ProtocolError otherwise."""
    _check_codec(codec, block)
    want_parts = _PART_DTYPES[codec]
    expected_keys = {f"{n}::{p}" for n in spec for p in want_parts}
    if set(tensors) != expected_keys:
        raise ProtocolError(
            RejectCode.WRONG_SHAPE, f"parts {sorted(tensors)[:6]}... != {sorted(expected_keys)[:6]}..."
        )
    out = {}
    for name, shape in spec.items():
        numel = math.prod(shape)
        parts = {}
        for part, dtype in want_parts.items():
            t = tensors[f"{name}::{part}"]
            if t.dtype != dtype or t.dim() != 1 or t.numel() != _part_sizes(codec, numel, block)[part]:
                raise ProtocolError(
                    RejectCode.WRONG_SHAPE,
                    f"{name}::{part}: {t.dtype} x {tuple(t.shape)} does not "
                    f"fit {codec} block {block} for shape {list(shape)}",
                )
            parts[part] = t
        out[name] = Encoded(codec, tuple(shape), parts)
    return out


def encoded_parts(encoded: dict[str, Encoded]) -> dict[str, torch.Tensor]:
    """The flat ``NAME::PART`` tensors that carry ``encoded`` on the wire (the inverse of decode_parts)."""
    return {f"{name}::{part}": t.contiguous() for name, e in encoded.items() for part, t in e.parts.items()}


def peek_fragment(raw: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """The fragment a contribution names, read from its header before the full decode (which needs the
    fragment's tensor spec). Raises ProtocolError(MALFORMED) for anything that is not a contribution."""
    if len(raw) > max_bytes:
        raise ProtocolError(RejectCode.TOO_LARGE, f"message of {len(raw)} bytes exceeds {max_bytes}")
    try:
        p = json.loads(_metadata(raw)["header"])["fragment"]
    except Exception as e:  # garbage of any shape
        raise ProtocolError(
            RejectCode.MALFORMED, f"not a contribution message: {type(e).__name__}: {str(e)[:200]}"
        ) from e
    if type(p) is not int:
        raise ProtocolError(RejectCode.MALFORMED, f"header field fragment={_short(p)} is not int")
    return p
