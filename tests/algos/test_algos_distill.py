"""On-policy distillation's per-token reward −λ·k1, by exact enumeration of a three-step sequence model in float64.

The "sequence model" is tabular: a response is y = (a_1, a_2, a_3), each a_t ∈ {0, 1, 2} (27 responses, no EOS),
and π_θ(·|s_t) = softmax(θ[s_t]) with one logit vector per prefix s_t = a_<t (1 + 3 + 9 = 13 prefixes). The teacher
π_T is another fixed table. Every expectation below is the exact sum over the 27 responses, weighted by their
probability; the per-token k1, the reward and the return-to-go come from tether's own functions
(:func:`tether.algos.distill_k1`, :func:`tether.algos.subtract_token_penalty`,
:func:`tether.algos.reverse_discounted_cumsum`), gradients from autograd.

What holds (the claims of ``tether.algos.distill``):

* under a_t ~ π_old(·|s_t), E[k1_t | s_t] = KL(π_old(·|s_t) ‖ π_T(·|s_t)), and E_{y~π_old}[Σ_t k1_t] =
  KL_seq(π_old ‖ π_T): unbiased, per state and per response;
* on-policy (π_old = π_θ, k1 held constant as a reward), the expected REINFORCE gradient with return-to-go
  G_t = Σ_{u≥t} −λ·k1_u is −λ·∇_θ KL_seq(π_θ ‖ π_T), exactly.

What does not hold (checked to fail by a clear margin):

* off-policy without a ratio: responses sampled from another policy μ ≠ π_θ (an older policy's, a dataset's),
  with k1 = log μ − log π_T and no importance weight, give an expected gradient that is not −λ·∇KL_seq(π_θ ‖ π_T);
  with the sequence-level weight π_θ(y)/μ(y) and k1 measured under π_θ it is exact again. (tether's async batches
  carry the behaviour policy's own log-probs; the PPO ratio there is per token, which corrects the action at each
  visited state but not the distribution of states: exact only at θ = θ_behaviour.)
* the per-token mean (``distill/kl_student_teacher``) is a ratio of per-response averages, not an unbiased estimate
  of anything when lengths vary; ``distill/kl_student_teacher_seq`` is the unbiased one. Here lengths are fixed.

The full-vocabulary estimators (``reverse``, ``forward``, ``jsd``, :func:`tether.algos.distill_divergence`) on the same
model, D(θ) = E_{y~π_θ}[Σ_t f(π_θ(·|s_t), π_T(·|s_t))] enumerated exactly:

* on-policy, the loss term λ·Σ_t f_t(θ) plus the reward −λ·f_t (detached, at θ_old) with return-to-go has expected
  gradient −λ·∇D(θ), for each f and with the teacher's top-k renormalised; the loss term alone does not (the gap is
  the state-visitation part);
* off-policy (y ~ μ ≠ π_θ) the sequence weight π_θ(y)/μ(y) on both parts, f at θ, makes it exact; PPO's per-token
  ratio with f frozen at μ = π_old is exact at θ = θ_old only, and its error grows linearly in θ − θ_old;
* top-k: the unrenormalised truncated reverse KL is lowered, below 0, by the student shrinking its mass on the
  teacher's top k (verl PR #5041's failure); the renormalised one is unchanged by it, and ignores that mass.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tether.algos import (
    distill_divergence,
    distill_k1,
    reverse_discounted_cumsum,
    sequence_kl_mean,
    subtract_token_penalty,
)

F64 = torch.float64
V, T = 3, 3
PREFIXES = [p for n in range(T) for p in itertools.product(range(V), repeat=n)]  # 13 prefixes, () first
INDEX = {p: i for i, p in enumerate(PREFIXES)}
RESPONSES = list(itertools.product(range(V), repeat=T))  # 27
LAMBDA = 0.7
#: every quantity is a sum of 27 float64 products of O(1) terms: round-off is ~1e-15; 1e-12 leaves margin
ATOL = 1e-12


def table(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(len(PREFIXES), V, generator=g, dtype=F64)


THETA = table(0)
TEACHER = table(1, scale=1.5)
MU = THETA + table(2, scale=0.6)  # another sampling policy (an older student, a dataset)


def token_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """(27, T): log π(a_t | a_<t) of each response's tokens under the table ``logits``."""
    lp = torch.log_softmax(logits, dim=-1)
    rows = [torch.stack([lp[INDEX[y[:t]], y[t]] for t in range(T)]) for y in RESPONSES]
    return torch.stack(rows)


