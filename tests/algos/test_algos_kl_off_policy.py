"""KL in the loss off-policy, by exact enumeration of a 5-action categorical in float64.

Tokens a ~ π_old; π_θ = softmax(θ) is being trained; the target is KL(π_θ‖π_ref) and its gradient with
respect to the logits θ, ∇KL = π_θ ⊙ (r − KL), r = log π_θ − log π_ref. For each estimator the
expected value Σ_a π_old(a)·L(a) and the expected gradient Σ_a π_old(a)·∇L(a) are enumerated exactly,
L computed by tether's own functions and differentiated by autograd.
"""

from __future__ import annotations

import math

import pytest
import torch

from tether.algos import kl_loss, kl_penalty, off_policy_kl_penalty

F64 = torch.float64  # every tensor of this module is float64

REF = torch.tensor([0.3, -0.5, 1.1, 0.0, -1.2], dtype=torch.float64)  # π_ref's logits
OLD = REF + torch.tensor([0.4, 0.2, -0.6, 0.5, -0.1], dtype=torch.float64)  # π_old: the sampling policy
DIRECTION = torch.tensor([0.7, -0.9, 0.3, -0.4, 0.8], dtype=torch.float64)  # θ = OLD + s·DIRECTION
A = 5
#: k3 = e^{-r} + r − 1 is evaluated by its Taylor series for |r| < 0.1 (exact to ~1e-9 relative, tether.algos.kl._k3)
K3_ATOL = 1e-9


def logp(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1)


def exact_kl_and_grad(theta: torch.Tensor) -> tuple[float, torch.Tensor]:
    lp, lr = logp(theta), logp(REF)
    p = lp.exp()
    r = lp - lr
    kl = float((p * r).sum())
    return kl, p * (r - kl)  # ∂KL/∂θ_j = π_j (r_j − KL)


def expectation(term, theta: torch.Tensor, old: torch.Tensor = OLD) -> tuple[float, torch.Tensor]:
    """(Σ_a π_old(a) L(a), Σ_a π_old(a) ∇_θ L(a)) with L(a) = term(lp_a, ref_a, old_a), each a (1, 1) tensor."""
    th = theta.clone().requires_grad_(True)
    lp = logp(th)  # (A,)
    lref, lold = logp(REF), logp(old)
    p_old = lold.exp()
    total = th.new_zeros(())
    for a in range(A):
        total = total + p_old[a] * term(lp[a].view(1, 1), lref[a].view(1, 1), lold[a].view(1, 1)).sum()
    (grad,) = torch.autograd.grad(total, th)
    return float(total.detach()), grad


def rel_bias(g: torch.Tensor, target: torch.Tensor) -> float:
    return float((g - target).norm() / target.norm())


def theta_at(s: float) -> torch.Tensor:
    return OLD + s * DIRECTION


def corrected(estimator: str):
    return lambda lp, ref, old: off_policy_kl_penalty(lp, ref, old, estimator, log_ratio_clamp=None, value_clamp=None)


def plain(estimator: str):
    return lambda lp, ref, old: kl_penalty(lp, ref, estimator, log_ratio_clamp=None, value_clamp=None)


# -------------------------------------------------------------------------------------------- ratio: exact

STEPS = [0.0, 0.25, 0.5, 1.0, 2.0]  # s = 0 is on-policy (θ = θ_old)
GRADIENT_EXACT = ["k1", "k3", "low_var_kl", "kl", "k2", "mse", "k1+", "k3+", "low_var_kl+", "k2+", "abs+"]
VALUE_EXACT = ["k1", "k3", "low_var_kl", "kl", "k1+", "k3+", "low_var_kl+"]


@pytest.mark.parametrize("s", STEPS)
@pytest.mark.parametrize("estimator", GRADIENT_EXACT)
def test_ratio_correction_gives_the_exact_kl_gradient_on_and_off_policy(estimator, s):
    theta = theta_at(s)
    _, target = exact_kl_and_grad(theta)
    _, g = expectation(corrected(estimator), theta)
    assert rel_bias(g, target) <= 1e-6
    assert torch.allclose(g, target, rtol=0, atol=K3_ATOL)


