"""Fuzzing harness: what a fuzzed input is, how one is made from a valid seed, and what counts as a crash.

Shared by ``tests/test_fuzz.py`` (hypothesis, a few hundred inputs a decoder) and ``bench/fuzz.py`` (the
long run, 10,000 a message type); the targets themselves are in this package's other modules. A ``Target``
names a decoder, builds valid seeds with the matching encoder, and produces inputs two ways: arbitrary
ones (``arbitrary``), and structure-aware mutations of a seed (``mutate``): bit flips, truncation, splices,
boundary integers in length fields, edits of the safetensors header (dtypes, shapes, offsets, names), JSON
fields set to wrong types, huge or negative numbers, NaN, deep nesting, and tensors re-saved with other
dtypes, shapes or NaN — then, for half of them, re-signed or re-hashed (``finish``) so the mutation reaches
the checks behind the signature or the hash.

The contract ``outcome`` checks: for any input a decoder returns a value that passes ``check`` or raises one
of ``refusals`` with a non-empty message. Anything else (another exception type, an invariant broken by an
accepted value) is a crash.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dht.identity import Identity
from protocol.errors import ProtocolError

SWARM = "fuzz-swarm"
NOW = 1_000_000.0
MAX_MESSAGE = 2000  # characters in a refusal's message  # the "now" records and certificates are judged at


@functools.cache
def ident() -> Identity:
    """The one key seeds are signed with (and mutated inputs re-signed with). Fixed, so that the same
    hypothesis example or bench seed makes the same bytes in every process."""
    return Identity(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))


# ------------------------------------------------------------------------------ outcomes
@dataclass
class Outcome:
    kind: str  # "accepted", "refused" or "crash"
    label: str = ""  # accepted: the target's description; refusal: its code or type; crash: what went wrong
    error: BaseException | None = None
    reason: str = ""  # refusal: the cause in a few words (the code, or a phrase of the typed error's message)


def refusal_label(e: BaseException) -> str:
    return e.code.value if isinstance(e, ProtocolError) else type(e).__name__


def outcome(target: Target, value: Any) -> Outcome:
    """Run the decoder on ``value`` and judge the result against the target's contract."""
    try:
        result = target.decode(value)
    except target.refusals as e:
        if not str(e).strip():
            return Outcome("crash", f"{type(e).__name__} without a message", e)
        if len(str(e)) > MAX_MESSAGE:  # refusals are logged and sent back: they must not echo the input
            return Outcome("crash", f"{type(e).__name__} message of {len(str(e))} characters", e)
        label = refusal_label(e)
        reason = next((r for r in target.reasons if r in str(e)), label)
        return Outcome("refused", label, e, reason)
    except Exception as e:  # the point of fuzzing: anything else is a finding
        return Outcome("crash", type(e).__name__, e)
    try:
        target.check(result)
    except Exception as e:  # noqa: BLE001 - an accepted value that breaks an invariant, however it shows
        return Outcome("crash", f"invariant: {type(e).__name__}: {e}"[:300], e)
    return Outcome("accepted", target.describe(result))


# ------------------------------------------------------------------------------ generic byte mutations
SPECIAL = [b"\x00", b"\xff", b'"', b"{", b"}", b"[", b"]", b"\\", b"\xc3", b"\xed\xa0\x80", b"NaN", b"-1"]
BOUNDARY = [0, 1, 7, 8, 255, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 40, 1 << 63, (1 << 64) - 1]


def _span(rng: random.Random, n: int) -> tuple[int, int]:
    i = rng.randrange(n + 1)
    return i, min(n, i + rng.choice([1, 2, 4, 8, 64, 1024]))


def flip_bits(rng: random.Random, raw: bytes) -> bytes:
    if not raw:
        return raw
    b = bytearray(raw)
    for _ in range(rng.choice([1, 1, 2, 8])):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def truncate(rng: random.Random, raw: bytes) -> bytes:
    return raw[: rng.randrange(len(raw) + 1)]


def extend(rng: random.Random, raw: bytes) -> bytes:
    return raw + rng.randbytes(rng.choice([1, 8, 100]))


def overwrite(rng: random.Random, raw: bytes) -> bytes:
    i, j = _span(rng, len(raw))
    return raw[:i] + rng.randbytes(j - i) + raw[j:]


def insert_token(rng: random.Random, raw: bytes) -> bytes:
    i = rng.randrange(len(raw) + 1)
    return raw[:i] + rng.choice(SPECIAL) * rng.choice([1, 1, 3, 1000]) + raw[i:]


def delete_span(rng: random.Random, raw: bytes) -> bytes:
    i, j = _span(rng, len(raw))
    return raw[:i] + raw[j:]


def duplicate_span(rng: random.Random, raw: bytes) -> bytes:
    i, j = _span(rng, len(raw))
    return raw[:j] + raw[i:j] + raw[j:]


