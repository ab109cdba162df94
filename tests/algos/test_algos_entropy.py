"""Entropy control in tether.algos: the dual-ascent entropy coefficient (algo.entropy_target) and the
top-entropy token mask (algo.top_entropy_quantile), on hand-worked values."""

import json
import math

import pytest
import torch

from tether.algos import EntropyCoefController, entropy_quantile_threshold, top_entropy_mask

# ---------------------------------------------------------------------------------------- α controller


def test_dual_ascent_steps_clip_at_both_bounds():
    c = EntropyCoefController(0.01, target=1.0, lr=0.1, coef_max=0.05)
    assert c.value == 0.01 and c.n_updates == 0
    # H below the target raises α by lr·(H_target − H)
    assert c.update(0.8) == pytest.approx(0.03, abs=1e-15)
    # 0.03 + 0.1·0.5 = 0.08, clipped at α_max
    assert c.update(0.5) == 0.05
    # H above the target: 0.05 − 0.1·0.9 = −0.04, clipped at 0 (the bonus is off)
    assert c.update(1.9) == 0.0
    # from 0 it climbs again: 0 + 0.1·0.1
    assert c.update(0.9) == pytest.approx(0.01, abs=1e-15)
    # at the target it stays
    assert c.update(1.0) == pytest.approx(0.01, abs=1e-15)
    assert c.n_updates == 5


def test_state_round_trips_exactly_through_json_and_is_checked():
    c = EntropyCoefController(0.0, target=0.7, lr=0.013, coef_max=0.2)
    for h in (0.31, 0.52, 0.123456789):
        c.update(h)
    state = json.loads(json.dumps(c.state_dict()))
    d = EntropyCoefController(0.0, target=0.7, lr=0.013, coef_max=0.2)
    d.load_state_dict(state)
    assert (d.value, d.n_updates) == (c.value, c.n_updates) and d.value == c.value  # bit-exact
    assert d.update(0.4) == c.update(0.4)
    with pytest.raises(ValueError, match="controller 'fixed'"):
        d.load_state_dict({"name": "fixed", "value": 0.1, "n_updates": 1})
    with pytest.raises(ValueError, match=r"state\['value'\] must be >= 0"):
        d.load_state_dict({"name": d.name, "value": -0.1, "n_updates": 1})
    with pytest.raises(ValueError, match="n_updates"):
        d.load_state_dict({"name": d.name, "value": 0.1, "n_updates": 1.5})
    small = EntropyCoefController(0.0, target=0.7, lr=0.013, coef_max=0.01)  # a resumed run that lowered the bound
    small.load_state_dict({"name": d.name, "value": 0.05, "n_updates": 3})
    assert small.value == 0.01 and small.n_updates == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(coef=0.2, target=1.0, lr=0.1, coef_max=0.1), r"coef \(0.2\) must lie within \[0, coef_max\]"),
        (dict(coef=-0.01, target=1.0, lr=0.1, coef_max=0.1), r"coef \(-0.01\) must lie within"),
        (dict(coef=0.0, target=-1.0, lr=0.1, coef_max=0.1), "target"),
        (dict(coef=0.0, target=1.0, lr=0.0, coef_max=0.1), "lr must be > 0"),
        (dict(coef=0.0, target=1.0, lr=0.1, coef_max=0.0), "coef_max must be > 0"),
        (dict(coef=0.0, target=float("nan"), lr=0.1, coef_max=0.1), "target must be finite"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    coef = kwargs.pop("coef")
    with pytest.raises(ValueError, match=message):
        EntropyCoefController(coef, **kwargs)


def test_non_finite_entropy_is_refused_and_changes_nothing():
    c = EntropyCoefController(0.02, target=1.0, lr=0.1, coef_max=0.1)
    with pytest.raises(ValueError, match="entropy must be finite"):
        c.update(float("nan"))
    assert (c.value, c.n_updates) == (0.02, 0)


# ---------------------------------------------------------------------------------------- top-entropy mask

#: 7 counted entropies (sorted: 0.1 0.2 0.3 0.4 0.5 0.7 0.9) and a large one at a masked position
ENT = torch.tensor([[0.1, 0.5, 0.3, 0.9], [0.7, 0.2, 9.0, 0.4]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]])