@pytest.mark.parametrize("s", STEPS)
@pytest.mark.parametrize("estimator", VALUE_EXACT)
def test_ratio_correction_gives_the_exact_kl_value(estimator, s):
    theta = theta_at(s)
    kl, _ = exact_kl_and_grad(theta)
    value, _ = expectation(corrected(estimator), theta)
    assert value == pytest.approx(kl, rel=K3_ATOL, abs=1e-15)


@pytest.mark.parametrize("estimator", ["k2", "k2+"])
def test_ratio_corrected_k2_value_is_k2s_bias_under_pi_theta(estimator):
    """k2's value is E_{π_θ}[½r²], not the KL (its bias on-policy too); the ratio moves it to π_θ, exactly."""
    theta = theta_at(1.0)
    p, r = logp(theta).exp(), logp(theta) - logp(REF)
    value, _ = expectation(corrected(estimator), theta)
    assert value == pytest.approx(float((p * 0.5 * r * r).sum()), rel=1e-12)
    assert value != pytest.approx(exact_kl_and_grad(theta)[0], rel=1e-3)


def test_ratio_corrected_abs_is_the_gradient_of_expected_abs_log_ratio():
    """abs gets the differentiable ratio: value E_{π_θ}|r| and its gradient π ⊙ (h − E_π h), h = |r| + sign r."""
    theta = theta_at(0.5)
    p, r = logp(theta).exp(), logp(theta) - logp(REF)
    h = r.abs() + r.sign()
    value, g = expectation(corrected("abs"), theta)
    assert value == pytest.approx(float((p * r.abs()).sum()), rel=1e-12)
    assert torch.allclose(g, p * (h - (p * h).sum()), rtol=0, atol=1e-12)


# -------------------------------------------------------------------------------------------- none: verl's, biased


def hand_plain_gradient(estimator: str, theta: torch.Tensor) -> torch.Tensor:
    """E_{a~π_old}[∇_θ L(a)] of the plain estimator, from ∇log π_θ(a) = e_a − π_θ (no autograd)."""
    p_old, p, ref = logp(OLD).exp(), logp(theta).exp(), logp(REF).exp()
    r = logp(theta) - logp(REF)
    dlogp = torch.eye(A, dtype=F64) - p[None, :]  # row a: ∇_θ log π_θ(a)
    per_token = {
        "k1": torch.ones(A, dtype=F64),  # ∂k1/∂log π = 1
        "k3": 1 - ref / p,  # ∂k3/∂log π = 1 − e^{-r}
        "k2": r,  # ∂k2/∂log π = r; also every `+`
    }[estimator]
    return (p_old * per_token) @ dlogp


@pytest.mark.parametrize("estimator,kind", [("k1", "k1"), ("k3", "k3"), ("k2", "k2"), ("k3+", "k2"), ("k1+", "k2")])
@pytest.mark.parametrize("s", STEPS)
def test_plain_estimator_gradient_equals_the_hand_computed_biased_value(estimator, kind, s):
    theta = theta_at(s)
    _, g = expectation(plain(estimator), theta)
    assert torch.allclose(g, hand_plain_gradient(kind, theta), rtol=0, atol=K3_ATOL)


def test_plain_k3_on_policy_is_the_gradient_of_the_forward_kl():
    """On-policy, plain k3's expected gradient is ∇KL(π_ref‖π_θ) = π_θ − π_ref (w.r.t. the logits), not
    ∇KL(π_θ‖π_ref)."""
    theta = OLD
    _, g = expectation(plain("k3"), theta)
    assert torch.allclose(g, logp(theta).exp() - logp(REF).exp(), rtol=0, atol=1e-12)
    _, target = exact_kl_and_grad(theta)
    assert rel_bias(g, target) > 0.1


def test_plain_k1_has_no_expected_gradient_on_policy():
    _, g = expectation(plain("k1"), OLD)
    assert torch.allclose(g, torch.zeros(A, dtype=F64), atol=1e-15)


@pytest.mark.parametrize("estimator", ["k2", "k3+", "k1+"])
def test_plain_gradient_estimators_are_exact_on_policy_only(estimator):
    _, target0 = exact_kl_and_grad(OLD)
    _, g0 = expectation(plain(estimator), OLD)
    assert rel_bias(g0, target0) <= 1e-12
    theta = theta_at(1.0)
    _, target = exact_kl_and_grad(theta)
    _, g = expectation(plain(estimator), theta)
    assert rel_bias(g, target) == pytest.approx(rel_bias(hand_plain_gradient("k2", theta), target), rel=1e-9)
    assert rel_bias(g, target) > 0.05


