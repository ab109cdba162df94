"""tether.algos.kl: estimators, straight-through gradients, float32 extremes, KL in the reward."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.algos import (
    KL_ESTIMATORS,
    LOGPROB_KL_ESTIMATORS,
    apply_kl_penalty,
    canonical_kl_estimator,
    kl_full,
    kl_penalty,
    last_valid_index,
    mean_kl_per_token,
    token_level_rewards_from_kl,
)

F64 = torch.float64
LP = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=F64)
REF = torch.tensor([[-1.5, -1.0, -0.5, -3.001]], dtype=F64)
R = [0.5, -1.0, 0.0, 0.001]  # log pi - log pi_ref, worked by hand


def _expected(base):
    if base == "k1":
        return [r for r in R]
    if base == "abs":
        return [abs(r) for r in R]
    if base == "k2":
        return [0.5 * r * r for r in R]
    return [math.exp(-r) + r - 1 for r in R]


@pytest.mark.parametrize(
    "name,base",
    [
        ("k1", "k1"),
        ("kl", "k1"),
        ("abs", "abs"),
        ("k2", "k2"),
        ("mse", "k2"),
        ("k3", "k3"),
        ("low_var_kl", "k3"),
    ],
)
def test_estimators_hand_values(name, base):
    expected = torch.tensor([_expected(base)], dtype=F64)
    torch.testing.assert_close(kl_penalty(LP, REF, name), expected, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(kl_penalty(LP, REF, name + "+"), expected, atol=1e-12, rtol=1e-9)


def test_k3_hand_values_literal():
    # e^-0.5 - 0.5 and e - 2, written out
    out = kl_penalty(LP, REF, "k3")
    assert out[0, 0].item() == pytest.approx(0.10653065971263342, abs=1e-12)
    assert out[0, 1].item() == pytest.approx(0.7182818284590451, abs=1e-12)


def test_names_and_errors():
    assert canonical_kl_estimator("kl") == "k1"
    assert canonical_kl_estimator("mse") == "k2"
    assert canonical_kl_estimator("low_var_kl") == "k3"
    assert canonical_kl_estimator("low_var_kl+") == "k3+"
    assert canonical_kl_estimator("full") == "full"
    assert "full" in KL_ESTIMATORS and "full" not in LOGPROB_KL_ESTIMATORS
    assert set(LOGPROB_KL_ESTIMATORS) == {
        *("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"),
        *("k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+"),
    }
    with pytest.raises(ValueError, match="k3.*low_var_kl"):
        kl_penalty(LP, REF, "k4")
    with pytest.raises(ValueError, match="kl_full"):
        kl_penalty(LP, REF, "full")
    with pytest.raises(ValueError, match="valid names"):
        canonical_kl_estimator("nope")
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(LP, REF[:, :2])
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        kl_penalty(LP, REF, log_ratio_clamp=0.0)


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_straight_through_has_forward_of_named_and_gradient_of_k2(base):
    lp = torch.tensor([[-1.0, -2.0, -0.3, -4.0, -0.7]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.3, -2.0, -0.9]], dtype=F64, requires_grad=True)
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]], dtype=F64)
    out = kl_penalty(lp, ref, base + "+")
    assert torch.equal(out.detach(), kl_penalty(lp, ref, base).detach())  # exactly the named estimator
    (out * w).sum().backward()
    r = (lp - ref).detach()
    torch.testing.assert_close(lp.grad, w * r, atol=1e-12, rtol=0)  # d(½ r²)/d log pi = r
    torch.testing.assert_close(ref.grad, -w * r, atol=1e-12, rtol=0)
    # ... which is the autograd gradient of k2 itself
    lp2 = lp.detach().clone().requires_grad_(True)
    (kl_penalty(lp2, ref.detach(), "k2") * w).sum().backward()
    torch.testing.assert_close(lp.grad, lp2.grad, atol=1e-12, rtol=0)


def test_plain_k1_gradient_is_not_k2s():
    # guards the test above: without '+', k1's gradient is 1, not r
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    kl_penalty(lp, torch.tensor([[-1.5, -1.0]], dtype=F64), "k1").sum().backward()
    torch.testing.assert_close(lp.grad, torch.ones_like(lp))


def _exact_kl_grad(theta, ref_logits):
    t = theta.detach().clone().requires_grad_(True)
    kl_full(t[None, None], ref_logits[None, None]).sum().backward()
    return t.grad


def test_k2_gradient_is_the_unbiased_kl_gradient_under_sampling():
    """E_{a~pi}[grad k2(a)] = grad KL(pi || pi_ref): check by Monte Carlo against the exact gradient."""
    g = torch.Generator().manual_seed(0)
    theta = torch.tensor([0.3, -0.2, 1.0, 0.0, -1.0], dtype=F64)
    ref_logits = torch.tensor([0.0, 0.5, -0.5, 0.2, 0.1], dtype=F64)
    n = 200_000
    a = torch.multinomial(torch.softmax(theta, -1), n, replacement=True, generator=g)  # (n,) fixed samples
    exact = _exact_kl_grad(theta, ref_logits)

    def mc_grad(name):
        t = theta.clone().requires_grad_(True)
        lp = torch.log_softmax(t, -1)[a][None]  # (1, n)
        ref = torch.log_softmax(ref_logits, -1)[a][None]
        kl_penalty(lp, ref, name).mean().backward()
        return t.grad

    for name in ("k3+", "k1+", "k2"):
        torch.testing.assert_close(mc_grad(name), exact, atol=6e-3, rtol=0)
    # k3 without '+' follows the gradient of the reverse KL(pi_ref || pi) instead: far off here
    assert (mc_grad("k3") - exact).abs().max() > 0.05


EXTREMES = [1e30, -1e30, math.inf, -math.inf, 0.0, 88.0, -88.0, 1e-30, 3.4e38, -3.4e38, 20.0, -20.0]


@pytest.mark.parametrize("name", LOGPROB_KL_ESTIMATORS)
def test_float32_extreme_log_ratios_give_exact_values_and_finite_gradients(name):
    vals = torch.tensor(EXTREMES, dtype=torch.float32)
    lp = torch.cat([vals, torch.zeros_like(vals)])[None].clone().requires_grad_(True)
    ref = torch.cat([torch.zeros_like(vals), vals])[None]
    out = kl_penalty(lp, ref, name)
    assert out.dtype == torch.float32
    r = (lp - ref).detach().double()
    base = canonical_kl_estimator(name).rstrip("+")
    if base == "k3":  # the clamped estimator stays finite and within value_clamp
        assert torch.isfinite(out).all() and (out.abs() <= 10).all()
    else:  # k1, abs, k2 are the exact estimator (inf where r is inf or 1/2 r^2 overflows float32)
        exact = {"k1": r, "abs": r.abs(), "k2": 0.5 * r * r}[base].clamp(-3.5e38, 3.5e38)
        # 1/2 (1e-30)^2 underflows to 0
        torch.testing.assert_close(out.double().clamp(-3.5e38, 3.5e38), exact, rtol=1e-6, atol=1e-30)
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()


KL_GRAD_LP = torch.tensor([[-25.0, -1.0, -1.0, -40.0]])
KL_GRAD_REF = torch.tensor([[-50.0, -1.5, -26.0, -1.0]])  # r = [25, 0.5, 25, -39]: three past the +-20 clamp


@pytest.mark.parametrize(
    "name,grad",
    [  # d estimator / d log pi at r = [25, 0.5, 25, -39], worked by hand
        ("k3+", [25.0, 0.5, 25.0, -39.0]),  # the issue's repro: k2's gradient r, not 0 past the clamp
        ("k1+", [25.0, 0.5, 25.0, -39.0]),
        ("abs+", [25.0, 0.5, 25.0, -39.0]),
        ("k2", [25.0, 0.5, 25.0, -39.0]),
        ("k2+", [25.0, 0.5, 25.0, -39.0]),
        ("k1", [1.0, 1.0, 1.0, 1.0]),
        ("abs", [1.0, 1.0, 1.0, -1.0]),
        # k3 = e^-r + r - 1, gradient 1 - e^-r = 1 - e^-0.5 at r = 0.5; past the log-ratio clamp
        # (r = 25) and past the value clamp (k3(-39) = e^39 - 40 > 10) it has none, as in verl
        ("k3", [0.0, 1.0 - math.exp(-0.5), 0.0, 0.0]),
    ],
)
def test_gradient_past_the_log_ratio_clamp(name, grad):
    lp = KL_GRAD_LP.clone().requires_grad_(True)
    kl_penalty(lp, KL_GRAD_REF, name).sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([grad]), rtol=1e-6, atol=1e-7)


def test_issue_repro_k3_plus_gradient_is_r():
    lp = torch.tensor([[-25.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-50.0, -1.5]])
    kl_penalty(lp, ref, "k3+").sum().backward()
    assert lp.grad.tolist() == [[25.0, 0.5]]


def test_straight_through_gradient_is_zero_where_the_log_ratio_is_infinite():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-math.inf, -1.0]])  # r = [+inf, -1]
    out = kl_penalty(lp, ref, "k3+")
    assert out[0, 0].item() == 10.0  # k3's value is clamped; its gradient has nowhere finite to point
    out.sum().backward()
    assert lp.grad.tolist() == [[0.0, -1.0]]
    assert kl_penalty(lp.detach(), ref, "k1")[0, 0].item() == math.inf  # k1 is exact: KL is infinite there


def test_clamps_are_visible_and_match_verl_defaults():
    lp, ref = torch.tensor([[25.0, -25.0]], dtype=F64), torch.zeros(1, 2, dtype=F64)
    # the log-ratio clamp applies only inside k3 (verl): k1 and k2 are exact past it
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([[25.0, -25.0]], dtype=F64))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([[312.5, 312.5]], dtype=F64))
    # k3 at r = -20 is e^20 - 21, clamped to 10; at r = +20 it is e^-20 + 19, clamped to 10
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([[10.0, 10.0]], dtype=F64))
    # with the value clamp off, k3 at r = 25 is evaluated at the log-ratio clamp: e^-20 + 19
    k3_r25 = kl_penalty(lp[:, :1], ref[:, :1], "k3", value_clamp=None).item()
    assert k3_r25 == pytest.approx(math.exp(-20) + 19, abs=1e-12)
    small = kl_penalty(torch.tensor([[2.0]], dtype=F64), torch.zeros(1, 1, dtype=F64), "k3", value_clamp=None)
    assert small.item() == pytest.approx(math.exp(-2) + 1, abs=1e-12)


def test_k3_is_accurate_and_nonnegative_near_zero_in_float32():
    r = torch.tensor([1e-8, 3e-8, -3e-8, 1e-4, -1e-4, 0.0999, -0.0999, 0.1, -0.1, 0.5], dtype=torch.float32)
    out = kl_penalty(r[None], torch.zeros(1, r.numel()), "k3")[0].double()
    exact = torch.tensor([math.expm1(-x) + x for x in r.double().tolist()], dtype=F64)
    for x in r.double().tolist():  # cross-check the float64 reference with the series where expm1 cancels
        if abs(x) < 1e-3:
            assert math.expm1(-x) + x == pytest.approx(x * x / 2 - x**3 / 6, rel=1e-6, abs=1e-30)
    assert (out >= 0).all()
    torch.testing.assert_close(out, exact, rtol=2e-6, atol=1e-30)


finite32 = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(finite32, finite32), min_size=1, max_size=16))
def test_property_k2_k3_nonnegative(pairs):
    lp = torch.tensor([[p for p, _ in pairs]], dtype=torch.float32)
    ref = torch.tensor([[q for _, q in pairs]], dtype=torch.float32)
    for name in ("k2", "k3", "abs", "k2+", "k3+"):
        out = kl_penalty(lp, ref, name)
        assert torch.isfinite(out).all() and (out >= 0).all(), name


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(finite32, min_size=1, max_size=16))
def test_property_every_estimator_is_zero_where_pi_equals_ref(vals):
    lp = torch.tensor([vals], dtype=torch.float32)
    for name in LOGPROB_KL_ESTIMATORS:
        assert (kl_penalty(lp, lp.clone(), name) == 0).all(), name


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    st.lists(st.floats(-3, 3), min_size=2, max_size=6).flatmap(
        lambda p: st.tuples(st.just(p), st.lists(st.floats(-3, 3), min_size=len(p), max_size=len(p)))
    ),
    st.integers(0, 2**31 - 1),
)
def test_property_sample_means_of_k1_and_k3_approach_exact_kl(logits, seed):
    p_logits, q_logits = (torch.tensor(v, dtype=F64) for v in logits)
    exact = kl_full(p_logits[None, None], q_logits[None, None]).item()
    logp, logq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    n = 40_000
    a = torch.multinomial(logp.exp(), n, replacement=True, generator=torch.Generator().manual_seed(seed))
    for name in ("k1", "k3"):
        est = kl_penalty(logp[a][None], logq[a][None], name, log_ratio_clamp=None, value_clamp=None)[0]
        se = est.std().item() / math.sqrt(n)
        assert abs(est.mean().item() - exact) <= 5 * se + 1e-9, (name, est.mean().item(), exact, se)


# ---------------------------------------------------------------- KL in the reward


def test_last_valid_index():
    m = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert last_valid_index(m).tolist() == [1, 2, -1, 3]


def test_token_level_rewards_hand_values():
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)
    kl = torch.tensor(
        [
            [0.1, 0.2, math.inf, math.nan],
            [0.5, math.nan, -0.5, 9.0],
            [7.0, 7.0, 7.0, 7.0],
            [0.0, 0.1, 0.2, 0.3],
        ],
        dtype=F64,
    )
    m = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = token_level_rewards_from_kl(scores, kl, m, 0.5)
    expected = torch.tensor(
        [
            [-0.05, 1.0 - 0.1, 0.0, 0.0],  # score on the last valid token, never one past it
            [-0.25, 0.0, 2.0 + 0.25, 0.0],  # a hole in the middle: the score still goes to t = 2
            [0.0, 0.0, 0.0, 0.0],  # no valid token: nowhere to put the score
            [0.0, -0.05, -0.1, 4.0 - 0.15],  # full row: the last column
        ],
        dtype=F64,
    )
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="coef"):
        token_level_rewards_from_kl(scores, kl, m, -0.1)
    with pytest.raises(ValueError, match="scores"):
        token_level_rewards_from_kl(scores[:2], kl, m, 0.1)


def test_apply_kl_penalty_is_pure_and_ignores_masked_garbage():
    scores = torch.tensor([1.0, -1.0])
    lp = torch.tensor([[-1.0, -2.0, -math.inf], [-0.5, -0.7, math.nan]])
    ref = torch.tensor([[-1.5, -1.0, -math.inf], [-0.5, -0.2, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    copies = [t.clone() for t in (scores, lp, ref, m)]
    out = apply_kl_penalty(scores, lp, ref, m, 0.1, "k1")
    for before, after in zip(copies, (scores, lp, ref, m), strict=True):
        assert torch.equal(before.nan_to_num(), after.nan_to_num())
    expected = torch.tensor([[-0.05, 1.0 + 0.1, 0.0], [0.0, -1.0 + 0.05, 0.0]])  # r = 0.5, -1 | 0, -0.5
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    k3 = apply_kl_penalty(scores, lp, ref, m, 0.1, "low_var_kl")
    assert k3[0, 0].item() == pytest.approx(-0.1 * (math.exp(-0.5) + 0.5 - 1), abs=1e-7)


def test_mean_kl_per_token_is_mean_over_tokens_then_responses():
    kl = torch.tensor([[1.0, 2.0, math.inf], [3.0, math.nan, 5.0], [9.0, 9.0, 9.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert mean_kl_per_token(kl, m).item() == pytest.approx((1.5 + 3.0) / 2, abs=1e-7)
    assert mean_kl_per_token(kl, torch.zeros(3, 3)).item() == 0.0