def test_threshold_is_linear_interpolation_between_order_statistics():
    # q = 0.5: p = 0.5·6 = 3 -> v_3 = 0.4
    assert entropy_quantile_threshold(ENT, MASK, 0.5) == pytest.approx(0.4, abs=1e-7)
    # q = 0.8: p = 4.8 -> 0.5 + 0.8·(0.7 − 0.5) = 0.66
    assert entropy_quantile_threshold(ENT, MASK, 0.8) == pytest.approx(0.66, abs=1e-7)
    # q = 0 and 1: the minimum and maximum of the counted values (the masked 9.0 is not one)
    assert entropy_quantile_threshold(ENT, MASK, 0.0) == pytest.approx(0.1, abs=1e-7)
    assert entropy_quantile_threshold(ENT, MASK, 1.0) == pytest.approx(0.9, abs=1e-7)


def test_threshold_equals_torch_quantile_and_ignores_order():
    g = torch.Generator().manual_seed(0)
    ent = torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(6, 9, generator=g) > 0.3
    for q in (0.0, 0.13, 0.5, 0.77, 0.95, 1.0):
        want = float(torch.quantile(ent[mask], q))
        assert entropy_quantile_threshold(ent, mask, q) == pytest.approx(want, abs=1e-12)
        perm = torch.randperm(6, generator=g)
        assert entropy_quantile_threshold(ent[perm], mask[perm], q) == entropy_quantile_threshold(ent, mask, q)


@pytest.mark.parametrize(
    "rho, kept",
    [
        (1.0, [[1, 1, 1, 1], [1, 1, 0, 1]]),  # τ = the minimum: every counted token
        (0.5, [[0, 1, 0, 1], [1, 0, 0, 1]]),  # τ = 0.4: 0.4, 0.5, 0.7, 0.9 (4 of 7, ties none)
        (0.2, [[0, 0, 0, 1], [1, 0, 0, 0]]),  # τ = 0.66: 0.7, 0.9
        (0.01, [[0, 0, 0, 1], [0, 0, 0, 0]]),  # q = 0.99, p = 5.94: τ = 0.7 + 0.94·0.2 = 0.888: only the maximum
    ],
)
def test_mask_keeps_the_top_fraction_of_counted_tokens(rho, kept):
    keep, tau = top_entropy_mask(ENT, MASK, rho)
    assert keep.dtype == torch.bool
    assert keep.int().tolist() == kept
    assert not keep[1, 2]  # a masked position is never kept, however high its entropy


def test_ties_at_the_threshold_are_all_kept():
    ent = torch.tensor([[1.0, 1.0, 1.0, 2.0]])
    mask = torch.ones(1, 4)
    # ρ = 0.5: q = 0.5, p = 1.5 between two 1.0s: τ = 1.0, and every token is ≥ 1.0
    keep, tau = top_entropy_mask(ent, mask, 0.5)
    assert tau == 1.0 and keep.tolist() == [[True, True, True, True]]
    # ρ = 0.25: p = 2.25: τ = 1 + 0.25·(2 − 1) = 1.25: only the 2.0
    keep, tau = top_entropy_mask(ent, mask, 0.25)
    assert tau == pytest.approx(1.25, abs=1e-12) and keep.tolist() == [[False, False, False, True]]
    # all equal: everything is a tie
    keep, _ = top_entropy_mask(torch.full((2, 3), 0.7), torch.ones(2, 3), 0.2)
    assert bool(keep.all())


def test_one_minus_rho_rounding_does_not_drop_an_order_statistic():
    # 0..10: ρ = 0.7 means q = 1 − 0.7 = 0.30000000000000004 in floating point, p = 3.0000000000000004;
    # taken as p = 3, τ = 3 and the 8 tokens 3..10 are kept (unsnapped, τ would pass 3 and drop it)
    ent = torch.arange(11, dtype=torch.float32).reshape(1, 11)
    keep, tau = top_entropy_mask(ent, torch.ones(1, 11), 0.7)
    assert tau == 3.0 and int(keep.sum()) == 8
    keep, tau = top_entropy_mask(ent, torch.ones(1, 11), 0.9)  # q = 0.0999...98: τ = 1, 10 kept
    assert tau == 1.0 and int(keep.sum()) == 10


def test_no_counted_token_and_bad_quantiles():
    keep, tau = top_entropy_mask(ENT, torch.zeros(2, 4), 0.5)
    assert math.isnan(tau) and not keep.any()
    for bad in (0.0, -0.1, 1.5, float("nan"), "0.5"):
        with pytest.raises(ValueError, match=r"quantile \(rho\) must be a number in \(0, 1\]"):
            top_entropy_mask(ENT, MASK, bad)
    with pytest.raises(ValueError, match="same shape"):
        top_entropy_mask(ENT, MASK[:, :3], 0.5)
    with pytest.raises(ValueError, match=r"q must be a number in \[0, 1\]"):
        entropy_quantile_threshold(ENT, MASK, 1.2)
