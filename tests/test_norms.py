"""``protocol.norms``: sums of squares and inner products summed in fp32 blocks, the blocks in float64."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.codecs import encode_tensors
from protocol.norms import SQ_BLOCK, dot, sq_norm


@pytest.mark.parametrize("n", [7, 2 * SQ_BLOCK, 2 * SQ_BLOCK + 5, 1_000_003])
def test_the_sum_of_squares_matches_float64_accumulation(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3 + 1
    ref = float(torch.sum(x.double() ** 2))
    assert sq_norm(x) == pytest.approx(ref, rel=1e-7)
    assert sq_norm(x.view(-1, 1) if n % 2 else x.view(2, -1)) == pytest.approx(ref, rel=1e-7)


def test_non_finite_values_and_squares_over_fp32s_range():
    x = torch.ones(5 * SQ_BLOCK + 3)
    x[SQ_BLOCK + 1] = 1e30  # finite; its square is not an fp32
    assert math.isfinite(sq_norm(x)) and sq_norm(x) == pytest.approx(
        float(torch.sum(x.double() ** 2)), rel=1e-9
    )
    x[7] = float("inf")
    assert sq_norm(x) == math.inf
    x[9] = float("nan")
    assert math.isnan(sq_norm(x))
    tail = torch.ones(2 * SQ_BLOCK + 3)
    tail[-1] = float("nan")  # in the part past the last whole block
    assert math.isnan(sq_norm(tail))


def test_a_wire_form_is_summed_a_range_at_a_time_like_its_decoded_tensor():
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(1))
    enc = encode_tensors({"w": x}, "int4", 64)["w"]
    from protocol.codecs import get_codec

    assert sq_norm(enc) == pytest.approx(
        float(torch.sum(get_codec("int4").decode(enc).double() ** 2)), rel=1e-7
    )


@pytest.mark.parametrize("n", [7, 2 * SQ_BLOCK, 2 * SQ_BLOCK + 5, 1_000_003])
def test_the_inner_product_matches_float64_accumulation(n):
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, generator=g) * 3 + 1, torch.randn(n, generator=g) - 0.5
    ref = float(torch.sum(x.double() * y.double()))
    assert dot(x, y) == pytest.approx(ref, rel=1e-7, abs=1e-9 * math.sqrt(sq_norm(x) * sq_norm(y)))
    assert dot(x, x) == pytest.approx(sq_norm(x), rel=1e-7)


def test_an_inner_product_past_fp32s_range_is_summed_in_float64():
    x, y = torch.ones(5 * SQ_BLOCK + 3), torch.ones(5 * SQ_BLOCK + 3)
    x[SQ_BLOCK + 1], y[SQ_BLOCK + 1] = 1e30, -1e20  # each finite; their product is not an fp32
    assert dot(x, y) == pytest.approx(float(torch.sum(x.double() * y.double())), rel=1e-12)
    assert dot(x, y) < -1e49