def kl_seq(theta: torch.Tensor, teacher: torch.Tensor = TEACHER) -> torch.Tensor:
    """The exact KL_seq(π_θ ‖ π_T) = Σ_y π_θ(y) (log π_θ(y) − log π_T(y)), nats per response."""
    lp, lt = token_logprobs(theta).sum(-1), token_logprobs(teacher).sum(-1)
    return (lp.exp() * (lp - lt)).sum()


def reinforce_gradient(theta: torch.Tensor, sampler: torch.Tensor, *, weight_by_ratio: bool = False) -> torch.Tensor:
    """Σ_y w(y)·sampler(y) Σ_t G_t ∇_θ log π_θ(a_t|s_t): the expected REINFORCE gradient with per-token reward −λ·k1
    under responses sampled from the table ``sampler``; k1 uses the sampler's log-probs (π_old := the sampler), or
    π_θ's with ``weight_by_ratio`` (then w = π_θ(y)/sampler(y), the sequence-level importance weight)."""
    th = theta.clone().requires_grad_(True)
    lp = token_logprobs(th)  # (27, T) differentiable
    old = token_logprobs(sampler)  # (27, T)
    mask = torch.ones(len(RESPONSES), T, dtype=torch.long)
    k1 = distill_k1(lp.detach() if weight_by_ratio else old, token_logprobs(TEACHER), mask)
    rewards = subtract_token_penalty(torch.zeros(len(RESPONSES), T, dtype=F64), k1, mask, LAMBDA)
    returns = reverse_discounted_cumsum(rewards, 1.0)  # G_t, return-to-go
    p = old.sum(-1).exp()  # (27,) probability of each response under the sampler
    w = (lp.detach().sum(-1) - old.sum(-1)).exp() if weight_by_ratio else torch.ones_like(p)
    surrogate = (p * w * (returns * lp).sum(-1)).sum()
    (grad,) = torch.autograd.grad(surrogate, th)
    return grad


def exact_kl_grad(theta: torch.Tensor) -> torch.Tensor:
    th = theta.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(kl_seq(th), th)
    return grad


def test_k1_is_unbiased_per_state_and_per_response_under_the_students_samples():
    lp, lt = token_logprobs(THETA), token_logprobs(TEACHER)
    k1 = distill_k1(lp, lt, torch.ones(len(RESPONSES), T))
    p = lp.sum(-1).exp()
    assert float(p.sum()) == pytest.approx(1.0, abs=ATOL)
    # per response: E_{y~π}[Σ_t k1_t] = KL_seq(π ‖ π_T)
    assert float((p * k1.sum(-1)).sum()) == pytest.approx(float(kl_seq(THETA)), abs=ATOL)
    assert float(kl_seq(THETA)) > 0.1  # the two tables differ: the check is not 0 = 0
    # per state: E[k1_t | s_t] = KL(π(·|s) ‖ π_T(·|s)) at each of the 13 prefixes
    ps, pt = torch.log_softmax(THETA, -1), torch.log_softmax(TEACHER, -1)
    for s, i in INDEX.items():
        probs = ps[i].exp()
        assert float((probs * (ps[i] - pt[i])).sum()) > 0
        # enumerate a_t at this state through the library function, on a (V, 1) batch
        per_token = distill_k1(ps[i].view(V, 1), pt[i].view(V, 1), torch.ones(V, 1))
        assert float((probs * per_token[:, 0]).sum()) == pytest.approx(
            float((probs * (ps[i] - pt[i])).sum()), abs=ATOL
        ), s


def test_on_policy_reinforce_gradient_is_minus_lambda_grad_reverse_kl():
    got = reinforce_gradient(THETA, THETA)
    want = -LAMBDA * exact_kl_grad(THETA)
    assert float(want.abs().max()) > 0.01
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_off_policy_without_a_ratio_is_not_the_gradient_and_the_sequence_ratio_restores_it():
    want = -LAMBDA * exact_kl_grad(THETA)
    biased = reinforce_gradient(THETA, MU)
    # not round-off: a relative error of order 1 (μ's logits are θ's plus N(0, 0.6²) per entry)
    assert float((biased - want).norm() / want.norm()) > 0.1
    torch.testing.assert_close(reinforce_gradient(THETA, MU, weight_by_ratio=True), want, rtol=0, atol=ATOL)