def set_length(rng: random.Random, raw: bytes) -> bytes:
    """A boundary value written over a little-endian length field (the prefix, or anywhere)."""
    width = rng.choice([4, 8])
    at = 0 if rng.random() < 0.6 else rng.randrange(max(1, len(raw)))
    v = rng.choice(BOUNDARY + [len(raw), len(raw) - width, len(raw) + 1]) % (1 << (8 * width))
    return raw[:at] + max(v, 0).to_bytes(width, "little") + raw[at + width :]


BYTE_MUTATORS = [
    flip_bits,
    truncate,
    extend,
    overwrite,
    insert_token,
    delete_span,
    duplicate_span,
    set_length,
]


# ------------------------------------------------------------------------------ JSON mutations
DEEP, BIGINT, BIGFLOAT = "\x00deep", "\x00bigint", "\x00bigfloat"  # spliced in as raw JSON text
EVIL: list[Any] = [
    None, True, False, 0, -1, 1, 2, 1 << 31, 1 << 63, (1 << 64) + 1, -(1 << 63), 10**300,
    1e308, -1e308, float("nan"), float("inf"), float("-inf"), -0.0, 0.5,
    "", "x", "0", "NaN", "\ud800", "a" * 5000, [], [1, "x"], [[0]] * 3, {}, {"a": 1},
    DEEP, BIGINT, BIGFLOAT,
]  # fmt: skip
_RAW_JSON = {DEEP: "[" * 5000 + "]" * 5000, BIGINT: "9" * 5000, BIGFLOAT: "1e999"}


def dumps(doc: Any, **kw: Any) -> str:
    text = json.dumps(doc, **kw)
    for token, raw in _RAW_JSON.items():
        text = text.replace(json.dumps(token), raw)
    return text


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:16]):
            out += _paths(v, (*prefix, i))
    return out


def mutate_json(rng: random.Random, doc: Any) -> Any:
    """One edit at a random place in a JSON document: a wrong-typed or extreme value, a deleted or added
    key, a number nudged by one, a list grown or emptied."""
    doc = copy.deepcopy(doc)
    path = rng.choice(_paths(doc))
    if not path:
        return rng.choice(EVIL)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key, old = path[-1], parent[path[-1]]
    op = rng.randrange(6)
    if op == 0 and isinstance(parent, dict):
        del parent[key]
    elif op == 1 and isinstance(parent, dict):
        parent[rng.choice(["x", "", key + "_", "__metadata__"])] = rng.choice(EVIL)
    elif op == 2 and isinstance(old, int | float) and not isinstance(old, bool):
        parent[key] = old + rng.choice([-1, 1, -(1 << 40), 0.5])
    elif op == 3 and isinstance(old, list):
        parent[key] = old * rng.choice([0, 2, 100])
    else:
        parent[key] = rng.choice(EVIL)
    return doc


