"""Each codec round-trips within its stated elementwise error bound."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from protocol.codecs import CODECS, PACKED, Encoded, decode_tensors, encode_tensors, get_codec, wire_bytes
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
    assume(block % PACKED.get(name, 1) == 0)
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

    for codec in ("fp32", "bf16", "int8", "int4", "int2"):
        for numel, block in ((1000, 64), (37504, 64), (7, 64), (130, 32)):
            enc = encode_tensors({"x": torch.randn(numel)}, codec, block)
            assert encoded_nbytes(numel, codec, block) == wire_bytes(enc), (codec, numel, block)


# --- The codecs against straightforward references (the fast codecs keep the wire format) -------
#
# The references below are written from the documented codes: per block a scale s = max|x| (1 for a block of
# zeros); int4 codes the magnitude of y = x / s as the nearest of _LEVELS (bucketize on the midpoints, a tie
# going to the lower level), its sign in bit 3, two codes a byte (the first in the low nibble); int8 codes
# round(x / s * 127). Decoding is level * s and q * s / 127.

_LEVELS = torch.tensor([0.0] + [2.0**-k for k in range(6, -1, -1)])
_MIDPOINTS = (_LEVELS[1:] + _LEVELS[:-1]) / 2


def _ref_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.detach().reshape(-1).to(torch.float32)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % block)])
    b = flat.view(-1, block)
    s = b.abs().amax(dim=1, keepdim=True)
    return b, torch.where(s > 0, s, torch.ones_like(s))


def _ref_int4_codes(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15 one a value, whether the value sits exactly on a midpoint, scales)."""
    b, s = _ref_blocks(x, block)
    y = (b / s).reshape(-1)
    code = torch.bucketize(y.abs(), _MIDPOINTS) | ((y < 0).long() << 3)
    return code, torch.isin(y.abs(), _MIDPOINTS), s.reshape(-1)


def _ref_int4_decode(q: torch.Tensor, s: torch.Tensor, shape: tuple[int, ...], block: int) -> torch.Tensor:
    codes = torch.stack([q & 0x0F, q >> 4], dim=1).reshape(-1).long()
    mag = _LEVELS[codes & 7]
    val = torch.where((codes & 8) > 0, -mag, mag).reshape(-1, block) * s.reshape(-1, 1)
    return val.reshape(-1)[: math.prod(shape)].reshape(shape)


def _ref_int8_decode(q: torch.Tensor, s: torch.Tensor, shape: tuple[int, ...], block: int) -> torch.Tensor:
    val = q.to(torch.float32).reshape(-1, block) * s.reshape(-1, 1) / 127.0
    return val.reshape(-1)[: math.prod(shape)].reshape(shape)


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and the same value at every place, -0.0 and 0.0 told apart, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = a.isnan()
    return bool(
        (nan == b.isnan()).all() and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))
    )


