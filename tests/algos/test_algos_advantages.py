"""tether.algos.advantages: GAE (hand values, loop vs vectorized), GRPO, RLOO, REINFORCE++, registry."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_rloo_advantages,
    gae_reference_loop,
    reverse_discounted_cumsum,
    zero_variance_groups,
)

F64 = torch.float64
INF, NAN = math.inf, math.nan


def t64(x):
    return torch.tensor(x, dtype=F64)


# ---------------------------------------------------------------- scan


@pytest.mark.parametrize("t", [1, 2, 31, 32, 33, 100, 32 * 32, 32 * 32 + 7])
@pytest.mark.parametrize("c", [0.0, 0.5, 0.95, 1.0])
def test_reverse_discounted_cumsum_matches_a_loop(t, c):
    x = torch.randn(3, t, generator=torch.Generator().manual_seed(t), dtype=F64)
    expected = torch.zeros_like(x)
    acc = torch.zeros(3, dtype=F64)
    for i in reversed(range(t)):
        acc = x[:, i] + c * acc
        expected[:, i] = acc
    torch.testing.assert_close(reverse_discounted_cumsum(x, c), expected, atol=1e-10, rtol=1e-12)
    torch.testing.assert_close(reverse_discounted_cumsum(x, c, block=4), expected, atol=1e-10, rtol=1e-12)


def test_reverse_discounted_cumsum_errors():
    with pytest.raises(ValueError, match="discount"):
        reverse_discounted_cumsum(torch.zeros(2, 3), 1.5)
    with pytest.raises(ValueError, match="block"):
        reverse_discounted_cumsum(torch.zeros(2, 3), 0.5, block=1)


# ---------------------------------------------------------------- GAE


@pytest.mark.parametrize("fn", [compute_gae, gae_reference_loop])
def test_gae_hand_values(fn):
    # gamma 0.9, lambda 0.8 (gamma*lambda = 0.72); r = (0, 0, 1), V = (0.5, 0.6, 0.7)
    # delta = (0.54 - 0.5, 0.63 - 0.6, 1 - 0.7) = (0.04, 0.03, 0.3)
    # A2 = 0.3, A1 = 0.03 + 0.72 * 0.3 = 0.246, A0 = 0.04 + 0.72 * 0.246 = 0.21712
    r, v, m = t64([[0.0, 0.0, 1.0]]), t64([[0.5, 0.6, 0.7]]), torch.ones(1, 3)
    adv, ret = fn(r, v, m, 0.9, 0.8, whiten=False)
    torch.testing.assert_close(adv, t64([[0.21712, 0.246, 0.3]]), atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, t64([[0.71712, 0.846, 1.0]]), atol=1e-12, rtol=0)


@pytest.mark.parametrize("fn", [compute_gae, gae_reference_loop])
def test_gae_skips_masked_tokens_in_the_middle(fn):
    # valid tokens at t = 0 and t = 2 (t = 1 is tool output; t = 3 padding), garbage where masked
    # delta(t2) = 1 + 0 - 0.7 = 0.3 ; delta(t0) = 0 + 0.9 * 0.7 - 0.5 = 0.13 (next *valid* value)
    # A(t2) = 0.3 ; A(t0) = 0.13 + 0.72 * 0.3 = 0.346
    r = t64([[0.0, 99.0, 1.0, NAN], [0.0, 0.0, 1.0, 0.0]])
    v = t64([[0.5, INF, 0.7, NAN], [0.5, 0.7, 0.0, 0.0]])
    m = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])
    adv, ret = fn(r, v, m, 0.9, 0.8, whiten=False)
    # row 2: valid t0, t1 only: delta(t1) = 0 - 0.7, delta(t0) = 0.9 * 0.7 - 0.5 = 0.13; A(t0) = 0.13 - 0.72 * 0.7
    torch.testing.assert_close(adv, t64([[0.346, 0.0, 0.3, 0.0], [0.13 - 0.504, -0.7, 0.0, 0.0]]), atol=1e-12, rtol=0)
    torch.testing.assert_close(
        ret, t64([[0.846, 0.0, 1.0, 0.0], [0.5 + 0.13 - 0.504, 0.0, 0.0, 0.0]]), atol=1e-12, rtol=0
    )


def test_gae_whitening_is_over_valid_tokens_and_returns_stay_raw():
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(4, 9, generator=g, dtype=F64), torch.randn(4, 9, generator=g, dtype=F64)
    m = torch.rand(4, 9, generator=g) > 0.3
    raw, ret_raw = compute_gae(r, v, m, 0.99, 0.95, whiten=False)
    adv, ret = compute_gae(r, v, m, 0.99, 0.95)
    torch.testing.assert_close(ret, ret_raw, atol=0, rtol=0)
    valid = raw[m].tolist()
    mu, sd = statistics.mean(valid), statistics.stdev(valid)
    expected = torch.where(m, (raw - mu) / math.sqrt(sd * sd + 1e-8), 0.0)
    torch.testing.assert_close(adv, expected, atol=1e-10, rtol=0)
    assert (adv[~m] == 0).all()


def _masks(b, t, g):
    return {
        "right_padded": torch.arange(t)[None] < torch.randint(0, t + 1, (b,), generator=g)[:, None],
        "left_padded": torch.arange(t)[None] >= torch.randint(0, t + 1, (b,), generator=g)[:, None],
        "holes": torch.rand(b, t, generator=g) > 0.3,
        "full": torch.ones(b, t, dtype=torch.bool),
    }


@pytest.mark.parametrize("kind", ["right_padded", "left_padded", "holes", "full"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.0), (0.0, 0.0), (0.5, 1.0)])
def test_gae_vectorized_equals_reference_loop(kind, gamma, lam):
    g = torch.Generator().manual_seed(7)
    b, t = 6, 300
    r, v = torch.randn(b, t, generator=g, dtype=F64), torch.randn(b, t, generator=g, dtype=F64)
    m = _masks(b, t, g)[kind]
    r, v = torch.where(m, r, NAN), torch.where(m, v, INF)  # garbage where masked
    for whiten in (False, True):
        adv, ret = compute_gae(r, v, m, gamma, lam, whiten=whiten)
        adv_ref, ret_ref = gae_reference_loop(r, v, m, gamma, lam, whiten=whiten)
        torch.testing.assert_close(adv, adv_ref, atol=1e-10, rtol=0)
        torch.testing.assert_close(ret, ret_ref, atol=1e-10, rtol=0)
    # float32 inputs: the float32 scan agrees with the float64 loop to 1e-6 (relative to |A|)
    adv32, ret32 = compute_gae(r.float(), v.float(), m, gamma, lam, whiten=False)
    adv_ref, ret_ref = gae_reference_loop(r, v, m, gamma, lam, whiten=False)
    scale = max(1.0, ret_ref.abs().max().item())
    assert adv32.dtype == torch.float32
    assert (adv32.double() - adv_ref).abs().max().item() <= 1e-6 * scale
    assert (ret32.double() - ret_ref).abs().max().item() <= 1e-6 * scale


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.integers(1, 5),
    st.integers(1, 80),
    st.floats(0, 1),
    st.floats(0, 1),
    st.integers(0, 2**31 - 1),
    st.floats(0, 1),
)
def test_property_gae_vectorized_equals_loop(b, t, gamma, lam, seed, keep):
    g = torch.Generator().manual_seed(seed)
    r, v = torch.randn(b, t, generator=g, dtype=F64), torch.randn(b, t, generator=g, dtype=F64)
    m = torch.rand(b, t, generator=g) < keep
    adv, ret = compute_gae(r, v, m, gamma, lam)
    adv_ref, ret_ref = gae_reference_loop(r, v, m, gamma, lam)
    torch.testing.assert_close(adv, adv_ref, atol=1e-9, rtol=0)
    torch.testing.assert_close(ret, ret_ref, atol=1e-9, rtol=0)


def test_empty_shapes():
    for b, t in ((0, 5), (3, 0)):
        x, m = torch.zeros(b, t), torch.ones(b, t)
        for fn in (compute_gae, gae_reference_loop):
            adv, ret = fn(x, x, m, 0.9, 0.9)
            assert adv.shape == ret.shape == (b, t)
        assert compute_grpo_advantages(torch.zeros(b), m, torch.zeros(b, dtype=torch.long))[0].shape == (b, t)


def test_gae_errors():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(x, x, m, 1.01, 0.9)
    with pytest.raises(ValueError, match="lam"):
        compute_gae(x, x, m, 0.9, -0.1)
    with pytest.raises(ValueError, match="values"):
        compute_gae(x, torch.zeros(2, 4), m, 0.9, 0.9)


# ---------------------------------------------------------------- group estimators

SCORES = t64([1.0, 2.0, 3.0, 5.0, 5.0, 0.0, 7.0, 100.0])
GROUPS = torch.tensor([17, 17, 17, -3, -3, 1000, 4, 17])  # arbitrary labels
MASK = torch.tensor([[1, 1, 0]] * 7 + [[0, 0, 0]])  # the last response (group 17) has no valid token


def test_grpo_hand_values():
    adv, ret = compute_grpo_advantages(SCORES, MASK, GROUPS)
    # group 17 = {1, 2, 3} (the empty response's 100 takes no part): mean 2, unbiased std 1
    # group -3 = {5, 5}: all equal -> 0 ; group 1000 and 4: one member -> 0
    per_seq = t64([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, per_seq[:, None] * MASK, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, adv, atol=0, rtol=0)
    dr, _ = compute_grpo_advantages(SCORES, MASK, GROUPS, norm_by_std=False)
    torch.testing.assert_close(dr[:, 0], t64([-1.0, 0.0, 1.0, 0, 0, 0, 0, 0]), atol=1e-12, rtol=0)
    eps0, _ = compute_grpo_advantages(SCORES, MASK, GROUPS, eps=0.0)
    assert eps0[0, 0].item() == -1.0


def test_grpo_norm_by_std_group_batch_none_hand_values():
    # group 0 = {1, 0, 0, 0}, group 1 = {1, 1, 1, 0}: centred [.75, -.25, -.25, -.25, .25, .25, .25, -.75];
    # group std 0.5 in both groups; batch std of all eight scores sqrt(2/7) (mean .5, sum of squares 2)
    scores = t64([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(8, 2)
    centred = t64([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
    want = {"group": centred / (0.5 + 1e-6), "batch": centred / (math.sqrt(2 / 7) + 1e-6), "none": centred}
    for choice, expected in want.items():
        adv, _ = compute_grpo_advantages(scores, mask, groups, norm_by_std=choice)
        torch.testing.assert_close(adv, expected[:, None].expand(8, 2), atol=1e-12, rtol=0)
    assert compute_grpo_advantages(scores, mask, groups, norm_by_std="batch")[0][0, 0].item() == pytest.approx(
        1.40312, abs=1e-5
    )
    # the old booleans still mean group / none
    torch.testing.assert_close(
        compute_grpo_advantages(scores, mask, groups, norm_by_std=True)[0], want["group"][:, None].expand(8, 2)
    )
    torch.testing.assert_close(
        compute_grpo_advantages(scores, mask, groups, norm_by_std=False)[0], want["none"][:, None].expand(8, 2)
    )
    with pytest.raises(ValueError, match="norm_by_std must be one of group, batch, none"):
        compute_grpo_advantages(scores, mask, groups, norm_by_std="std")


def test_grpo_batch_std_ignores_empty_rows_and_keeps_constant_groups_at_zero():
    # SCORES/GROUPS/MASK above: participating scores {1, 2, 3, 5, 5, 0, 7} (the empty row's 100 is out)
    x = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 0.0, 7.0], dtype=F64)
    adv, _ = compute_grpo_advantages(SCORES, MASK, GROUPS, norm_by_std="batch")
    std = x.std().item()  # unbiased over the 7 participating responses
    per_seq = t64([-1 / (std + 1e-6), 0.0, 1 / (std + 1e-6), 0.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, per_seq[:, None] * MASK, atol=1e-12, rtol=0)


def test_grpo_equal_rewards_are_exactly_zero_despite_round_off():
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7])  # sum/3 != 0.1 in floating point
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    for fn in (compute_grpo_advantages, compute_rloo_advantages, compute_reinforce_pp_baseline_advantages):
        adv, _ = fn(scores, torch.ones(7, 4), groups)
        assert (adv == 0).all(), fn.__name__
    # NaN scores of responses without any valid token never leak
    adv, _ = compute_grpo_advantages(
        torch.tensor([1.0, NAN, 3.0]), torch.tensor([[1], [0], [1]]), torch.tensor([0, 0, 0])
    )
    assert torch.isfinite(adv).all() and adv[1].item() == 0.0


def test_rloo_hand_values():
    scores = t64([1.0, 2.0, 3.0, 5.0, 1.0, 4.0, 9.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 0])
    mask = torch.tensor([[1, 1]] * 6 + [[0, 0]])
    adv, ret = compute_rloo_advantages(scores, mask, groups)
    # group 0 = {1, 2, 3}: 1 - 2.5, 2 - 2, 3 - 1.5 ; group 1 = {5, 1}: +-4 ; group 2 alone: 0
    torch.testing.assert_close(adv[:, 0], t64([-1.5, 0.0, 1.5, 4.0, -4.0, 0.0, 0.0]), atol=1e-12, rtol=0)
    torch.testing.assert_close(adv, adv[:, :1] * mask, atol=0, rtol=0)
    torch.testing.assert_close(ret, adv, atol=0, rtol=0)


def _whiten_list(vals):
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    return [(x - mu) / math.sqrt(sd * sd + 1e-8) for x in vals]


def test_reinforce_pp_hand_values():
    r = t64([[0.0, 0.0, 1.0], [0.0, 2.0, NAN], [0.0, 9.0, 1.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    adv, ret = compute_reinforce_pp_advantages(r, m, gamma=0.5)
    # returns-to-go with gamma 0.5; the hole at row 3, t = 1 is skipped (not a step)
    expected_ret = t64([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0], [0.5, 0.0, 1.0]])
    torch.testing.assert_close(ret, expected_ret, atol=1e-12, rtol=0)
    w = _whiten_list([0.25, 0.5, 1.0, 1.0, 2.0, 0.5, 1.0])
    expected_adv = t64([[w[0], w[1], w[2]], [w[3], w[4], 0.0], [w[5], 0.0, w[6]]])
    torch.testing.assert_close(adv, expected_adv, atol=1e-12, rtol=0)


def test_reinforce_pp_baseline_hand_values():
    scores = t64([1.0, 3.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    adv, ret = compute_reinforce_pp_baseline_advantages(scores, m, groups)
    # minus group mean: (-1, +1, 0, 0), on every valid token, then whitened over the 9 valid tokens
    w = _whiten_list([-1.0, -1.0, 1.0] + [0.0] * 6)
    expected = t64([[w[0], w[1], 0.0], [w[2], 0.0, 0.0], [w[3], w[4], w[5]], [w[6], w[7], w[8]]])
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, adv, atol=0, rtol=0)


def test_group_estimator_errors():
    m = torch.ones(3, 2)
    with pytest.raises(ValueError, match="scores"):
        compute_grpo_advantages(torch.zeros(2), m, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="group_ids"):
        compute_rloo_advantages(torch.zeros(3), m, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        compute_grpo_advantages(torch.zeros(3), m, torch.zeros(3))
    with pytest.raises(ValueError, match="eps"):
        compute_grpo_advantages(torch.zeros(3), m, torch.zeros(3, dtype=torch.long), eps=-1.0)


# ---------------------------------------------------------------- registry


def _batch(g):
    b, t = 8, 6
    m = torch.rand(b, t, generator=g) > 0.25
    m[:, 0] = True
    kl = torch.rand(b, t, generator=g, dtype=F64)
    scores = torch.randint(0, 2, (b,), generator=g).to(F64)
    last = torch.where(m, torch.arange(t), -1).amax(-1)
    rewards = torch.where(m, -0.1 * kl, 0.0)
    rewards[torch.arange(b), last] += scores
    rewards = torch.where(m, rewards, NAN)  # garbage where masked
    values = torch.where(m, torch.randn(b, t, generator=g, dtype=F64), INF)
    return AdvantageInputs(rewards, m, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), values, 0.99, 0.95)


def test_registry_dispatches_with_one_input_type():
    inputs = _batch(torch.Generator().manual_seed(0))
    m = inputs.response_mask
    seq_scores = torch.where(m, inputs.token_level_rewards, 0.0).sum(-1)  # KL in the reward flows in
    expected = {
        "gae": compute_gae(inputs.token_level_rewards, inputs.values, m, 0.99, 0.95),
        "grpo": compute_grpo_advantages(seq_scores, m, inputs.group_ids),
        "drgrpo": compute_grpo_advantages(seq_scores, m, inputs.group_ids, norm_by_std=False),
        "rloo": compute_rloo_advantages(seq_scores, m, inputs.group_ids),
        "reinforce_plus_plus": compute_reinforce_pp_advantages(inputs.token_level_rewards, m, gamma=0.99),
        "reinforce_plus_plus_baseline": compute_reinforce_pp_baseline_advantages(seq_scores, m, inputs.group_ids),
    }
    assert set(ADVANTAGE_ESTIMATORS) == set(expected)
    for name, (adv_e, ret_e) in expected.items():
        adv, ret = compute_advantages(name, inputs)
        assert adv.shape == ret.shape == m.shape, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        assert (adv[~m] == 0).all() and (ret[~m] == 0).all(), name
        torch.testing.assert_close(adv, adv_e, atol=1e-12, rtol=0)
        torch.testing.assert_close(ret, ret_e, atol=1e-12, rtol=0)
    # norm_by_std="none" (or the old False) in the inputs turns grpo into drgrpo
    for off in ("none", False):
        inputs.norm_by_std = off
        torch.testing.assert_close(compute_advantages("grpo", inputs)[0], expected["drgrpo"][0], atol=0, rtol=0)
    inputs.norm_by_std = "batch"
    batch_std = compute_grpo_advantages(seq_scores, m, inputs.group_ids, norm_by_std="batch")[0]
    torch.testing.assert_close(compute_advantages("grpo", inputs)[0], batch_std, atol=0, rtol=0)


def test_registry_errors():
    inputs = _batch(torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="gae, grpo, drgrpo, rloo"):
        compute_advantages("ppo", inputs)
    inputs.values = None
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", inputs)
    inputs.group_ids = None
    for name in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="group_ids"):
            compute_advantages(name, inputs)


def test_zero_variance_groups_hand_values():
    # SCORES/GROUPS/MASK: group 17 = {1, 2, 3} differs (its empty row 100 does not take part);
    # -3 = {5, 5} all equal; 1000 and 4 have one member each
    flat = zero_variance_groups(SCORES, MASK, GROUPS)
    assert flat.tolist() == [False, False, False, True, True, True, True, True]


# --------------------------------------------------------------------------------------------
# A trajectory split into rows (agent.on_prefix_mismatch=split): counted once
# --------------------------------------------------------------------------------------------


def _split_batch():
    """Group 0: trajectory 0 in two pieces (rows 0, 1; row 1 has an observation token, masked), trajectories 1 and 2;
    group 1: trajectories 3 and 4. Token rewards as the trainer builds them: −β·KL on model tokens, a turn reward on
    row 0's last token, the score on each trajectory's last token. Totals per trajectory: 1.0, 0.0, 0.5, 2.0, 2.0."""
    r = t64(
        [
            [-0.1, 0.4, 0.0],  # trajectory 0, piece 1: −0.1 KL, then −0.1 KL + 0.5 turn reward: 0.3
            [-0.1, 9.0, 0.8],  # piece 2: −0.1 KL, an observation (masked: never read), −0.2 KL + 1.0 score: 0.7
            [0.3, -0.3, 0.0],  # trajectory 1: 0.0
            [0.5, 0.0, 0.0],  # trajectory 2: 0.5
            [1.0, 1.0, 0.0],  # trajectory 3: 2.0
            [2.0, 0.0, 0.0],  # trajectory 4: 2.0
        ]
    )
    m = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
    return r, m, torch.tensor([0, 0, 0, 0, 1, 1]), torch.tensor([0, 0, 1, 2, 3, 4])


@pytest.mark.parametrize(
    ("estimator", "norm", "want"),
    [
        # group 0's totals 1.0, 0.0, 0.5: mean 0.5, unbiased std 0.5; group 1 equal: 0
        ("grpo", "group", [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0, 0.0, 0.0]),
        ("drgrpo", "group", [0.5, -0.5, 0.0, 0.0, 0.0]),
        # batch std over the five totals (mean 1.1): sqrt((.01 + 1.21 + .36 + .81 + .81) / 4) = sqrt(.8)
        ("grpo", "batch", [0.5 / (0.8**0.5 + 1e-6), -0.5 / (0.8**0.5 + 1e-6), 0.0, 0.0, 0.0]),
        ("rloo", "group", [1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5, 0.0, 0.0]),  # x − mean of the others
    ],
)
def test_a_split_trajectory_counts_once_in_its_group_with_its_pieces_summed(estimator, norm, want):
    """Hand-worked: trajectory 0's score is its pieces' token rewards summed (KL, turn reward and score of both
    pieces: 1.0), it is one of group 0's three members (counted per piece the group would have four rows, mean
    0.375), and both pieces carry its advantage on every valid token."""
    r, m, g, traj = _split_batch()
    adv, ret = compute_advantages(
        estimator, AdvantageInputs(r, m, group_ids=g, norm_by_std=norm, eps=1e-6, trajectory=traj)
    )
    per_row = t64([want[0], want[0], *want[1:]])  # (B,): the trajectory's advantage on each of its rows
    assert torch.allclose(adv, per_row[:, None] * m, rtol=0, atol=1e-12)
    assert torch.equal(adv, ret) and adv.dtype == F64
    counted_per_piece, _ = compute_advantages(estimator, AdvantageInputs(r, m, group_ids=g, norm_by_std=norm))
    assert not torch.allclose(counted_per_piece, adv)  # the test tells the two apart


@pytest.mark.parametrize(
    ("estimator", "norm"),
    [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"), ("drgrpo", "group"), ("rloo", "group")]
    + [("reinforce_plus_plus_baseline", "group")],
)
def test_cutting_rows_into_pieces_leaves_every_tokens_advantage_unchanged(estimator, norm):
    """Each row of a random batch (float64, holes in the mask, an empty row, a group of one) is cut at random points
    into 1–3 pieces, rows of their own labelled by ``trajectory``: every token's advantage equals the uncut row's
    (reinforce_plus_plus_baseline whitens over the same tokens), to float64 rounding."""
    gen = torch.Generator().manual_seed(3)
    B, T = 9, 8
    r = torch.randn(B, T, generator=gen, dtype=F64)
    m = torch.rand(B, T, generator=gen) < 0.8
    m[4] = False  # an empty trajectory takes no part
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3])  # group 3 has one member: 0
    whole, _ = compute_advantages(estimator, AdvantageInputs(r, m, group_ids=g, norm_by_std=norm))
    rows, masks, groups, traj, where = [], [], [], [], []
    for b in range(B):
        cuts = sorted(torch.randperm(T - 1, generator=gen)[: b % 3].add(1).tolist())
        for lo, hi in zip([0, *cuts], [*cuts, T], strict=True):
            keep = torch.zeros(T, dtype=torch.bool)
            keep[lo:hi] = True
            rows.append(torch.where(keep, r[b], 0.0))
            masks.append(m[b] & keep)
            groups.append(int(g[b]))
            traj.append(b)
            where.append(keep)
    inputs = AdvantageInputs(
        torch.stack(rows),
        torch.stack(masks),
        group_ids=torch.tensor(groups),
        norm_by_std=norm,
        trajectory=torch.tensor(traj),
    )
    pieces, _ = compute_advantages(estimator, inputs)  # (pieces, T)
    assert len(traj) > B
    rebuilt = torch.zeros(B, T, dtype=F64).index_add_(0, torch.tensor(traj), pieces)  # each token in one piece
    assert torch.allclose(rebuilt, whole, rtol=0, atol=1e-12)
    assert float(whole.abs().sum()) > 1.0


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_return_to_go_estimators_refuse_rows_that_are_pieces_of_trajectories(estimator):
    r, m, g, traj = _split_batch()
    inputs = AdvantageInputs(r, m, group_ids=g, values=torch.zeros_like(r), trajectory=traj)
    with pytest.raises(ValueError, match=rf"{estimator}' runs its returns within a row.*outcome estimator"):
        compute_advantages(estimator, inputs)


def test_pieces_of_one_trajectory_in_two_groups_are_refused_naming_it():
    r, m, g, traj = _split_batch()
    g[1] = 5
    with pytest.raises(ValueError, match=r"trajectory 0 has pieces in groups 0 and 5"):
        compute_advantages("grpo", AdvantageInputs(r, m, group_ids=g, trajectory=traj))