def test_masks_and_hand_values():
    old = torch.tensor([[-0.5, -1.0, float("-inf")], [-2.0, float("nan"), 0.0]])
    teacher = torch.tensor([[-1.5, -0.25, float("-inf")], [-1.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    k1 = distill_k1(old, teacher, mask)
    torch.testing.assert_close(k1, torch.tensor([[1.0, -0.75, 0.0], [-1.0, 0.0, 0.0]]), rtol=0, atol=0)
    rewards = torch.tensor([[0.0, 1.0, 5.0], [2.0, 0.0, 0.0]])
    out = subtract_token_penalty(rewards, k1, mask, 2.0)
    torch.testing.assert_close(out, torch.tensor([[-2.0, 2.5, 5.0], [4.0, 0.0, 0.0]]), rtol=0, atol=0)
    # per response: 0.25 and -1.0; the mean over the two counted responses is -0.375 (a third, uncounted, is left out)
    seq = sequence_kl_mean(torch.cat([k1, torch.ones(1, 3)]), torch.cat([mask, torch.zeros(1, 3, dtype=torch.long)]))
    assert float(seq) == pytest.approx(-0.375, abs=1e-7)
    with pytest.raises(ValueError, match="coef"):
        subtract_token_penalty(rewards, k1, mask, -1.0)
    with pytest.raises(ValueError, match="same"):
        distill_k1(old, teacher[:, :2], mask)


# ------------------------------------------------------------------------ full-vocabulary per-state divergences

DIRECTION = table(3)  # θ = MU + s·DIRECTION: s = 0 is on-policy for samples of μ
ESTIMATORS = [("reverse", {}), ("forward", {}), ("jsd", {"jsd_beta": 0.3}), ("reverse", {"top_k": 2})]
ESTIMATOR_IDS = ["reverse", "forward", "jsd-0.3", "reverse-top2"]


def prefix_logits(logits: torch.Tensor) -> torch.Tensor:
    """(27, T, V): the table's logits at each response's states s_t = a_<t."""
    return torch.stack([torch.stack([logits[INDEX[y[:t]]] for t in range(T)]) for y in RESPONSES])


def per_state(theta: torch.Tensor, estimator: str, kw: dict) -> torch.Tensor:
    """(27, T) f_t = f(π_θ(·|s_t), π_T(·|s_t)) along each response, by the library function."""
    return distill_divergence(prefix_logits(theta), prefix_logits(TEACHER), estimator, **kw)


def divergence(theta: torch.Tensor, estimator: str, kw: dict) -> torch.Tensor:
    """D(θ) = Σ_y π_θ(y) Σ_t f_t(θ), exactly (differentiable in θ through both π_θ(y) and f)."""
    p = token_logprobs(theta).sum(-1).exp()
    return (p * per_state(theta, estimator, kw).sum(-1)).sum()


def grad_of_divergence(theta: torch.Tensor, estimator: str, kw: dict) -> torch.Tensor:
    th = theta.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(divergence(th, estimator, kw), th)
    return grad


def full_estimator_gradient(
    theta: torch.Tensor, sampler: torch.Tensor, estimator: str, kw: dict, *, parts: str = "both", weight: str = "token"
) -> torch.Tensor:
    """The expected gradient (ascent on −λ·D) of the trainer's two terms under responses of the table ``sampler``:
    the loss term −λ·Σ_t f_t(θ) and the reward −λ·f_u with return-to-go G_t in the policy gradient.

    ``weight="token"``: what PPO does with π_old := the sampler: the reward's f frozen at the sampler, the policy
    gradient through the per-token ratio ρ_t = π_θ(a_t|s_t)/π_old(a_t|s_t), the loss term unweighted at the sampler's
    states. ``weight="sequence"``: both terms weighted by π_θ(y)/sampler(y) (detached) and the reward's f at θ.
    ``parts="per_state"`` keeps the loss term only."""
    th = theta.clone().requires_grad_(True)
    lp = token_logprobs(th)  # (27, T)
    old = token_logprobs(sampler)
    mask = torch.ones(len(RESPONSES), T, dtype=torch.long)
    f = per_state(th, estimator, kw)  # (27, T), differentiable: the loss term's
    p = old.sum(-1).exp()
    if weight == "sequence":
        w, f_reward, pg = (lp.detach().sum(-1) - old.sum(-1)).exp(), f.detach(), lp
    else:
        w, f_reward, pg = torch.ones_like(p), per_state(sampler, estimator, kw), (lp - old).exp()
    rewards = subtract_token_penalty(torch.zeros(len(RESPONSES), T, dtype=F64), f_reward, mask, LAMBDA)
    returns = reverse_discounted_cumsum(rewards, 1.0)
    objective = -LAMBDA * (p * w * f.sum(-1)).sum()
    if parts == "both":
        objective = objective + (p * w * (returns * pg).sum(-1)).sum()
    (grad,) = torch.autograd.grad(objective, th)
    return grad


def test_divergences_match_hand_values():
    """p = (1/2, 1/2), q = (3/4, 1/4), worked by hand."""
    student = torch.tensor([[0.0, 0.0]], dtype=F64)
    teacher = torch.tensor([[math.log(3.0), 0.0]], dtype=F64)
    reverse = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    forward = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    m = (0.625, 0.375)  # 0.5·q + 0.5·p
    jsd = 0.5 * (0.75 * math.log(0.75 / m[0]) + 0.25 * math.log(0.25 / m[1])) + 0.5 * (
        0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])
    )
    for est, want in (("reverse", reverse), ("forward", forward), ("jsd", jsd)):
        assert float(distill_divergence(student, teacher, est)[0]) == pytest.approx(want, abs=1e-15), est
    # the temperature divides both: τ = 2 halves the logits
    half = distill_divergence(student, teacher / 2, "reverse")
    assert float(distill_divergence(student, teacher, "reverse", temperature=2.0)[0]) == pytest.approx(float(half[0]))
    # a token the teacher cannot emit: reverse is +inf, forward finite, no NaN in the gradient
    z = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    qz = torch.tensor([[0.0, float("-inf")]], dtype=F64)
    assert math.isinf(float(distill_divergence(z, qz, "reverse")[0].detach()))
    fwd = distill_divergence(z, qz, "forward")
    assert float(fwd[0]) == pytest.approx(math.log(2.0), abs=1e-15)
    (g,) = torch.autograd.grad(fwd.sum(), z)
    torch.testing.assert_close(g, torch.tensor([[-0.5, 0.5]], dtype=F64))  # p − q


def test_jsd_approaches_forward_and_reverse_kl_up_to_scale():
    """JSD_b / b → KL(teacher ‖ student) as b → 0 and JSD_b / (1 − b) → KL(student ‖ teacher) as b → 1; the error is
    O(b) (resp. O(1 − b)) relative, so 1e-6 leaves it near 1e-6·(a χ² of O(1))."""
    z, zt = prefix_logits(THETA), prefix_logits(TEACHER)
    b = 1e-6
    fwd, rev = distill_divergence(z, zt, "forward"), distill_divergence(z, zt, "reverse")
    torch.testing.assert_close(distill_divergence(z, zt, "jsd", jsd_beta=b) / b, fwd, rtol=1e-4, atol=0)
    torch.testing.assert_close(distill_divergence(z, zt, "jsd", jsd_beta=1 - b) / b, rev, rtol=1e-4, atol=0)
    assert float((fwd - rev).abs().max()) > 0.05  # the two limits differ here: the check can tell them apart


def test_reverse_divergence_is_the_sequence_level_reverse_kl():
    assert float(divergence(THETA, "reverse", {})) == pytest.approx(float(kl_seq(THETA)), abs=ATOL)


@pytest.mark.parametrize(("estimator", "kw"), ESTIMATORS, ids=ESTIMATOR_IDS)
def test_on_policy_full_estimator_gradient_is_minus_lambda_grad_d(estimator, kw):
    want = -LAMBDA * grad_of_divergence(THETA, estimator, kw)
    assert float(want.abs().max()) > 0.01
    torch.testing.assert_close(full_estimator_gradient(THETA, THETA, estimator, kw), want, rtol=0, atol=ATOL)
    # the per-state loss term alone (GKD-style) misses the state-visitation part: relative gaps measured 0.43
    # (reverse), 0.25 (forward), 0.32 (jsd 0.3), 0.11 (reverse top-2), against round-off of 1e-12
    alone = full_estimator_gradient(THETA, THETA, estimator, kw, parts="per_state")
    assert float((alone - want).norm() / want.norm()) > 0.05


@pytest.mark.parametrize(("estimator", "kw"), ESTIMATORS, ids=ESTIMATOR_IDS)
def test_off_policy_sequence_weight_is_exact(estimator, kw):
    theta = MU + 0.5 * DIRECTION  # neither the sampler μ nor near it
    want = -LAMBDA * grad_of_divergence(theta, estimator, kw)
    got = full_estimator_gradient(theta, MU, estimator, kw, weight="sequence")
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize(("estimator", "kw"), ESTIMATORS, ids=ESTIMATOR_IDS)
def test_off_policy_token_ratio_is_exact_at_theta_old_only_with_a_linear_error(estimator, kw):
    """PPO's correction (per-token ratio, f frozen at π_old = μ, loss at μ's states): exact at θ = θ_old; after, the
    gradient of a surrogate that touches D to first order, so the error is c·s + O(s²): gap(s)/s agrees at s = 1e-4
    and 2e-4 to O(s) relative (1e-2 leaves margin for a c₂/c₁ of up to ~50), and is not 0."""

    def gap(s: float) -> torch.Tensor:
        theta = MU + s * DIRECTION
        return full_estimator_gradient(theta, MU, estimator, kw) + LAMBDA * grad_of_divergence(theta, estimator, kw)

    assert float(gap(0.0).abs().max()) < ATOL
    g1, g2 = gap(1e-4) / 1e-4, gap(2e-4) / 2e-4
    assert float(g1.norm()) > 1e-3
    assert float((g1 - g2).norm() / g1.norm()) < 1e-2
    big = gap(0.5).norm() / (LAMBDA * grad_of_divergence(MU + 0.5 * DIRECTION, estimator, kw).norm())
    assert float(big) > 0.1  # away from θ_old it is not ∇D: measured 0.35, 0.22, 0.29, 0.19 relative


# ------------------------------------------------------------------------------------------------- top-k

TOP_Z = torch.tensor([1.2, 0.9, 0.3, -0.4, -1.0], dtype=F64)  # the teacher's logits at one state; top 2 = {0, 1}
IN_K = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0], dtype=F64)


