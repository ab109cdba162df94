"""tether.algos.masked: hand-worked values, empty masks, and inf/NaN at masked positions."""

import math

import pytest
import torch

from tether.algos import masked_count, masked_mean, masked_sum, masked_var, masked_whiten

INF, NAN = math.inf, math.nan


def _x_and_mask():
    x = torch.tensor([[1.0, 2.0, INF, 4.0], [NAN, -INF, 3.0, 5.0], [7.0, 7.0, 7.0, 7.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0, 1], [0, 0, 1, 0], [0, 0, 0, 0]])
    return x, m


def test_masked_sum_count_mean_hand_values():
    x, m = _x_and_mask()
    assert masked_sum(x, m).item() == 10.0  # 1 + 2 + 4 + 3
    assert masked_count(m).item() == 4
    assert masked_mean(x, m).item() == pytest.approx(2.5, abs=1e-12)
    torch.testing.assert_close(masked_sum(x, m, dim=-1), torch.tensor([7.0, 3.0, 0.0], dtype=torch.float64))
    # the empty row has mean 0, never NaN
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([7 / 3, 3.0, 0.0], dtype=torch.float64))
    assert masked_mean(x, m, dim=-1, keepdim=True).shape == (3, 1)


def test_float_and_bool_masks_agree():
    x, m = _x_and_mask()
    for mask in (m, m.bool(), m.float()):
        assert masked_mean(x, mask).item() == pytest.approx(2.5, abs=1e-12)


def test_masked_var_hand_values():
    x = torch.tensor([1.0, 2.0, 4.0, 100.0], dtype=torch.float64)
    m = torch.tensor([1, 1, 1, 0])
    # mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9
    assert masked_var(x, m).item() == pytest.approx(42 / 9 / 2, abs=1e-12)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(42 / 9 / 3, abs=1e-12)
    # one element: the unbiased variance is undefined -> 0, no crash; none: 0
    assert masked_var(x, torch.tensor([0, 1, 0, 0])).item() == 0.0
    assert masked_var(x, torch.zeros(4)).item() == 0.0
    rows = torch.tensor([[1.0, 3.0, 9.0], [2.0, 2.0, 5.0]], dtype=torch.float64)
    torch.testing.assert_close(
        masked_var(rows, torch.tensor([[1, 1, 0], [1, 1, 1]]), dim=-1),
        torch.tensor([2.0, 3.0], dtype=torch.float64),
    )


def test_masked_whiten_hand_values():
    x = torch.tensor([[1.0, 2.0, INF], [4.0, NAN, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    mean, var = 7 / 3, 7 / 3  # of {1, 2, 4}
    out = masked_whiten(x, m, eps=0.0)
    expected = torch.tensor([[(1 - mean), (2 - mean), 0.0], [(4 - mean), 0.0, 0.0]], dtype=torch.float64) / math.sqrt(
        var
    )
    expected[0, 2] = expected[1, 1] = expected[1, 2] = 0.0
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    kept = masked_whiten(x, m, shift_mean=False, eps=0.0)
    torch.testing.assert_close(kept[m.bool()], expected[m.bool()] + mean, atol=1e-12, rtol=0)
    assert (kept[~m.bool()] == 0).all()
    # default eps = 1e-8 (verl) changes the scale only by that epsilon
    torch.testing.assert_close(masked_whiten(x, m), expected * math.sqrt(var / (var + 1e-8)), atol=1e-12, rtol=0)


def test_whiten_of_constant_values_is_zero_not_nan():
    x = torch.full((2, 3), 0.1)
    out = masked_whiten(x, torch.ones(2, 3))
    assert torch.isfinite(out).all() and out.abs().max() < 1e-3


@pytest.mark.parametrize("fn", ["sum", "mean", "var", "whiten"])
def test_inf_and_nan_at_masked_positions_never_reach_value_or_gradient(fn):
    x0, m = _x_and_mask()
    x = x0.clone().requires_grad_(True)
    weights = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    out = {
        "sum": lambda: masked_sum(x, m),
        "mean": lambda: masked_mean(x, m, dim=-1).sum(),
        "var": lambda: masked_var(x, m),
        "whiten": lambda: (masked_whiten(x, m) * weights).sum(),
    }[fn]()
    assert torch.isfinite(out)
    out.backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[~m.bool()] == 0).all()
    assert (x.grad[m.bool()] != 0).any()