# -------------------------------------------------------------------------------------------- the issue's table


def issue_table_rows() -> list[tuple[float, float, float]]:
    """(approx_kl(π_old, π_θ), rel. bias of plain k3+, rel. bias of plain k3) along θ = θ_old + s·d: the
    shape of issue 20's table (its distributions were not given; these are this module's)."""
    rows = []
    for s in STEPS:
        theta = theta_at(s)
        p_old = logp(OLD).exp()
        approx_kl = float((p_old * (logp(OLD) - logp(theta))).sum())  # E_{π_old}[log π_old − log π_θ]
        _, target = exact_kl_and_grad(theta)
        rows.append(
            (
                approx_kl,
                rel_bias(hand_plain_gradient("k2", theta), target),
                rel_bias(hand_plain_gradient("k3", theta), target),
            )
        )
    return rows


def test_the_none_bias_table_on_this_modules_distributions():
    """kl.off_policy_correction=none: the relative bias grows with the distance to π_old for k3+ (0 on-policy)
    and is > 0 on-policy for k3; these are the numbers docs/training.md quotes, worked out by hand above."""
    rows = issue_table_rows()
    expected = [  # (approx_kl, k3+, k3), float64 from the hand formulas; rounded here to 4 digits
        (0.0, 0.0, 0.1572),
        (0.0100, 0.1061, 0.1480),
        (0.0388, 0.1743, 0.2114),
        (0.1452, 0.2761, 0.4517),
        (0.4979, 0.8843, 3.2359),
    ]
    for got, want in zip(rows, expected, strict=True):
        assert got == pytest.approx(want, abs=5e-5)
    for s in STEPS:  # with the ratio every row's bias is 0
        theta = theta_at(s)
        _, target = exact_kl_and_grad(theta)
        for est in ("k3", "k3+"):
            assert rel_bias(expectation(corrected(est), theta)[1], target) <= 1e-6


# -------------------------------------------------------------------------------------------- the clamp's cost


def test_the_ratio_clamp_costs_exactly_the_clipped_mass():
    """With |log ρ| > c on some actions, E[ρ_c·k3] = Σ π_old(a)·clamp(ρ_a, e^-c, e^c)·k3_a (hand value), so the
    value is off by Σ π_old (ρ − ρ_c) k3; with c = 20 (the default) nothing here is clipped and it is exact."""
    theta = theta_at(2.0)
    c = 0.3
    lp, lold = logp(theta), logp(OLD)
    log_rho = lp - lold
    assert bool((log_rho.abs() > c).any()) and bool((log_rho.abs() < c).any())
    r = lp - logp(REF)
    k3 = torch.exp(-r) + r - 1
    rho_c = log_rho.clamp(-c, c).exp()
    p_old = lold.exp()
    value, _ = expectation(
        lambda a, b, o: off_policy_kl_penalty(
            a, b, o, "k3", log_ratio_clamp=None, value_clamp=None, is_log_ratio_clamp=c
        ),
        theta,
    )
    assert value == pytest.approx(float((p_old * rho_c * k3).sum()), rel=1e-12)
    kl, _ = exact_kl_and_grad(theta)
    assert kl - value == pytest.approx(float((p_old * (log_rho.exp() - rho_c) * k3).sum()), rel=1e-9)
    default, _ = expectation(corrected("k3"), theta)
    assert default == pytest.approx(kl, rel=1e-12)