def truncated_reverse(z: torch.Tensor, zt: torch.Tensor) -> torch.Tensor:
    """Σ_{v∈K} p_v (log p_v − log q_v) with the full-vocabulary p, q summed over the teacher's top 2 only (not
    renormalised: the truncation verl PR #5041 removed; tether does not offer it)."""
    lp, lq = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
    return (IN_K * lp.exp() * (lp - lq)).sum()


def test_unrenormalised_top_k_reverse_kl_is_lowered_by_shrinking_the_students_top_k_mass():
    """Start at the teacher (p = q, every divergence 0) and move the student's top-k logits by c (its mass on K,
    P_K, falls as c falls). The truncated sum falls below 0, with d/dc = P_K(1 − P_K) at c = 0 (by hand: at p = q the
    log-ratio is 0, so the derivative is dP_K/dc): descending on it shrinks P_K. The renormalised top-k divergence is
    0 for every c (it does not see P_K), while the full reverse KL grows: top-k's bias."""
    c = torch.zeros((), dtype=F64, requires_grad=True)
    (d,) = torch.autograd.grad(truncated_reverse(TOP_Z + c * IN_K, TOP_Z), c)
    pk = float(torch.softmax(TOP_Z, -1)[:2].sum())
    assert float(d) == pytest.approx(pk * (1 - pk), abs=1e-14) and pk * (1 - pk) > 0.1
    # measured 0, -0.103, -0.192, -0.260 (it returns towards 0 as P_K → 0: -0.203 at c = -3)
    values = [float(truncated_reverse(TOP_Z + c * IN_K, TOP_Z)) for c in (0.0, -0.5, -1.0, -2.0)]
    assert values[0] == 0.0 and all(b < a for a, b in itertools.pairwise(values)) and values[-1] < -0.2, values
    for c in (-3.0, -1.0, 2.0):
        z = (TOP_Z + c * IN_K).view(1, -1)
        renorm = float(distill_divergence(z, TOP_Z.view(1, -1), "reverse", top_k=2)[0])
        assert renorm == pytest.approx(0.0, abs=1e-15), c
        assert float(distill_divergence(z, TOP_Z.view(1, -1), "reverse")[0]) > 0.1, c  # the full KL sees it


