"""DAPO's soft overlong penalty (tether.algos.overlong_penalty) on hand-worked values at its boundaries."""

import pytest
import torch

from tether.algos import overlong_penalty


def test_penalty_is_zero_then_linear_then_minus_one():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then −(|y| − 6)/4, −1 at 10 (DAPO eq. 13)
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 11])
    got = overlong_penalty(lengths, 10, 4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]), rtol=0, atol=1e-7)


def test_factor_scales_it_and_verl_agrees_inside_the_limit():
    lengths = torch.tensor([6.0, 7.0, 10.0])
    got = overlong_penalty(lengths, 10, 4, factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, -0.125, -0.5]), rtol=0, atol=1e-7)
    # verl's DAPO reward manager: min(−(|y| − (L_max − L_cache)) / L_cache · factor, 0)
    verl = [min(-(n - (10 - 4)) / 4 * 0.5, 0.0) for n in lengths.tolist()]
    assert got.tolist() == pytest.approx(verl, abs=1e-7)
    assert overlong_penalty(lengths, 10, 4, factor=0.0).abs().max() == 0


def test_smallest_buffer_and_limit():
    # L_max = 2, L_cache = 1: a 1-token response is free, a 2-token one gets −1
    torch.testing.assert_close(overlong_penalty(torch.tensor([1, 2]), 2, 1), torch.tensor([0.0, -1.0]), rtol=0, atol=0)
    # L_cache = L_max − 1: only the empty response is free below the ramp's start at 1 token
    torch.testing.assert_close(
        overlong_penalty(torch.tensor([1, 2, 3, 4]), 4, 3), torch.tensor([0.0, -1 / 3, -2 / 3, -1.0]), rtol=0, atol=1e-7
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ((4, 0), r"buffer must be an integer with 1 <= buffer < max_len \(4\)"),
        ((4, 4), r"buffer must be an integer with 1 <= buffer < max_len \(4\)"),
        ((4, 1.5), "buffer must be an integer"),
        ((0, 1), "max_len must be an integer >= 1"),
    ],
)
def test_bad_lengths_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty(torch.tensor([1]), *args)


def test_bad_factor_is_named():
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="factor must be a finite number >= 0"):
            overlong_penalty(torch.tensor([1]), 4, 2, factor=bad)
