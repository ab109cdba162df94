"""On-policy distillation: the sampled-token reverse KL to a teacher as a per-token reward.

Notation: π_old the policy that sampled the batch (the student), π_T the frozen teacher; for a response
y = (a_1, ..., a_n) to a prompt x, s_t = (x, a_<t). The objective term is −λ·KL_seq(π ‖ π_T), the reverse KL
(student first) between the two distributions over whole responses, which the chain rule splits into the
per-state KLs along π's own path:

    KL_seq(π ‖ π_T) = E_{y~π}[Σ_t log π(a_t|s_t) − log π_T(a_t|s_t)] = E_{y~π}[Σ_t KL(π(·|s_t) ‖ π_T(·|s_t))].

k1_t = log π_old(a_t|s_t) − log π_T(a_t|s_t) at the sampled token is the single-sample estimate of both: under
a_t ~ π_old(·|s_t), E[k1_t | s_t] = KL(π_old(·|s_t) ‖ π_T(·|s_t)) (nats), and E_{y~π_old}[Σ_t k1_t] =
KL_seq(π_old ‖ π_T). As a reward (−λ·k1_t on each response token, held constant in the gradient), its REINFORCE
gradient with return-to-go is −λ·∇_θ KL_seq(π_θ ‖ π_T) exactly at θ = θ_old: ∇KL_seq = E[Σ_t (Σ_u k1_u)·∇log π_θ(a_t)]
+ E[Σ_t ∇log π_θ(a_t)], the second term is 0 (the score has mean 0), and the terms u < t of the first vanish in
expectation. ``tests/algos/test_algos_distill.py`` checks this by enumeration, and what does not hold: samples of
another policy μ ≠ π_θ without an importance ratio give E_μ[...] ≠ −λ∇KL_seq(π_θ ‖ π_T).

Source: the per-token reverse-KL reward of on-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of
Language Models", GKD with the reverse KL; Thinking Machines' "On-Policy Distillation", 2025; the same design in
slime, prime-rl and verl's recipe): the student samples, the teacher scores the sampled tokens.
"""

from __future__ import annotations

import torch

from .masked import as_bool_mask, masked_mean

__all__ = ["DISTILL_ESTIMATORS", "distill_k1", "subtract_token_penalty", "sequence_kl_mean"]

DISTILL_ESTIMATORS: tuple[str, ...] = ("k1",)
"""``distill.estimator`` values: ``k1`` (:func:`distill_k1`)."""


def distill_k1(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token k1 to the teacher, k1_t = log π_old(a_t|s_t) − log π_T(a_t|s_t), on the counted tokens.

    Under a_t ~ π_old(·|s_t) (the student's own samples), E[k1_t | s_t] = KL(π_old(·|s_t) ‖ π_T(·|s_t)), nats, and
    the sum over a response is an unbiased estimate of KL_seq(π_old ‖ π_T) for its prompt. It can be negative for a
    single token. Not an estimate of the KL under samples of another policy (a dataset's, an older policy's) unless
    importance-weighted.

    Args:
        old_logprobs: (B, T) log π_old of the sampled tokens, nats.
        teacher_logprobs: (B, T) log π_T of the same tokens, nats (same temperature as ``old_logprobs``).
        response_mask: (B, T), non-zero = the token counts.

    Returns:
        (B, T) float32 at least, k1 on counted tokens and 0 elsewhere (whatever the log-probs hold there, inf and NaN
        included). A counted token the teacher gives probability 0 has k1 = +inf.

    Raises:
        ValueError: the shapes differ.
    """
    if not (tuple(old_logprobs.shape) == tuple(teacher_logprobs.shape) == tuple(response_mask.shape)):
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)}, teacher_logprobs {tuple(teacher_logprobs.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have the same (B, T) shape"
        )
    dtype = torch.promote_types(torch.promote_types(old_logprobs.dtype, teacher_logprobs.dtype), torch.float32)
    m = as_bool_mask(response_mask).to(old_logprobs.device)
    k1 = old_logprobs.to(dtype) - teacher_logprobs.to(device=old_logprobs.device, dtype=dtype)
    return torch.where(m, k1, torch.zeros((), dtype=dtype, device=k1.device))


def subtract_token_penalty(
    token_level_rewards: torch.Tensor, penalty: torch.Tensor, response_mask: torch.Tensor, coef: float
) -> torch.Tensor:
    """``token_level_rewards − coef·penalty`` on the counted tokens; masked positions keep their reward.

    A second divergence placed in the reward beside the reference's β·KL
    (:func:`tether.algos.token_level_rewards_from_kl`): with ``penalty`` = :func:`distill_k1` and ``coef`` = λ, each
    response token's reward falls by λ·k1_t (the module docstring: its policy gradient under π_old's samples).

    Args:
        token_level_rewards: (B, T) rewards per token.
        penalty: (B, T) per-token divergence estimate, nats per token.
        response_mask: (B, T), non-zero = the token counts.
        coef: λ ≥ 0.

    Returns:
        (B, T), dtype of ``token_level_rewards`` promoted with ``penalty``'s.

    Raises:
        ValueError: shapes differ, or coef < 0.
    """
    if not (tuple(token_level_rewards.shape) == tuple(penalty.shape) == tuple(response_mask.shape)):
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)}, penalty {tuple(penalty.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have the same (B, T) shape"
        )
    if coef < 0:
        raise ValueError(f"coef (lambda) must be >= 0, got {coef!r}")
    m = as_bool_mask(response_mask).to(token_level_rewards.device)
    dtype = torch.promote_types(token_level_rewards.dtype, penalty.dtype)
    zero = torch.zeros((), dtype=dtype, device=token_level_rewards.device)
    p = torch.where(m, penalty.to(device=token_level_rewards.device, dtype=dtype), zero)
    return token_level_rewards.to(dtype) - coef * p


def sequence_kl_mean(kl: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The mean over counted responses of each response's summed per-token KL (nats per response).

    With ``kl`` = :func:`distill_k1` over π_old's samples, an unbiased estimate of the prompts' average
    KL_seq(π_old ‖ π_T).

    Args:
        kl: (B, T) per-token estimate, nats.
        response_mask: (B, T), non-zero = the token counts.

    Returns:
        0-d tensor, nats per response; 0 when no response counts.
    """
    m = as_bool_mask(response_mask)
    per_seq = torch.where(m, kl, torch.zeros((), dtype=kl.dtype, device=kl.device)).sum(-1)  # (B,)
    return masked_mean(per_seq, m.any(dim=-1))
