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
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tether.algos import distill_k1, reverse_discounted_cumsum, sequence_kl_mean, subtract_token_penalty

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
