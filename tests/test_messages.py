"""Contribution messages: round trip, and every kind of bad message refused with its code (fuzzed too)."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codecs import encode_tensors
from protocol.errors import ProtocolError, RejectCode
from protocol.messages import ContributionHeader, decode_contribution, encode_contribution

SPEC = {"a.weight": (8, 6), "a.bias": (6,)}


def tensors(scale=1.0):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(*s, generator=g) * scale for n, s in SPEC.items()}


def header(codec="int4", **kw):
    base = dict(
        learner="L0",
        fragment=2,
        base_round=3,
        c_steps=4,
        c_tokens=400,
        step_time_s=0.5,
        codec=codec,
        block=16,
        cid="L0:2:9",
    )
    return ContributionHeader(**{**base, **kw})


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
def test_round_trip(codec):
    x = tensors()
    raw = encode_contribution(header(codec), encode_tensors(x, codec, 16))
    h, out = decode_contribution(raw, SPEC)
    assert h == header(codec)
    for n in SPEC:
        assert out[n].shape == x[n].shape
        if codec == "fp32":
            assert torch.equal(out[n], x[n])


def code_of(raw, spec=SPEC, **kw):
    with pytest.raises(ProtocolError) as e:
        decode_contribution(raw, spec, **kw)
    return e.value.code


def test_each_bad_message_has_its_code():
    good = encode_contribution(header("fp32"), encode_tensors(tensors(), "fp32", 16))
    assert code_of(good, max_bytes=100) is RejectCode.TOO_LARGE
    assert code_of(b"garbage") is RejectCode.MALFORMED
    assert code_of(good[: len(good) // 2]) is RejectCode.MALFORMED
    assert code_of(good, spec={"a.weight": (8, 6)}) is RejectCode.WRONG_SHAPE
    assert code_of(good, spec={"a.weight": (6, 8), "a.bias": (6,)}) is RejectCode.WRONG_SHAPE
    nan = tensors()
    nan["a.bias"][2] = float("nan")
    assert (
        code_of(encode_contribution(header("fp32"), encode_tensors(nan, "fp32", 16))) is RejectCode.NOT_FINITE
    )
    inf = tensors()
    inf["a.weight"][0, 0] = float("inf")
    assert (
        code_of(encode_contribution(header("int8"), encode_tensors(inf, "int8", 16))) is RejectCode.NOT_FINITE
    )
    # a wrong dtype for the codec's part
    enc = encode_tensors(tensors(), "fp32", 16)
    bad = {n: type(e)(e.codec, e.shape, {"v": e.parts["v"].double()}) for n, e in enc.items()}
    assert code_of(encode_contribution(header("fp32"), bad)) is RejectCode.WRONG_SHAPE


def test_header_tampering():
    from safetensors.torch import save

    enc = encode_tensors(tensors(), "fp32", 16)
    parts = {f"{n}::v": e.parts["v"] for n, e in enc.items()}
    shapes = json.dumps({n: list(s) for n, s in SPEC.items()})
    for hdr, code in [
        ({**vars(header("fp32")), "c_steps": "4"}, RejectCode.MALFORMED),
        ({**vars(header("fp32")), "extra": 1}, RejectCode.MALFORMED),
        ({**vars(header("fp32")), "codec": "int3"}, RejectCode.UNKNOWN_CODEC),
        ({**vars(header("int4")), "block": 3}, RejectCode.MALFORMED),
    ]:
        raw = save(parts, metadata={"header": json.dumps(hdr), "shapes": shapes})
        assert code_of(raw) is code


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("base_round", -1, RejectCode.MALFORMED),
        ("base_round", -(2**40), RejectCode.MALFORMED),
        ("c_steps", -4, RejectCode.BAD_COUNTERS),
        ("c_tokens", -1, RejectCode.BAD_COUNTERS),
        ("step_time_s", -0.5, RejectCode.BAD_COUNTERS),
        ("step_time_s", float("inf"), RejectCode.BAD_COUNTERS),
        ("step_time_s", float("nan"), RejectCode.BAD_COUNTERS),
    ],
)
def test_negative_rounds_and_counters_are_refused_at_decode(field, value, code):
    """Issue 19: a negative base round got past the decoder and forced an abandoned merge."""
    raw = encode_contribution(header("fp32", **{field: value}), encode_tensors(tensors(), "fp32", 16))
    with pytest.raises(ProtocolError) as e:
        decode_contribution(raw, SPEC)
    assert e.value.code is code and field in str(e.value)
    # the edge values themselves are fine for the decoder (the synchroniser judges them against its round)
    ok = header("fp32", base_round=0, c_steps=0, c_tokens=0, step_time_s=0.0)
    assert decode_contribution(encode_contribution(ok, encode_tensors(tensors(), "fp32", 16)), SPEC)[0] == ok


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_never_crash(data):
    with pytest.raises(ProtocolError):
        decode_contribution(data, SPEC)


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, 10_000), val=st.integers(0, 255))
def test_single_byte_corruptions_never_crash(pos, val):
    raw = bytearray(encode_contribution(header("int4"), encode_tensors(tensors(), "int4", 16)))
    raw[pos % len(raw)] = val
    try:
        h, out = decode_contribution(bytes(raw), SPEC)
    except ProtocolError:
        return
    assert set(out) == set(SPEC) and all(torch.isfinite(t).all() for t in out.values())