def test_renormalised_top_k_is_unchanged_by_a_shift_of_the_top_k_logits():
    """Away from the teacher too: f(z + c·1_K) = f(z) for each estimator, to round-off, so no gradient moves P_K."""
    z = torch.tensor([[0.2, 1.5, -0.3, 0.8, 0.1]], dtype=F64)
    for est, kw in (("reverse", {}), ("forward", {}), ("jsd", {"jsd_beta": 0.7})):
        base = float(distill_divergence(z, TOP_Z.view(1, -1), est, top_k=2, **kw)[0])
        assert base > 0.05, est
        for c in (-2.0, 1.0):
            got = float(distill_divergence(z + c * IN_K, TOP_Z.view(1, -1), est, top_k=2, **kw)[0])
            assert got == pytest.approx(base, abs=1e-14), (est, c)
    # k ≥ V is the full vocabulary
    full = distill_divergence(z, TOP_Z.view(1, -1), "reverse")
    torch.testing.assert_close(distill_divergence(z, TOP_Z.view(1, -1), "reverse", top_k=5), full, rtol=0, atol=0)


def test_distill_divergence_refuses_bad_input():
    z = torch.zeros(2, 3)
    for kwargs, match in (
        ({"estimator": "k1"}, "unknown estimator 'k1'"),
        ({"estimator": "jsd", "jsd_beta": 1.0}, "jsd_beta"),
        ({"estimator": "reverse", "top_k": 0}, "top_k"),
        ({"estimator": "reverse", "temperature": 0.0}, "temperature"),
    ):
        with pytest.raises(ValueError, match=match):
            distill_divergence(z, z, **kwargs)
    with pytest.raises(ValueError, match="same shape"):
        distill_divergence(z, torch.zeros(2, 4), "reverse")
    with pytest.raises(ValueError, match="chunk_size"):
        distill_divergence(z, z, "reverse", chunk_size=0)