def test_the_k3_value_clamp_costs_the_clamped_tokens_gradient_and_never_reverses_it():
    """k3 clamped at c = 10 (verl's default) on three actions where π_ref/π_θ(a0) = 22.5 > 13.6, so k3(a0) = 18.4 is
    held at 10. Hand values: E_{π_old}[value] = Σ π_θ·min(k3, c); the clamped token carries no gradient (ρ
    detached there), so E[gradient] = ∇_θ Σ_{a unclamped} π_θ(a)·k3_a, the same on- and off-policy. Before, a
    differentiable ρ times the constant c gave 10·∇π_θ(a0): the expected gradient was −1.44 times the KL's, a KL
    loss pushing π_θ away from π_ref. With value_clamp=None the term is exact."""
    ref = torch.log(torch.tensor([0.90, 0.05, 0.05], dtype=F64))
    theta = torch.log(torch.tensor([0.04, 0.48, 0.48], dtype=F64))
    c = 10.0

    def enumerate_(old: torch.Tensor, value_clamp):
        th = theta.clone().requires_grad_(True)
        lp, lold = torch.log_softmax(th, -1), torch.log_softmax(old, -1)
        total = th.new_zeros(())
        for a in range(3):
            term = off_policy_kl_penalty(
                lp[a].view(1, 1), ref[a].view(1, 1), lold[a].view(1, 1), "k3", value_clamp=value_clamp
            )
            total = total + lold[a].exp() * term.sum()
        (grad,) = torch.autograd.grad(total, th)
        return float(total.detach()), grad

    # hand values, written without tether: k3 = e^{-r} + r − 1, r = log π_θ − log π_ref
    th = theta.clone().requires_grad_(True)
    p = torch.softmax(th, -1)
    r = torch.log(p) - ref
    k3 = torch.exp(-r) + r - 1
    clamped = (k3 > c).detach()
    assert clamped.tolist() == [True, False, False] and float(k3[0]) == pytest.approx(18.3865, abs=1e-4)
    want_value = float((p * k3.clamp(max=c)).sum())
    (want_grad,) = torch.autograd.grad((p * torch.where(clamped, torch.zeros_like(k3), k3)).sum(), th)
    kl = float((p * r).sum())
    exact_grad = (p * (r - kl)).detach()
    for old in (theta, torch.log(torch.tensor([0.2, 0.4, 0.4], dtype=F64))):  # on-policy, then off-policy
        value, grad = enumerate_(old, c)
        assert value == pytest.approx(want_value, rel=1e-12)
        torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=0)
        # the bias, stated: 0.42 of the KL's gradient along it here, the same direction
        assert float(grad @ exact_grad / exact_grad.norm() ** 2) == pytest.approx(0.4208, abs=1e-4)
        value, grad = enumerate_(old, None)
        assert value == pytest.approx(kl, rel=1e-12)
        torch.testing.assert_close(grad, exact_grad, atol=1e-12, rtol=0)


# -------------------------------------------------------------------------------------------- kl_loss


def test_kl_loss_with_old_logprobs_equal_to_current_keeps_the_plain_value():
    """On-policy (old = π_θ's own, detached) ρ = 1 in the forward pass: the loss value is the plain estimator's."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 4, generator=g, dtype=F64) - 2
    ref = lp + 0.3 * torch.randn(3, 4, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    plain_loss, _ = kl_loss(lp, ref, mask, "k3")
    ratio_loss, _ = kl_loss(lp, ref, mask, "k3", old_logprobs=lp.detach())
    assert float(ratio_loss) == pytest.approx(float(plain_loss), rel=1e-14)


def test_kl_loss_weights_multiply_each_token_and_padding_stays_out():
    lp = torch.tensor([[-1.0, -2.0, float("-inf")]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, float("-inf")]], dtype=F64)
    old = torch.tensor([[-1.2, -2.0, float("-inf")]], dtype=F64)
    w = torch.tensor([[2.0, 0.5, float("nan")]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    loss, _ = kl_loss(lp, ref, mask, "k1", old_logprobs=old, weights=w)
    # token 0: ρ = e^{0.2}, k1 = 0.5; token 1: ρ = 1, k1 = -1; token-mean over 2
    want = (2.0 * math.exp(0.2) * 0.5 + 0.5 * 1.0 * -1.0) / 2
    assert float(loss) == pytest.approx(want, rel=1e-12)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    # ∂/∂lp_0 of w ρ k1 = w ρ (k1 + 1); ∂/∂lp_1 = w (k1 + 1)
    assert lp.grad[0, :2].tolist() == pytest.approx([2.0 * math.exp(0.2) * 1.5 / 2, 0.5 * 0.0 / 2], abs=1e-12)


def test_off_policy_kl_penalty_refuses_bad_input():
    x = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="old_logprobs"):
        off_policy_kl_penalty(x, x, torch.zeros(2, 2), "k3")
    with pytest.raises(ValueError, match="is_log_ratio_clamp"):
        off_policy_kl_penalty(x, x, x, "k3", is_log_ratio_clamp=0)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        off_policy_kl_penalty(x, x, x, "k4")
