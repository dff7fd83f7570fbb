"""Fuzz targets for what peers send over the RPC transport: contributions, merge records, snapshots, list
frames, small JSON requests and frame headers (``protocol.messages``, ``node.swarm.wire``, ``node.swarm.frames``)."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import struct
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from safetensors.torch import load as st_load

from node.swarm import frames, wire
from node.swarm.trust.audit_archive import parse_kept_request
from protocol.codecs import encode_tensors
from protocol.errors import ProtocolError
from protocol.hashing import tensors_hash
from protocol.messages import (
    ContributionHeader,
    decode_contribution,
    decode_parts,
    encode_contribution,
    peek_fragment,
)
from protocol.replica import MergeRecord
from tests.fuzz.harness import (
    BYTE_MUTATORS,
    SWARM,
    TENSOR_DTYPES,
    Target,
    dumps,
    ident,
    mutate_json,
    mutate_json_bytes,
    mutate_st_header,
    mutate_st_tensors,
    mutate_tensor,
    splicer,
    st_dump,
    st_meta,
)

SPEC = {"a.weight": (8, 6), "a.bias": (6,)}  # the fragment a contribution is decoded against
SPECS = {0: {"w": (4, 3), "b": (3,)}, 1: {"e": (5, 2)}}  # fragments of records and snapshots
MAX_BODY = 1 << 20  # the transport target's payload cap


def _check_grads(grads: dict[str, torch.Tensor], spec: dict[str, tuple[int, ...]]) -> None:
    assert set(grads) == set(spec), f"tensors {sorted(grads)} != {sorted(spec)}"
    for k, t in grads.items():
        assert tuple(t.shape) == tuple(spec[k]) and t.dtype == torch.float32, f"{k}: {t.dtype} {t.shape}"
        assert bool(torch.isfinite(t).all()), f"{k} not finite"


# contributions -------------------------------------------------------------------------------------------
def _header(codec: str) -> ContributionHeader:
    return ContributionHeader("L0", 2, 3, 4, 400, 0.5, codec, 16, "L0:2:9")


@functools.cache
def contribution_seeds() -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    x = {n: torch.randn(*s, generator=g) for n, s in SPEC.items()}
    return [
        encode_contribution(_header(c), encode_tensors(x, c, 16))
        for c in ("fp32", "bf16", "int8", "int4", "int2")
    ]


def _check_contribution(result: tuple[ContributionHeader, dict[str, torch.Tensor]]) -> None:
    h, grads = result
    for k, t in ContributionHeader.__annotations__.items():
        v = getattr(h, k)
        assert type(v).__name__ == t and not isinstance(v, bool), f"header {k}={v!r}"
    assert math.isfinite(h.step_time_s), f"step_time_s={h.step_time_s}"
    _check_grads(grads, SPEC)


ST_MUTATORS = [mutate_st_header, mutate_st_tensors, mutate_st_tensors] + BYTE_MUTATORS

CONTRIBUTION = Target(
    "contribution",
    contribution_seeds,
    lambda raw: decode_contribution(raw, SPEC),
    (ProtocolError,),
    _check_contribution,
    ST_MUTATORS + [splicer(contribution_seeds)],
)


def _check_fragment(p: int) -> None:
    assert type(p) is int, f"fragment {p!r}"


PEEK = Target(
    "peek_fragment", contribution_seeds, peek_fragment, (ProtocolError,), _check_fragment, ST_MUTATORS
)


# decode_parts: (tensors, codec, block) straight from a safetensors load -----------------------------------
@functools.cache
def parts_seeds() -> list[tuple[dict[str, torch.Tensor], str, int]]:
    out = []
    for raw, codec in zip(contribution_seeds(), ("fp32", "bf16", "int8", "int4", "int2")):
        out.append((dict(st_load(raw)), codec, 16))
    return out


def _mutate_parts(rng: random.Random, value: tuple) -> tuple:
    tensors, codec, block = value
    tensors = dict(tensors)
    op = rng.randrange(4)
    if op == 0:
        codec = rng.choice(["fp32", "bf16", "int8", "int4", "int2", "int3", "", "FP32"])
    elif op == 1:
        block = rng.choice([0, -1, 1, 3, 15, 16, 17, 1 << 20, (1 << 20) + 1, 1 << 62])
    elif op == 2 and tensors:
        n = rng.choice(sorted(tensors))
        tensors[n] = mutate_tensor(rng, tensors[n])
    else:
        raw = mutate_st_tensors(rng, st_dump({k: v.contiguous() for k, v in tensors.items()}))
        tensors = dict(st_load(raw))
    return tensors, codec, block


def _arbitrary_parts(rng: random.Random) -> tuple:
    names = [f"{n}::{p}" for n in SPEC for p in rng.sample(["v", "q", "s"], rng.randrange(4))]
    tensors = {
        n: torch.zeros(rng.choice([0, 1, 6, 48, 96]), dtype=rng.choice(TENSOR_DTYPES + [torch.float32]))
        for n in names
    }
    return tensors, rng.choice(["fp32", "bf16", "int8", "int4", "x"]), rng.choice([1, 2, 16, 0, 7])


PARTS = Target(
    "decode_parts",
    parts_seeds,
    lambda v: decode_parts(v[0], v[1], v[2], SPEC),
    (ProtocolError,),
    lambda grads: _check_grads(grads, SPEC),
    [_mutate_parts],
    arbitrary=_arbitrary_parts,
)


# merge records --------------------------------------------------------------------------------------------
@functools.cache
def record_seeds() -> list[bytes]:
    g = torch.Generator().manual_seed(1)
    grad = {k: torch.randn(*s, generator=g) for k, s in SPECS[0].items()}
    contributors = (("peerA", "cid1", 2.5, 8, 2048), ("peerB", "cid2", 1.0, 4, 1024))
    out = [encode_record(MergeRecord(0, 3, "a" * 64, "b" * 64, contributors, grad))]
    for codec in ("int4", "int8"):
        wire_ = encode_tensors(grad, codec, 16)
        out.append(encode_record(MergeRecord(0, 4, "b" * 64, "c" * 64, contributors, grad, codec, 16, wire_)))
    e = {"e": torch.randn(5, 2, generator=g)}
    out.append(encode_record(MergeRecord(1, 1, "0" * 64, "d" * 64, contributors[:1], e)))
    return out


def encode_record(rec: MergeRecord) -> bytes:
    return wire.encode_record(SWARM, rec, ident())


def resign_record(rng: random.Random, raw: bytes) -> bytes:
    """Sign the (mutated) record document and tensors again: what a member with a valid key could send."""
    tensors, meta = dict(st_load(raw)), dict(st_meta(raw))
    sig = ident().sign(wire._signed_bytes(meta["record"], tensors_hash(tensors)))
    meta.update(signer=ident().peer_id, sig=sig.hex())
    return st_dump(tensors, metadata=meta)


def _check_record(sr: wire.SignedRecord) -> None:
    r = sr.record
    assert r.fragment in SPECS and type(r.round) is int and r.round >= 1, (
        f"fragment/round {r.fragment}/{r.round}"
    )
    for c in r.contributors:
        assert math.isfinite(c[2]) and c[2] >= 0, f"contributor weight {c[2]}"
    assert math.isfinite(sr.total_weight)
    _check_grads(r.grad, SPECS[r.fragment])


RECORD = Target(
    "record",
    record_seeds,
    lambda raw: wire.decode_record(raw, SWARM, SPECS),
    (ProtocolError,),
    _check_record,
    ST_MUTATORS + [splicer(record_seeds)],
    finish=resign_record,
)


# snapshots ------------------------------------------------------------------------------------------------
@functools.cache
def snapshot_seeds() -> list[bytes]:
    g = torch.Generator().manual_seed(2)
    states = []
    for p, spec in SPECS.items():
        theta = {k: torch.randn(*s, generator=g) for k, s in spec.items()}
        mom = {k: torch.randn(*s, generator=g) for k, s in spec.items()}
        states.append(wire.FragmentState(p, 4 + p, tensors_hash(theta), 2, 3.5, theta, mom, 999))
    return [wire.encode_snapshot(states), wire.encode_snapshot(states[1:])]


def rehash_snapshot(rng: random.Random, raw: bytes) -> bytes:
    """Make every head claim the hash of the (mutated) tensors, so the checks behind the hash run."""
    tensors, meta = dict(st_load(raw)), dict(st_meta(raw))
    heads = json.loads(meta["heads"])
    for p, h in heads.items():
        theta = {k.split("/", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{p}/theta/")}
        h[1] = tensors_hash(theta)
    meta["heads"] = dumps(heads)
    return st_dump(tensors, metadata=meta)


def _check_snapshot(states: list[wire.FragmentState]) -> None:
    for s in states:
        assert s.fragment in SPECS, f"fragment {s.fragment}"
        assert s.round >= 0 and s.n >= 0 and s.tokens >= 0, f"head {s.round} {s.n} {s.tokens}"
        assert math.isfinite(s.weight) and s.weight >= 0, f"weight {s.weight}"
        assert tensors_hash(s.theta) == s.hash
        for group in (s.theta, s.momentum):
            _check_grads(group, SPECS[s.fragment])


SNAPSHOT = Target(
    "snapshot",
    snapshot_seeds,
    lambda raw: wire.decode_snapshot(raw, SPECS),
    (ProtocolError,),
    _check_snapshot,
    ST_MUTATORS + [splicer(snapshot_seeds)],
    finish=rehash_snapshot,
)


# list frames ----------------------------------------------------------------------------------------------
@functools.cache
def list_seeds() -> list[bytes]:
    return [
        wire.pack_list([b"{}", contribution_seeds()[0][:200]]),
        wire.pack_list([]),
        wire.pack_list([b""] * 5),
    ]


def _check_list(items: list[bytes]) -> None:
    assert all(isinstance(x, bytes) for x in items)


LIST = Target(
    "list_frame",
    list_seeds,
    lambda raw: wire.unpack_list(raw, max_items=1024),
    (ProtocolError,),
    _check_list,
    BYTE_MUTATORS + [splicer(list_seeds)],
)


# small JSON requests and the contribute envelope (node.wire) ----------------------------------------------
def _json_target(name: str, seeds: list[dict], parse: Callable[[bytes], Any]) -> Target:
    raws = [json.dumps(d).encode() for d in seeds]
    return Target(
        name, lambda: raws, parse, (ProtocolError,), lambda v: None, [mutate_json_bytes] * 4 + BYTE_MUTATORS
    )


def _check_types(value: Any, kind: type) -> None:
    assert all(type(x) is kind for x in value), f"{value!r:.80}"


RECORDS_REQUEST = replace(
    _json_target("records_request", [{"fragment": 0, "from": 3}], wire.parse_records_request),
    check=lambda v: _check_types(v, int),
)
SNAPSHOT_REQUEST = replace(
    _json_target("snapshot_request", [{"fragments": [0, 1]}, {"fragments": []}], wire.parse_snapshot_request),
    check=lambda v: _check_types(v, int),
)
KEPT_REQUEST = replace(
    _json_target("kept_request", [{"digests": ["ab" * 32, "0" * 64]}, {"digests": []}], parse_kept_request),
    check=lambda v: _check_types(v, str),
)
REDIRECT = replace(
    _json_target("redirect", [{"try": ident().peer_id}, {"try": None}], wire.parse_redirect),
    check=lambda v: None if v is None else _check_types([v], str),
)


@functools.cache
def envelope_seeds() -> list[bytes]:
    route = json.dumps({"dead": [ident().peer_id]}).encode()
    return [wire.pack_list([route, contribution_seeds()[3]]), wire.pack_list([b'{"dead": []}', b""])]


def mutate_envelope(rng: random.Random, raw: bytes) -> bytes:
    route, msg = wire.unpack_list(raw)
    if rng.random() < 0.5:
        route = mutate_json_bytes(rng, route)
    else:
        msg = rng.choice(CONTRIBUTION.mutators)(rng, msg)
    return wire.pack_list(rng.choice([[route, msg], [route], [route, msg, msg], [msg, route]]))


def _check_envelope(result: tuple[set[str], bytes, bytes]) -> None:
    dead, msg, sig = result
    _check_types(dead, str)
    assert isinstance(msg, bytes) and isinstance(sig, bytes)


ENVELOPE = Target(
    "contribute_envelope",
    envelope_seeds,
    wire.unpack_signed_contribution,
    (ProtocolError,),
    _check_envelope,
    [mutate_envelope] * 4 + BYTE_MUTATORS,
)


# transport frames -----------------------------------------------------------------------------------------
def frame(header: dict, body: bytes) -> bytes:
    raw = json.dumps({**header, "nbytes": len(body)}).encode()
    return struct.pack("<I", len(raw)) + raw + body


@functools.cache
def frame_seeds() -> list[bytes]:
    return [
        frame({"op": "contribute"}, b"x" * 100),
        frame({"ok": False, "code": "malformed", "message": "no"}, b""),
        frame({"ok": True, "code": "ok", "message": ""}, b"\x00" * 10),
    ]


def mutate_frame_json(rng: random.Random, raw: bytes) -> bytes:
    n = struct.unpack("<I", raw[:4])[0]
    text = dumps(mutate_json(rng, json.loads(raw[4 : 4 + n]))).encode("utf-8", "surrogatepass")
    fix = rng.random() < 0.7  # keep the prefix consistent so the JSON itself is parsed
    return struct.pack("<I", len(text) if fix else n) + text + raw[4 + n :]


_loop: asyncio.AbstractEventLoop | None = None


def read_frame(raw: bytes) -> tuple[dict, bytes]:
    """Read one frame with the transport's own reader from a stream that holds ``raw`` and then ends."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()

    async def go() -> tuple[dict, bytes]:
        r = asyncio.StreamReader()
        r.feed_data(raw)
        r.feed_eof()
        return await frames.read_frame(r, MAX_BODY)

    return _loop.run_until_complete(go())


def _check_frame(result: tuple[dict, bytes]) -> None:
    header, body = result
    assert isinstance(header, dict) and header["nbytes"] == len(body) <= MAX_BODY


FRAME = Target(
    "transport_frame",
    frame_seeds,
    read_frame,
    (ProtocolError, asyncio.IncompleteReadError),  # refused, or the stream ended before the frame did
    _check_frame,
    [mutate_frame_json] * 4 + BYTE_MUTATORS + [splicer(frame_seeds)],
)