def _awkward(seed: int, n: int, block: int) -> torch.Tensor:
    """n values for blocks of ``block``: normals over many magnitudes, zeros of both signs, denormals, and
    values that divided by their block's maximum give exactly a level or a midpoint, of both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    kind = torch.randint(0, 8, (n,), generator=g)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x[kind == 1] = 0.0
    x[kind == 2] = -0.0
    x[kind == 3] = (sign * 1e-40 * torch.rand(n, generator=g))[kind == 3]  # denormal
    special = torch.cat([_LEVELS, _MIDPOINTS, torch.tensor([2.0**-8, 3 * 2.0**-9, 2.0**-7 * (1 + 2**-23)])])
    pick = special[torch.randint(0, special.numel(), (n,), generator=g)] * sign
    # Set a block maximum m of each block, then levels and midpoints as multiples of it (exact: powers of two
    # and 1.5 times them); in a block that also holds a larger normal value they are just awkward values.
    blocks = math.ceil(n / block) if n else 0
    m = torch.exp2(torch.randint(-20, 20, (blocks,), generator=g).float()).repeat_interleave(block)[:n]
    x = torch.where(kind >= 5, pick * m, x)
    if n:
        x[::block] = m[::block] * torch.where(torch.rand(blocks, generator=g) < 0.5, -1.0, 1.0)
    return x


_CASES = [
    (seed, n, block) for seed in range(3) for n, block in ((0, 64), (1, 64), (100, 64), (4096, 64), (130, 32))
]
_CASES += [
    (7, 1000, 6),
    (8, 999, 2),
    (9, 1 << 12, 128),
    (10, 3 << 16, 64),
    (11, (1 << 18) + 77, 64),
    (12, 50, 128),
]


@pytest.fixture(params=["default chunk", "small chunks"])
def chunking(request, monkeypatch):
    """Run each case with the codecs' own piece size and with pieces of a few blocks, so that pieces and
    their edges (the padded last block among them) are crossed many times."""
    import protocol.codecs as codecs_mod

    if request.param == "small chunks":
        monkeypatch.setattr(codecs_mod, "_CHUNK", 256)
    return request.param


@pytest.mark.parametrize("seed,n,block", _CASES)
def test_int4_codes_are_the_nearest_level_except_at_ties(chunking, seed, n, block):
    x = _awkward(seed, n, block)
    e = get_codec("int4").encode(x, block)
    assert e.parts["q"].dtype == torch.uint8 and e.parts["s"].dtype == torch.float32
    want, tie, s = _ref_int4_codes(x, block)
    assert e.parts["q"].shape == (want.numel() // 2,) and torch.equal(e.parts["s"], s)
    got = torch.stack([e.parts["q"] & 0x0F, e.parts["q"] >> 4], dim=1).reshape(-1).long()
    # at a tie the level above is as near: its code is one more in magnitude, same sign
    ok = (got == want) | (tie & (got == want + 1))
    assert ok.all(), (got[~ok][:8], want[~ok][:8])


@pytest.mark.parametrize("seed,n,block", [c for c in _CASES if c[2] % 2 == 0] + [(13, 77, 7), (14, 5, 3)])
def test_int8_codes_are_the_nearest_step_except_at_ties(chunking, seed, n, block):
    x = _awkward(seed, n, block)
    e = get_codec("int8").encode(x, block)
    b, s = _ref_blocks(x, block)
    y = (b / s * 127.0).reshape(-1)
    assert torch.equal(e.parts["s"], s.reshape(-1)) and e.parts["q"].dtype == torch.int8
    got = e.parts["q"].to(torch.float32)
    tie = y - y.floor() == 0.5
    ok = (got == y.round()) | (tie & ((got == y.floor()) | (got == y.ceil())))
    assert got.shape == y.shape and ok.all()


@pytest.mark.parametrize(
    "name,seed,n,block",
    [(name, *c) for name in sorted(CODECS) for c in _CASES if c[2] % max(2, PACKED.get(name, 1)) == 0],
)
@pytest.mark.slow
def test_awkward_values_round_trip_within_bound(chunking, name, seed, n, block):
    x = _awkward(seed, n, block).reshape(-1, 1) if n % 2 else _awkward(seed, n, block).reshape(2, -1)
    c = get_codec(name)
    y = c.decode(c.encode(x, block))
    assert y.shape == x.shape and y.dtype == torch.float32
    within = (y - x).abs() <= c.error_bound(x, block)
    if name == "bf16":
        # bf16's relative bound holds down to the normal floats only: below 2^-126 bf16 keeps 7 bits fewer
        # as the value shrinks (as a cast to bf16 always did), so fp32 denormals are left out here.
        within |= x.abs() < 2.0**-126
    assert within.all()


@pytest.mark.parametrize("seed,n,block", _CASES)
def test_decode_is_the_reference_decode(chunking, seed, n, block):
    """Any codes and scales, of any value, decode as the straightforward decode has them, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    blocks = math.ceil(n / block)
    s = torch.randn(blocks, generator=g) * torch.exp2(torch.randint(-40, 40, (blocks,), generator=g).float())
    odd = torch.tensor([0.0, -0.0, 1e-42, -1e-42, float("inf"), -float("inf"), float("nan"), 3.4e38])
    s[: min(blocks, 8)] = odd[: min(blocks, 8)]
    shape = (n,) if n % 2 else (2, n // 2)
    q8 = torch.randint(-127, 128, (blocks * block,), generator=g, dtype=torch.int8)
    enc8 = Encoded("int8", shape, {"q": q8, "s": s.clone()})
    assert _same_floats(get_codec("int8").decode(enc8), _ref_int8_decode(q8, s, shape, block))
    if block % 2 == 0:
        q4 = torch.randint(0, 256, (blocks * block // 2,), generator=g, dtype=torch.uint8)
        enc4 = Encoded("int4", shape, {"q": q4, "s": s.clone()})
        assert _same_floats(get_codec("int4").decode(enc4), _ref_int4_decode(q4, s, shape, block))


def test_int4_codes_at_every_exponent_and_midpoint_edge():
    """With s = 1, every float just below, at and just above a power of two or a midpoint, of both signs."""
    mant = torch.tensor([0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF])
    bits = ((torch.arange(127).reshape(-1, 1) << 23) | mant).reshape(-1)  # every binade below 1
    y = bits.to(torch.int32).view(torch.float32)
    y = torch.cat([y, -y, torch.tensor([1.0, -1.0, 0.0, -0.0])])
    x = torch.stack([y, torch.ones_like(y)], dim=1).reshape(-1)  # each value's block holds 1.0: s = 1
    e = get_codec("int4").encode(x, 2)
    assert torch.equal(e.parts["s"], torch.ones(y.numel()))
    want = torch.bucketize(y.abs(), _MIDPOINTS) | ((y < 0).long() << 3)
    got = (e.parts["q"] & 0x0F).long()
    assert ((got == want) | (torch.isin(y.abs(), _MIDPOINTS) & (got == want + 1))).all()


def test_int4_big_endian_packing_packs_the_same(monkeypatch):
    import protocol.codecs as codecs_mod

    x = _awkward(3, 1000, 8)
    want = get_codec("int4").encode(x, 8)
    monkeypatch.setattr(codecs_mod, "_LITTLE_ENDIAN", False)
    got = get_codec("int4").encode(x, 8)
    assert torch.equal(got.parts["q"], want.parts["q"]) and torch.equal(got.parts["s"], want.parts["s"])


@pytest.mark.parametrize("name", sorted(CODECS))
def test_other_dtypes_and_layouts_encode_as_their_fp32_values(name):
    """A float64 or bf16 tensor, or a transposed one, encodes as its contiguous fp32 copy does."""
    c = get_codec(name)
    x = torch.randn(40, 30, dtype=torch.float64)
    for variant in (x, x.t(), x.to(torch.bfloat16), x.t().to(torch.bfloat16)):
        want = c.encode(variant.to(torch.float32).contiguous(), 16)
        got = c.encode(variant, 16)
        assert got.shape == want.shape and got.parts.keys() == want.parts.keys()
        assert all(torch.equal(got.parts[k], want.parts[k]) for k in want.parts)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_encoding_copies_the_tensor(name):
    """Callers keep and change the tensors they encode: the wire parts must not share their memory."""
    x = torch.randn(256)
    e = get_codec(name).encode(x, 64)
    before = {k: t.clone() for k, t in e.parts.items()}
    x.add_(1.0)
    assert all(torch.equal(e.parts[k], before[k]) for k in before)
    b = torch.randn(256, dtype=torch.bfloat16)
    e = get_codec(name).encode(b, 64)
    before = {k: t.clone() for k, t in e.parts.items()}
    b.add_(1.0)
    assert all(torch.equal(e.parts[k], before[k]) for k in before)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_parts_that_do_not_fit_the_shape_are_refused(name):
    c = get_codec(name)
    e = c.encode(torch.randn(100), 20)
    q, s = e.parts["q"], e.parts["s"]
    for shape, parts in (
        ((101,), {"q": q, "s": s}),  # more values than the blocks hold
        ((100,), {"q": q[:-2], "s": s}),  # codes that are not whole blocks
        ((100,), {"q": q, "s": s[:0]}),  # codes but no scales
    ):
        with pytest.raises(ProtocolError):
            c.decode(Encoded(name, shape, parts))
    assert c.decode(Encoded(name, (0, 3), {"q": q[:0], "s": s[:0]})).shape == (0, 3)


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize(
    "poison", ["none", "inf-scale", "nan-scale", "huge-scale", "largest-safe-scale", "nan-value", "inf-value"]
)
def test_all_finite_says_what_a_decode_would(name, poison):
    """``all_finite`` reads an int4 or int8 form's scales instead of decoding it; it must agree with a
    decode on every form a peer could send, a scale that decodes to inf included."""
    from protocol.messages import all_finite

    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    if poison in ("nan-value", "inf-value"):
        x[123] = float("nan") if poison == "nan-value" else float("inf")
    e = encode_tensors({"w": x}, name, 64)["w"]
    if "s" in e.parts and poison.endswith("scale"):
        s = e.parts["s"].clone()
        s[3] = {
            "inf-scale": math.inf,
            "nan-scale": math.nan,
            "huge-scale": 3e38,  # finite, yet an int8 code of 127 times it is not
            "largest-safe-scale": torch.finfo(torch.float32).max / 127.0,  # int8's
        }[poison]
        e = Encoded(e.codec, e.shape, {**e.parts, "s": s})
    assert all_finite(e) == bool(torch.isfinite(get_codec(name).decode(e)).all())
    if poison == "none":
        assert all_finite(e)


# --- int2: the four levels of a unit Gaussian's Lloyd-Max quantiser times each block's RMS ------------

_INT2 = torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104])


def _ref_int2(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes 0..3 one a value: the nearest level of x / rms, a tie to the lower; the blocks' RMS)."""
    flat = x.detach().reshape(-1).to(torch.float64)
    b = torch.cat([flat, flat.new_zeros((-flat.numel()) % block)]).view(-1, block)
    rms = b.square().mean(dim=1, keepdim=True).sqrt()
    y = (b / torch.where(rms > 0, rms, torch.ones_like(rms))).reshape(-1, 1)
    dist = (y - _INT2.to(torch.float64)).abs()
    return dist.argmin(dim=1), rms.reshape(-1)


@pytest.mark.parametrize("seed,n,block", [c for c in _CASES if c[2] % 4 == 0])
def test_int2_codes_are_the_nearest_level_of_the_block_rms(chunking, seed, n, block):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    e = get_codec("int2").encode(x, block)
    want, rms = _ref_int2(x, block)
    assert e.parts["q"].dtype == torch.uint8 and e.parts["q"].numel() == want.numel() // 4
    assert torch.allclose(e.parts["s"].double(), rms, rtol=1e-5)
    got = torch.stack([(e.parts["q"] >> (2 * k)) & 3 for k in range(4)], dim=1).reshape(-1).long()
    near = got == want  # a value within float rounding of a threshold may take either neighbour
    flat = torch.cat([x, x.new_zeros((-n) % block)]).double()
    s = e.parts["s"].double().repeat_interleave(block)
    y = flat / torch.where(s > 0, s, torch.ones_like(s))
    edge = torch.stack([(y - t).abs() < 1e-5 for t in (-0.9816, 0.0, 0.9816)]).any(dim=0)
    assert (near | edge).all(), (got[~near][:8], want[~near][:8])


def test_int2_is_a_quarter_byte_a_value_and_keeps_zero_blocks_at_zero():
    x = torch.randn(1024, 64)
    x[3] = 0.0
    enc = encode_tensors({"w": x}, "int2", 64)
    assert wire_bytes(enc) == x.numel() // 4 + (x.numel() // 64) * 4
    y = get_codec("int2").decode(enc["w"])
    assert (y[3] == 0).all()
    levels = y[0].abs().div(enc["w"].parts["s"][0])
    assert (
        torch.isclose(levels, torch.tensor(0.4528))
        .logical_or(torch.isclose(levels, torch.tensor(1.5104)))
        .all()
    )
    # a Gaussian tensor loses about 12% of its energy (Lloyd-Max: 11.75%)
    assert 0.10 < float((x - y).square().mean() / x.square().mean()) < 0.13


def test_int2_of_a_nan_or_inf_is_refused_as_not_finite_not_decoded_to_junk():
    from protocol.messages import all_finite

    for bad in (float("nan"), float("inf")):
        x = torch.randn(256)
        x[70] = bad
        e = get_codec("int2").encode(x, 64)
        assert not all_finite(e) and not torch.isfinite(get_codec("int2").decode(e)).all()
        assert torch.isfinite(get_codec("int2").decode(e)[:64]).all()  # the other blocks are untouched


def test_int2_block_must_be_a_multiple_of_four():
    from protocol.config import ProtocolConfig
    from protocol.errors import ConfigError

    with pytest.raises(ValueError, match="multiple of 4"):
        get_codec("int2").encode(torch.randn(12), 6)
    with pytest.raises(ConfigError, match="codec_block"):
        ProtocolConfig(codec="int2", codec_block=66)
    with pytest.raises(ConfigError, match="feedback"):
        ProtocolConfig(feedback="sometimes")