# ------------------------------------------------------------------------------ safetensors mutations
def st_split(raw: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def st_join(header_text: str, data: bytes) -> bytes:
    b = header_text.encode("utf-8", "surrogatepass")
    b += b" " * (-len(b) % 8)
    return struct.pack("<Q", len(b)) + b + data


def st_dump(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """``safetensors.torch.save`` with its header's keys in sorted order. safetensors writes the metadata
    from a Rust hash map, whose order changes from call to call: the same example then made different
    bytes the second time, and hypothesis stopped with FlakyStrategyDefinition (CI at stop 27)."""
    header, data = st_split(st_save(tensors, metadata=metadata))
    return st_join(json.dumps(header, separators=(",", ":"), sort_keys=True), data)


def st_meta(raw: bytes) -> dict[str, str]:
    return st_split(raw)[0].get("__metadata__") or {}


def mutate_meta_value(rng: random.Random, value: str) -> str:
    """A metadata string: mutate the JSON inside it when it holds JSON, else replace it."""
    try:
        doc = json.loads(value)
    except ValueError:
        return rng.choice(["", "x", "00" * 64, value[::-1], value * 2])
    return dumps(mutate_json(rng, doc))


def mutate_st_header(rng: random.Random, raw: bytes) -> bytes:
    """Edit the safetensors JSON header in place: a tensor entry's dtype, shape, offsets or name, or the
    JSON inside a metadata value. The container may no longer be valid; that is the point."""
    header, data = st_split(raw)
    meta = header.get("__metadata__") or {}
    if meta and rng.random() < 0.5:
        k = rng.choice(sorted(meta))
        meta[k] = mutate_meta_value(rng, meta[k])
    else:
        names = sorted(k for k in header if k != "__metadata__")
        if names and rng.random() < 0.7:
            entry = header[rng.choice(names)]
            field_ = rng.choice(["dtype", "shape", "data_offsets"])
            if field_ == "dtype":
                entry["dtype"] = rng.choice(["F16", "BF16", "F64", "I8", "U8", "I64", "BOOL", "F8_E4M3", "X"])
            elif field_ == "shape":
                entry["shape"] = rng.choice([[], [0], [1 << 40], [-1], [3, 3, 3], entry["shape"] + [1]])
            else:
                a, b = entry["data_offsets"]
                entry["data_offsets"] = rng.choice([[b, a], [a, b + 4], [a, 1 << 62], [0, 0]])
        else:
            header = mutate_json(rng, header)
    return st_join(dumps(header, separators=(",", ":")), data)


TENSOR_DTYPES = [
    torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64,
    torch.uint16, torch.float8_e4m3fn, torch.complex64, torch.bool,
]  # fmt: skip


def mutate_tensor(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    op = rng.randrange(6)
    if op == 0:
        return t.to(rng.choice(TENSOR_DTYPES))
    if op == 1:
        return t.reshape(-1)[: max(0, t.numel() - rng.choice([1, t.numel()]))].clone()
    if op == 2:
        return torch.cat([t.reshape(-1), t.reshape(-1)[:1]]) if t.numel() else torch.zeros(3, dtype=t.dtype)
    if op == 3 and t.dim() >= 1:
        return t.unsqueeze(0)
    if op == 4 and t.is_floating_point() and t.numel():
        u = t.clone()
        u.reshape(-1)[rng.randrange(u.numel())] = rng.choice([float("nan"), float("inf"), -3e38])
        return u
    return torch.zeros(0, dtype=t.dtype)


def mutate_st_tensors(rng: random.Random, raw: bytes) -> bytes:
    """A valid safetensors blob again, with one tensor changed (dtype, length, rank, NaN), dropped, added
    or renamed, or a metadata value's JSON mutated."""
    tensors, meta = dict(st_load(raw)), dict(st_meta(raw))
    names = sorted(tensors)
    op = rng.randrange(5)
    if op == 0 and names:
        n = rng.choice(names)
        tensors[n] = mutate_tensor(rng, tensors[n])
    elif op == 1 and names:
        del tensors[rng.choice(names)]
    elif op == 2:
        tensors[rng.choice(names + ["x", "w::v", "0/theta/w"]) + rng.choice(["", "::q", "/"])] = torch.ones(3)
    elif op == 3 and names:
        n = rng.choice(names)
        tensors[n.replace("w", "v", 1).replace("e", "f", 1) or "x"] = tensors.pop(n)
    elif meta:
        k = rng.choice(sorted(meta))
        meta[k] = mutate_meta_value(rng, meta[k])
    return st_dump({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)


def splicer(seeds: Callable[[], list[bytes]]) -> Callable[[random.Random, bytes], bytes]:
    def splice(rng: random.Random, raw: bytes) -> bytes:
        other = rng.choice(seeds())
        return raw[: rng.randrange(len(raw) + 1)] + other[rng.randrange(len(other) + 1) :]

    return splice


# ------------------------------------------------------------------------------ targets
@dataclass(frozen=True)
class Target:
    name: str
    seeds: Callable[[], list[Any]]
    decode: Callable[[Any], Any]
    refusals: tuple[type[BaseException], ...]
    check: Callable[[Any], None] = lambda result: None
    mutators: list[Callable[[random.Random, Any], Any]] = field(default_factory=list)
    finish: Callable[[random.Random, Any], Any] | None = None  # re-sign / re-hash a mutated input
    arbitrary: Callable[[random.Random], Any] = lambda rng: rng.randbytes(
        rng.choice([0, 4, 8, 40, 300, 3000])
    )
    reasons: tuple[str, ...] = ()  # phrases of the typed error's messages that name a cause, for reports
    describe: Callable[[Any], str] = lambda result: "accepted"  # what an accepted value was, for reports

    def mutate(self, rng: random.Random, value: Any) -> Any:
        """1-3 mutations of ``value``; a structure-aware mutator that cannot parse its input (an earlier
        mutation broke it) leaves it to a byte-level one."""
        ops = self.mutators or BYTE_MUTATORS
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            op = rng.choice(ops)
            try:
                value = op(rng, value)
            except Exception:  # noqa: BLE001 - the mutator's own parse failed
                if isinstance(value, bytes):
                    fallback = rng.choice(BYTE_MUTATORS)
                    with contextlib.suppress(Exception):  # some byte mutators parse the header too
                        value = fallback(rng, value)
        if self.finish is not None and rng.random() < 0.5:
            try:
                value = self.finish(rng, value)
            except Exception:  # noqa: BLE001 - nothing to re-sign
                pass
        return value

    def sample(self, rng: random.Random) -> Any:
        """One fuzzed input: a quarter arbitrary, the rest mutated seeds."""
        if rng.random() < 0.25:
            return self.arbitrary(rng)
        return self.mutate(rng, rng.choice(self.seeds()))


def mutate_json_bytes(rng: random.Random, raw: bytes) -> bytes:
    """A JSON document given as bytes, with one ``mutate_json`` edit."""
    return dumps(mutate_json(rng, json.loads(raw))).encode("utf-8", "surrogatepass")
