"""Rollout correction: importance weights and rejection for the gap between the engine that sampled
and the policy that trains.

Three policies (``DESIGN.md``): π_rollout sampled the tokens (vLLM, or the HF engine's cached decode,
maybe in another dtype); π_old is the trainer's policy at rollout time (the PPO ratio's denominator);
π_θ is the policy being updated. The PPO surrogate and the KL term assume the tokens came from
π_old. They came from π_rollout, so each token's loss is weighted by w = π_old/π_rollout (verl's
"decoupled" mode), which makes the expectation under π_rollout equal the one under π_old, exactly for
an unclipped weight. With ``actor.old_logprobs_source=rollout`` (verl's "bypass" mode) π_old *is*
π_rollout, w = 1, and the PPO ratio π_θ/π_rollout does the correcting; only masking and rejection,
measured against π_θ, then apply (:func:`rollout_correction` with ``old_logprobs`` = log π_θ,
``apply_truncation=False``).

Per token, with δ_t = log π_old(a_t) − log π_rollout(a_t) (nats), the weight's log is

* ``token``: δ_t (TIS/MIS per token);
* ``sequence``: Σ_t δ_t, the product of the token ratios, the exact sequence likelihood ratio
  (unbiased for a sequence-level objective, high variance);
* ``geometric``: (1/n) Σ_t δ_t, the geometric mean of the token ratios (GMPO/GSPO's length-normalised
  ratio, low variance, biased),

broadcast to the sequence's tokens for the two sequence levels. Then ``mode``:

* ``truncate`` (TIS, Yao et al. 2025): w ← min(w, threshold);
* ``mask`` (MIS; IcePop, Ling team 2025): w ← w where lower ≤ w ≤ threshold, else 0 (the token, or
  the whole sequence, gives no gradient but keeps its place in the loss's token count).

Rejection (``reject``) drops divergent samples from the loss altogether (weight 0 *and* out of the
loss's token and sequence counts), by an estimate of KL(π_rollout‖π_old) from the sampled tokens:
k1 = −δ, k2 = ½δ², k3 = e^δ − 1 − δ (Schulman 2020, sampling π_rollout), per token (``token_kX``), or
per sequence as the sum, mean or max over its tokens (``seq_sum_kX``, ``seq_mean_kX``,
``seq_max_kX``). A token or sequence is kept when its statistic is at most ``reject_threshold`` (nats;
|k1| for the k1 criteria, which can be negative).

Source: verl ``trainer/ppo/rollout_corr_helper.py`` (levels token/sequence, truncation, rejection
criteria and their k1/k2/k3 statistics, batch normalisation, the ``rollout_corr/`` metrics ``kl`` and
``k3_kl``), matched numerically in ``tests/algos/test_algos_rollout_correction.py``. Differences,
deliberate: verl's k1 rejection threshold is a ratio bound T (keep e^{-log T} ≤ ...), tether's is in
nats like k2's and k3's (T ↔ log T); verl has no geometric level and (at its 2026 HEAD) no mask mode;
verl's ESS clamps the weights into [1/threshold, threshold] first, tether's is that of the weights the
loss uses; verl does not weight the KL-loss term, tether does (``tether.algos.kl_loss(weights=...)``).
"""

from __future__ import annotations

import math

import torch

from .kl import _k3
from .masked import as_bool_mask, masked_mean, masked_sum

__all__ = ["IS_LEVELS", "IS_MODES", "REJECT_CRITERIA", "rollout_correction"]

IS_LEVELS: tuple[str, ...] = ("none", "token", "sequence", "geometric")
"""``algo.rollout_correction.level`` values: what each weight is the ratio of."""

IS_MODES: tuple[str, ...] = ("truncate", "mask")
"""``algo.rollout_correction.mode`` values: TIS (truncate at ``threshold``) or MIS/IcePop (zero outside [lower,
threshold])."""

