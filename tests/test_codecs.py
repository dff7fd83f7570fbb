"""Each codec round-trips within its stated elementwise error bound."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codecs import CODECS, decode_tensors, encode_tensors, get_codec, wire_bytes
from protocol.errors import ProtocolError


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(CODECS)),
    n=st.integers(1, 700),
    scale=st.floats(1e-6, 1e4),
    seed=st.integers(0, 2**16),
    block=st.sampled_from([2, 32, 64, 128]),
)
def test_round_trip_within_bound(name, n, scale, seed, block):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    x[::7] = 0.0  # zeros must stay exact-ish and never divide by zero
    c = get_codec(name)
    y = c.decode(c.encode(x, block))
    assert y.shape == x.shape and y.dtype == torch.float32
    assert ((y - x).abs() <= c.error_bound(x, block)).all()


def test_int4_is_four_bits_per_value_plus_scales():
    x = torch.randn(1024, 64)
    enc = encode_tensors({"w": x}, "int4", 64)
    assert wire_bytes(enc) == x.numel() // 2 + (x.numel() // 64) * 4
    assert wire_bytes(encode_tensors({"w": x}, "fp32", 64)) / wire_bytes(enc) > 7


def test_int4_keeps_signs_and_block_maximum_exactly():
    x = torch.tensor([0.5, -1.0, 0.25, 0.0, -0.125, 1e-5])
    y = get_codec("int4").decode(get_codec("int4").encode(x, 6))
    assert y[1] == -1.0 and y[0] == 0.5 and y[2] == 0.25 and y[3] == 0.0 and y[4] == -0.125
    assert y[5] == 0.0


def test_shapes_preserved_for_multidim():
    x = {"a": torch.randn(3, 5, 7), "b": torch.randn(1)}
    out = decode_tensors(encode_tensors(x, "int8", 64))
    assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in x.items()}


def test_unknown_codec_is_a_clear_error():
    with pytest.raises(ProtocolError, match="unknown codec 'int3'"):
        get_codec("int3")


def test_encoded_nbytes_is_what_encoding_makes():
    from protocol.codecs import encode_tensors, encoded_nbytes, wire_bytes

    for codec in ("fp32", "bf16", "int8", "int4"):
        for numel, block in ((1000, 64), (37504, 64), (7, 64), (130, 32)):
            enc = encode_tensors({"x": torch.randn(numel)}, codec, block)
            assert encoded_nbytes(numel, codec, block) == wire_bytes(enc), (codec, numel, block)