@pytest.mark.parametrize("estimator", ["reverse", "forward", "jsd"])
@pytest.mark.parametrize("top_k", [None, 3])
def test_distill_divergence_in_chunks_equals_one_pass_values_and_gradients(estimator, top_k):
    """Chunked over positions (chunk_size 1: one position a chunk; 4: whole rows of a (3, 2, 7) grid and part of
    one) against the per-position formulas run once under plain autograd on the whole grid: the same values and
    gradients for both logit tensors. float64, the same operations per position, only the order of a 7-term sum may
    differ: a few ulp, so 1e-12 relative."""
    from tether.algos.distill import _DivergenceFn

    gen = torch.Generator().manual_seed(3)
    z = (2 * torch.randn(3, 2, 7, generator=gen, dtype=F64)).requires_grad_()
    zt = (2 * torch.randn(3, 2, 7, generator=gen, dtype=F64)).requires_grad_()
    g = torch.rand(3, 2, generator=gen, dtype=F64)  # an upstream gradient that differs per position
    want = _DivergenceFn(estimator, 0.3, top_k, 1.5, F64)(z, zt)
    want_gz, want_gzt = torch.autograd.grad(want, (z, zt), g)
    for chunk in (1, 4):
        got = distill_divergence(z, zt, estimator, jsd_beta=0.3, top_k=top_k, temperature=1.5, chunk_size=chunk)
        gz, gzt = torch.autograd.grad(got, (z, zt), g)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(gz, want_gz, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(gzt, want_gzt, rtol=1e-12, atol=1e-15)
    assert float(want_gz.abs().sum()) > 0.1 and float(want_gzt.abs().sum()) > 0.1  # gradients that can be wrong
    # only the student's gradient asked (the actor's case): the teacher's is not built
    got = distill_divergence(z, zt.detach(), estimator, jsd_beta=0.3, top_k=top_k, temperature=1.5, chunk_size=1)
    torch.testing.assert_close(torch.autograd.grad(got, z, g)[0], want_gz, rtol=1e-12, atol=1e-15)
