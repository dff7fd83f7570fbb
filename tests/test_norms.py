"""``protocol.norms.sq_norm``: sums of squares summed in fp32 blocks, the blocks in float64."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.codecs import encode_tensors
from protocol.norms import SQ_BLOCK, sq_norm


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
