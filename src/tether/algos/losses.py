"""PPO losses and loss aggregation.

Each loss returns ``(loss, metrics)``: ``loss`` a 0-d tensor to backpropagate, ``metrics`` a dict of
plain Python floats (detached) under tether's metric names. Inputs at masked positions are
replaced by 0 with :func:`torch.where` before any arithmetic, so an inf/NaN there never reaches the
loss or the gradient.

Micro-batching: a mini-batch split into micro-batches for gradient accumulation gives exactly the
mini-batch loss (and gradient) when the trainer passes the *mini-batch* totals ``total_tokens`` /
``total_seqs`` (see :func:`loss_normalizers`) to every micro-batch call and sums the results.
"""

from __future__ import annotations

import math

import torch

from .kl import kl_penalty, kl_to_go, kl_to_go_term, off_policy_kl_penalty
from .masked import as_bool_mask, masked_mean

__all__ = ["AGG_MODES", "agg_loss", "loss_normalizers", "ppo_policy_loss", "ppo_value_loss", "kl_loss"]

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""Loss aggregation modes accepted by :func:`agg_loss` (verl's names)."""

Count = int | float | torch.Tensor | None


def loss_normalizers(response_mask: torch.Tensor) -> tuple[int, int]:
    """``(total_tokens, total_seqs)`` of a (B, T) mask: the valid tokens and the responses with at
    least one valid token (a dropped sample's empty row is not a response the loss sees). Compute
    these once on the whole mini-batch and pass them to every micro-batch call."""
    m = as_bool_mask(response_mask)
    return int(m.sum().item()), int(m.any(dim=-1).sum().item())


def _denominator(given: Count, own: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
    if given is None:
        d = own
    elif isinstance(given, torch.Tensor):
        d = given
    else:
        if not math.isfinite(given) or given < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {given!r}")
        d = torch.tensor(given)
    return d.to(device=like.device, dtype=like.dtype).clamp(min=1)


def _check_pair(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"response_mask must be (B, T), got {tuple(mask.shape)}")
    if tuple(x.shape) != tuple(mask.shape):
        raise ValueError(f"{name} must have the shape of response_mask {tuple(mask.shape)}, got {tuple(x.shape)}")


def agg_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    total_tokens: Count = None,
    total_seqs: Count = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Aggregate a (B, T) per-token loss into a scalar.

    With N = ``total_tokens`` (valid tokens), S = ``total_seqs`` (responses with at least one valid
    token: rows of a dropped sample, all 0 in the mask, are not counted) and n_b the valid tokens
    of row b:

    * ``token-mean``: Σ_{b,t valid} ℓ / N — a true per-token mean over the whole mini-batch
      (DAPO's token-level loss; verl's default);
    * ``token-sum``: Σ_{b,t valid} ℓ — the mini-batch's unnormalised token sum, no counts used (verl's
      ``token-sum``: its local sum times the data-parallel size, so that mean-reduced gradients are the
      global sum; tether sums gradients across ranks instead, with the same result). The loss and its
      gradient grow with the number of tokens in the mini-batch: the learning rate has to account for it;
    * ``seq-mean-token-sum``: Σ_b (Σ_t ℓ) / S;
    * ``seq-mean-token-mean``: Σ_b (Σ_t ℓ / n_b) / S (the original GRPO objective);
    * ``seq-mean-token-sum-norm``: Σ_b (Σ_t ℓ / C) / S with a constant C = ``norm_constant``
      (default T, the padded response length of this tensor) — Dr. GRPO's length-independent
      normaliser. Because C is a constant and S a mean over sequences, the loss depends neither
      on response lengths nor on batch size (current verl takes the same mean over non-empty
      sequences before dividing by its ``loss_scale_factor``; early verl divided Σ_b Σ_t ℓ by T
      only). Set ``norm_constant`` to the configured maximum response
      length so C stays fixed across batches whose padding differs.

    Args:
        loss_mat: (B, T) per-token loss.
        response_mask: (B, T), non-zero = counts.
        mode: one of :data:`AGG_MODES`.
        total_tokens: N for the whole mini-batch when this call sees one micro-batch (int, float
            or 0-d tensor, e.g. all-reduced across ranks); default: this call's count.
        total_seqs: S for the whole mini-batch; default: this call's rows with at least one valid
            token. An empty row adds 0 and is not counted, so a dropped sample never shrinks the
            other samples' weight (verl's ``agg_loss`` excludes fully masked sequences the same way).
        norm_constant: C for ``seq-mean-token-sum-norm``; default T.

    Returns:
        0-d tensor. Summing the results of micro-batch calls that all receive the mini-batch
        ``total_tokens``/``total_seqs`` (and the same ``norm_constant``) gives exactly the
        mini-batch result. An empty mask gives 0.

    Raises:
        ValueError: unknown mode (lists the valid ones), shape mismatch, a negative or
            non-finite total, ``norm_constant`` ≤ 0.

    Source: verl ``core_algos.agg_loss`` (mode names, formulas, and the mean over non-empty
    sequences; ``token-sum`` as verl PR #7197); Yu et al. 2025 (DAPO, token-level loss); Liu et al.
    2025 (Dr. GRPO).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    _check_pair("loss_mat", loss_mat, response_mask)
    m = as_bool_mask(response_mask)
    x = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))  # (B, T)
    if mode == "token-mean":
        return x.sum() / _denominator(total_tokens, m.sum(), "total_tokens", x)
    if mode == "token-sum":
        return x.sum()
    seq = x.sum(dim=-1)  # (B,) token sums
    if mode == "seq-mean-token-mean":
        seq = seq / m.sum(dim=-1).clamp(min=1).to(seq.dtype)
    elif mode == "seq-mean-token-sum-norm":
        c = float(m.shape[-1]) if norm_constant is None else float(norm_constant)
        if not (math.isfinite(c) and c > 0):
            raise ValueError(f"norm_constant must be a finite number > 0, got {norm_constant!r}")
        seq = seq / c
    return seq.sum() / _denominator(total_seqs, m.any(dim=-1).sum(), "total_seqs", x)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    dual_clip_c: float | None = 3.0,
    agg_mode: str = "token-mean",
    total_tokens: Count = None,
    total_seqs: Count = None,
    norm_constant: float | None = None,
    log_ratio_clamp: float = 20.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with clip-higher and dual clip.

    ratio ρ = exp(clamp(log π - log π_old, ±log_ratio_clamp));
    ℓ = max(-A·ρ, -A·clip(ρ, 1-ε_low, 1+ε_high)); for A < 0 additionally ℓ ← min(ℓ, -A·c)
    (dual clip: bounds the loss of a negative-advantage token whose ratio exploded).

    Args:
        logprobs: (B, T) log π_θ of the taken tokens, nats, differentiable.
        old_logprobs: (B, T) log π_old at rollout time, nats.
        advantages: (B, T).
        response_mask: (B, T), non-zero = counts.
        clip_eps_low, clip_eps_high: ε_low ∈ [0, 1), ε_high ≥ 0 (DAPO clip-higher when
            ε_high > ε_low); defaults 0.2/0.2.
        dual_clip_c: c > 1 (default 3, verl's ``clip_ratio_c``); ``None`` disables dual clip.
        agg_mode, total_tokens, total_seqs, norm_constant: see :func:`agg_loss`.
        log_ratio_clamp: clamp of the log-ratio before exp (verl: 20).
        weights: (B, T) rollout-correction weights multiplying each token's loss, used detached
            (:func:`tether.algos.rollout_correction`; verl's ``rollout_is_weights``); None = 1.

    Returns:
        ``(loss, metrics)``; metrics (floats, over this call's valid tokens):
        ``policy/pg_loss`` (the returned loss), ``policy/clipfrac`` (fraction of tokens where the
        clipped term was the larger), ``policy/clipfrac_lower`` (fraction where the dual clip
        bound), ``policy/approx_kl`` (mean of log π_old - log π, the k1 estimate of
        KL(π_old ‖ π), nats per token).

    Raises:
        ValueError: shape mismatch, ε outside range, c ≤ 1, log_ratio_clamp ≤ 0, bad agg args.

    Source: Schulman et al. 2017 (PPO, eq. 7); Ye et al. 2020 (dual clip, "Mastering Complex
    Control in MOBA Games", eq. 5); Yu et al. 2025 (DAPO clip-higher); verl
    ``compute_policy_loss`` (same formulas, clamps and metric definitions).
    """
    for name, x in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        _check_pair(name, x, response_mask)
    if not 0 <= clip_eps_low < 1:
        raise ValueError(f"clip_eps_low must be in [0, 1), got {clip_eps_low!r}")
    if not clip_eps_high >= 0:
        raise ValueError(f"clip_eps_high must be >= 0, got {clip_eps_high!r}")
    if dual_clip_c is not None and not dual_clip_c > 1:
        raise ValueError(f"dual_clip_c must be > 1 (or None), got {dual_clip_c!r}")
    if not log_ratio_clamp > 0:
        raise ValueError(f"log_ratio_clamp must be > 0, got {log_ratio_clamp!r}")
    m = as_bool_mask(response_mask)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(m, logprobs - torch.where(m, old_logprobs, zero), zero)
    log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)  # (B, T)
    ratio = torch.exp(log_ratio)
    adv = torch.where(m, advantages, torch.zeros((), dtype=advantages.dtype, device=advantages.device))
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)  # (B, T)
    if dual_clip_c is not None:
        loss_dual = -adv * dual_clip_c
        negative = adv < 0
        lower = negative & (loss_ppo > loss_dual)
        loss_tok = torch.where(negative, torch.minimum(loss_ppo, loss_dual), loss_ppo)
    else:
        lower = torch.zeros_like(m)
        loss_tok = loss_ppo
    if weights is not None:
        _check_pair("weights", weights, response_mask)
        loss_tok = loss_tok * torch.where(m, weights.detach().to(loss_tok.dtype), zero.to(loss_tok.dtype))
    loss = agg_loss(
        loss_tok, m, agg_mode, total_tokens=total_tokens, total_seqs=total_seqs, norm_constant=norm_constant
    )
    with torch.no_grad():
        metrics = {
            "policy/pg_loss": float(loss.detach()),
            "policy/clipfrac": float(masked_mean((loss_clipped > loss_unclipped).to(loss_tok.dtype), m)),
            "policy/clipfrac_lower": float(masked_mean(lower.to(loss_tok.dtype), m)),
            "policy/approx_kl": float(masked_mean(-log_ratio, m)),
        }
    return loss, metrics


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float | None = 0.5,
    agg_mode: str = "token-mean",
    total_tokens: Count = None,
    total_seqs: Count = None,
    norm_constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss ½·max((V - R)², (V_clip - R)²), V_clip = V_old + clip(V - V_old, ±clip_range).

    Args:
        values: (B, T) current critic predictions, differentiable.
        old_values: (B, T) predictions at rollout time.
        returns: (B, T) regression targets (from :func:`compute_gae`).
        response_mask: (B, T), non-zero = counts.
        clip_range: ε_V > 0 (verl's ``cliprange_value`` default 0.5); ``None`` = unclipped
            ½·(V - R)².
        agg_mode, total_tokens, total_seqs, norm_constant: see :func:`agg_loss`.

    Returns:
        ``(loss, {"value/loss": float, "value/clipfrac": float})``; clipfrac is the fraction of
        valid tokens where the clipped error was the larger.

    Raises:
        ValueError: shape mismatch, clip_range ≤ 0, bad agg args.

    Source: the PPO2 value loss of OpenAI Baselines (``vf_loss = .5 * mean(max(vf_losses1,
    vf_losses2))``) and verl ``compute_value_loss`` (same form, ½ applied after aggregation).
    """
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        _check_pair(name, x, response_mask)
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range must be > 0 (or None), got {clip_range!r}")
    m = as_bool_mask(response_mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(m, values, zero)
    ret = torch.where(m, returns, zero)
    err = (v - ret).square()  # (B, T)
    if clip_range is None:
        loss_tok, clipped = err, torch.zeros_like(m)
    else:
        old = torch.where(m, old_values, zero)
        v_clip = old + (v - old).clamp(-clip_range, clip_range)
        err_clip = (v_clip - ret).square()
        # clipped: the cut is active (|V − V_old| > clip_range) and its term the larger; inside the range V_clip is
        # V up to the rounding of old + (v − old), which alone must not count (it flipped between equal runs)
        loss_tok, clipped = torch.maximum(err, err_clip), (err_clip > err) & ((v - old).abs() > clip_range)
    loss = 0.5 * agg_loss(
        loss_tok, m, agg_mode, total_tokens=total_tokens, total_seqs=total_seqs, norm_constant=norm_constant
    )
    with torch.no_grad():
        metrics = {
            "value/loss": float(loss.detach()),
            "value/clipfrac": float(masked_mean(clipped.to(loss_tok.dtype), m)),
        }
    return loss, metrics


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "low_var_kl",
    *,
    old_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    agg_mode: str = "token-mean",
    total_tokens: Count = None,
    total_seqs: Count = None,
    norm_constant: float | None = None,
    log_ratio_clamp: float | None = 20.0,
    value_clamp: float | None = 10.0,
    is_log_ratio_clamp: float = 20.0,
    to_go: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the loss: ``agg_loss(w · term)``, *unscaled* (the actor loss adds ``β · loss``).

    ``term`` is :func:`tether.algos.off_policy_kl_penalty` when ``old_logprobs`` is given (the tokens
    were sampled by π_old: each token importance-weighted so that, under a_t ~ π_old, the expected
    gradient is ∇_θ KL(π_θ‖π_ref) for k1, k3 and every ``+`` variant and k2, and the expected value
    KL(π_θ‖π_ref) for k1, k3, k1+ and k3+: ``kl.off_policy_correction=ratio``), else the plain
    :func:`tether.algos.kl_penalty` (verl's ``use_kl_loss``: ``none``). Without the ratio, plain k3's
    expected gradient is that of KL(π_ref‖π_θ) even on-policy, and every estimator's is biased
    off-policy (``docs/training.md``, "KL off-policy").

    Args:
        logprobs: (B, T) log π_θ, differentiable, nats.
        ref_logprobs: (B, T) log π_ref, nats.
        response_mask: (B, T).
        estimator: see :func:`tether.algos.kl_penalty` (verl's ``kl_loss_type`` default
            ``low_var_kl``).
        old_logprobs: (B, T) log π_old of the sampling policy, nats; None = no importance ratio.
        weights: (B, T) rollout-correction weights (:func:`tether.algos.rollout_correction`), used
            detached; None = 1. They multiply the term, as they do the policy loss.
        agg_mode, total_tokens, total_seqs, norm_constant: see :func:`agg_loss`.
        log_ratio_clamp, value_clamp: see :func:`tether.algos.kl_penalty`.
        is_log_ratio_clamp: clamp of log(π_θ/π_old), see :func:`tether.algos.off_policy_kl_penalty`.
        to_go: add :func:`tether.algos.kl_to_go_term` with G_t the sum of the later counted tokens' k1
            (``kl.loss_to_go``): 0 in value, and with it the per-token term's expected gradient (ratio
            correction, or k2 and the ``+`` variants) becomes that of the trajectory's KL_traj(π_θ‖π_ref) at
            θ = θ_old, across turns when ``response_mask`` holds the model's tokens. The sum identity is per
            trajectory: ``token-sum`` (or ``token-mean``, up to the mini-batch's constant N); a per-row
            mean (``seq-mean-token-mean``) weighs each trajectory by 1/length.

    Returns:
        ``(loss, {"policy/kl_loss": float})``, nats per token for ``token-mean``.

    Raises:
        ValueError: see :func:`tether.algos.kl_penalty` and :func:`agg_loss`.

    Source: verl ``use_kl_loss`` (``kl_penalty`` + ``agg_loss``); Shao et al. 2024 (GRPO puts
    a k3 KL in the loss); TRL ≥ 1.10 (the per-token ratio on k3).
    """
    _check_pair("logprobs", logprobs, response_mask)
    _check_pair("ref_logprobs", ref_logprobs, response_mask)
    m = as_bool_mask(response_mask)
    # Sanitise masked positions first: padding with -inf on both sides gives r = NaN, and even a
    # zero upstream gradient times NaN is NaN in backward.
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    lp = torch.where(m, logprobs, zero)
    ref = torch.where(m, ref_logprobs, zero.to(ref_logprobs.dtype))
    if old_logprobs is None:
        kl = kl_penalty(lp, ref, estimator, log_ratio_clamp=log_ratio_clamp, value_clamp=value_clamp)
    else:
        _check_pair("old_logprobs", old_logprobs, response_mask)
        old = torch.where(m, old_logprobs, zero.to(old_logprobs.dtype))
        kl = off_policy_kl_penalty(
            lp,
            ref,
            old,
            estimator,
            log_ratio_clamp=log_ratio_clamp,
            value_clamp=value_clamp,
            is_log_ratio_clamp=is_log_ratio_clamp,
        )
    if to_go:  # the KL of the later tokens this token's choice leads to: k1 of π_θ, detached
        g = kl_to_go((lp.detach().to(kl.dtype) - ref.to(kl.dtype)), m)
        kl = kl + kl_to_go_term(
            lp, g, m, old_logprobs=None if old_logprobs is None else old, is_log_ratio_clamp=is_log_ratio_clamp
        )
    if weights is not None:
        _check_pair("weights", weights, response_mask)
        kl = kl * torch.where(m, weights.detach().to(kl.dtype), torch.zeros((), dtype=kl.dtype, device=kl.device))
    loss = agg_loss(kl, m, agg_mode, total_tokens=total_tokens, total_seqs=total_seqs, norm_constant=norm_constant)
    return loss, {"policy/kl_loss": float(loss.detach())}