REJECT_CRITERIA: tuple[str, ...] = (
    "none",
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""``algo.rollout_correction.reject`` values (verl's ``rollout_rs`` names)."""


def _divergence(delta: torch.Tensor, kind: str, log_ratio_clamp: float) -> torch.Tensor:
    """(B, T) single-sample estimate of KL(π_rollout‖π_old) at each sampled token, nats; δ = log π_old − log
    π_rollout."""
    if kind == "k1":
        return -delta
    if kind == "k2":
        return 0.5 * delta * delta
    return _k3(-delta.clamp(-log_ratio_clamp, log_ratio_clamp))  # k3 = e^δ − 1 − δ ≥ 0, accurate near 0


def _reject_keep(
    delta: torch.Tensor, m: torch.Tensor, criterion: str, threshold: float, log_ratio_clamp: float
) -> torch.Tensor:
    """(B, T) bool: the valid tokens ``criterion`` keeps (a sequence criterion keeps or drops whole rows)."""
    scope, _, kind = criterion.rpartition("_")
    stat = _divergence(delta, kind, log_ratio_clamp)  # (B, T)
    if scope == "token":
        per = stat
    else:
        zero = torch.zeros((), dtype=stat.dtype, device=stat.device)
        if scope == "seq_sum":
            seq = masked_sum(stat, m, dim=-1)
        elif scope == "seq_mean":
            seq = masked_mean(stat, m, dim=-1)
        else:  # seq_max (k2, k3 only: both ≥ 0, so an empty row's 0 is below any threshold)
            seq = torch.where(m, stat, zero).amax(dim=-1)
        per = seq[:, None].expand_as(stat)
    ok = per.abs() <= threshold if kind == "k1" else per <= threshold
    return ok & m


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
    lower: float | None = None,
    reject: str = "none",
    reject_threshold: float | None = None,
    batch_normalize: bool = False,
    apply_truncation: bool = True,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Importance weights π_old/π_rollout (truncated or masked) and the rejection mask of one batch.

    Args:
        old_logprobs: (B, T) log π_old(a_t | s_t), the trainer's, nats.
        rollout_logprobs: (B, T) log π_rollout(a_t | s_t), the engine's, nats; a non-finite value
            (a token the engine gave no log-prob for) counts as δ = 0 (no correction there) and in
            ``rollout_corr/unknown_frac``.
        response_mask: (B, T), non-zero = the token counts.
        level: one of :data:`IS_LEVELS` (see the module docstring); ``"none"`` = weight 1.
        mode: one of :data:`IS_MODES`.
        threshold: upper bound C > 0 of the weight (verl's ``rollout_is_threshold``, default 2).
        lower: ``mode="mask"``'s lower bound, in (0, threshold]; default 1/threshold (verl's; a threshold
            below 1 needs it given). Not used by ``truncate``.
        reject: one of :data:`REJECT_CRITERIA`.
        reject_threshold: the rejection bound, nats (> 0); required unless ``reject="none"``.
        batch_normalize: divide the weights by their mean over the kept tokens (``token``) or over the
            kept sequences (``sequence``, ``geometric``), so they average 1 (verl's
            ``rollout_is_batch_normalize``).
        apply_truncation: False = ``mode="truncate"`` leaves the weights at 1 (measured only): bypass
            mode, where the PPO ratio's clip already bounds π_θ/π_rollout (verl applies no weights
            there either). Masking and rejection still apply, as 0/1 factors.
        log_ratio_clamp: δ's clamp before exp (verl's ``SAFETY_BOUND``, 20).

    Returns:
        ``(weights, keep, metrics)``: weights (B, T) float32 at least, detached, 0 at padding and at
        rejected tokens; keep (B, T) bool, the valid tokens rejection kept (the loss's mask);
        metrics (floats), ``rollout_corr/``: ``kl`` and ``k3_kl`` (k1 and k3 estimates of
        KL(π_rollout‖π_old), nats per token, under π_rollout), ``ess`` (effective sample size of the
        weights the loss uses, (Σw)²/(N·Σw²) over the N valid tokens, 1 = no loss of samples),
        ``weight_mean``/``weight_min``/``weight_max``/``weight_p05``/``weight_p50``/``weight_p95``
        (the raw weights before truncation or masking, over valid tokens), ``truncated_frac``,
        ``masked_frac``, ``rejected_frac`` (fractions of valid tokens), ``rejected_seq_frac``
        (of responses), ``unknown_frac``, and ``batch_norm_factor`` when normalising. No valid token:
        weights 0, keep all False, metrics {}.

    Raises:
        ValueError: shape mismatch, an unknown level, mode or criterion (listing the valid ones),
            threshold ≤ 0, ``mask`` with lower outside (0, threshold], or a missing/non-positive reject_threshold.

    Source: verl ``compute_rollout_correction_and_rejection_mask`` (see the module docstring).
    """
    for name, x in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs)):
        if tuple(x.shape) != tuple(response_mask.shape) or x.dim() != 2:
            raise ValueError(
                f"{name} {tuple(x.shape)} must have the (B, T) shape of response_mask {tuple(response_mask.shape)}"
            )
    for name, value, valid in (
        ("level", level, IS_LEVELS),
        ("mode", mode, IS_MODES),
        ("reject", reject, REJECT_CRITERIA),
    ):
        if value not in valid:
            raise ValueError(f"unknown rollout-correction {name} {value!r}; valid: {', '.join(valid)}")
    if not (isinstance(threshold, int | float) and math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be a finite number > 0, got {threshold!r}")
    lo = 1.0 / threshold if lower is None else lower
    if mode == "mask" and level != "none" and not 0 < lo <= threshold:
        raise ValueError(
            f"mode='mask' needs lower in (0, threshold={threshold}], got {lower!r}"
            + (" (the default 1/threshold is above a threshold below 1: set lower)" if lower is None else "")
        )
    if reject != "none" and not (
        reject_threshold is not None and math.isfinite(reject_threshold) and reject_threshold > 0
    ):
        raise ValueError(f"reject={reject!r} needs reject_threshold > 0 (nats), got {reject_threshold!r}")

    m = as_bool_mask(response_mask)
    dtype = torch.promote_types(torch.promote_types(old_logprobs.dtype, rollout_logprobs.dtype), torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    raw_delta = old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype)  # (B, T) log π_old/π_rollout
    known = torch.isfinite(raw_delta)
    delta = torch.where(m & known, raw_delta, zero)  # (B, T), 0 at padding and unknown tokens
    n_valid = int(m.sum())
    if n_valid == 0:
        return torch.zeros_like(delta), m.clone(), {}

    if level == "token":
        log_w = delta
    elif level == "sequence":
        log_w = masked_sum(delta, m, dim=-1)[:, None].expand_as(delta)
    elif level == "geometric":
        log_w = masked_mean(delta, m, dim=-1)[:, None].expand_as(delta)
    else:
        log_w = torch.zeros_like(delta)
    raw_w = torch.exp(log_w.clamp(-log_ratio_clamp, log_ratio_clamp))  # (B, T)

    truncated = torch.zeros_like(m)
    outside = torch.zeros_like(m)
    if level == "none":
        w = torch.ones_like(raw_w)
    elif mode == "truncate":
        truncated = m & (raw_w > threshold)
        w = raw_w.clamp(max=threshold) if apply_truncation else torch.ones_like(raw_w)
    else:  # mask: the weight itself inside [lower, threshold] (decoupled), 1 there in bypass; 0 outside
        outside = m & ((raw_w < lo) | (raw_w > threshold))
        inside = raw_w if apply_truncation else torch.ones_like(raw_w)
        w = torch.where(outside, zero, inside)

    keep = m.clone()
    if reject != "none":
        keep = _reject_keep(delta, m, reject, float(reject_threshold), log_ratio_clamp)
    w = torch.where(keep, w, zero)  # (B, T): 0 at padding and at rejected tokens

    metrics: dict[str, float] = {}
    if batch_normalize and level != "none" and bool(keep.any()):
        if level == "token":
            mean_w = masked_mean(w, keep)
        else:
            kept_rows = keep.any(dim=-1)
            mean_w = masked_mean(masked_mean(w, keep, dim=-1), kept_rows)
        if float(mean_w) > 1e-8:
            w = w / mean_w
        metrics["rollout_corr/batch_norm_factor"] = float(mean_w)

    with torch.no_grad():
        k1 = -delta
        valid_w = raw_w[m].double()  # statistics in float64: (Σw)² / (N·Σw²) ≤ 1 holds to the last bit
        q = torch.quantile(valid_w, torch.tensor([0.05, 0.5, 0.95], dtype=valid_w.dtype, device=valid_w.device))
        w_valid = w[m].double()
        rows = m.any(dim=-1)
        metrics |= {
            "rollout_corr/kl": float(masked_mean(k1, m)),
            "rollout_corr/k3_kl": float(masked_mean(_divergence(delta, "k3", log_ratio_clamp), m)),
            "rollout_corr/ess": float(w_valid.sum() ** 2 / (n_valid * w_valid.square().sum()).clamp(min=1e-30)),
            "rollout_corr/weight_mean": float(valid_w.mean()),
            "rollout_corr/weight_min": float(valid_w.min()),
            "rollout_corr/weight_max": float(valid_w.max()),
            "rollout_corr/weight_p05": float(q[0]),
            "rollout_corr/weight_p50": float(q[1]),
            "rollout_corr/weight_p95": float(q[2]),
            "rollout_corr/truncated_frac": float(truncated.sum()) / n_valid,
            "rollout_corr/masked_frac": float(outside.sum()) / n_valid,
            "rollout_corr/rejected_frac": float((m & ~keep).sum()) / n_valid,
            "rollout_corr/rejected_seq_frac": float((rows & (m & ~keep).any(dim=-1)).sum()) / max(int(rows.sum()), 1),
            "rollout_corr/unknown_frac": float((m & ~known).sum()) / n_valid,
        }
    return w.detach(), keep, metrics
