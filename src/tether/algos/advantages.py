"""Advantage estimators over (B, T) tensors.

Conventions shared by every estimator:

* ``response_mask`` (B, T): non-zero = the token counts. Masked positions — padding, and tokens
  in the middle of a response that the policy did not produce (tool output in multi-turn data) —
  are *skipped*: the valid tokens of a row form the trajectory, in order, and a masked token is
  not a time step. Values stored at masked positions (inf and NaN included) are never read.
* Outputs ``(advantages, returns)`` are (B, T) and exactly 0 at masked positions.
* ``scores`` are (B,) sequence rewards; ``group_ids`` are (B,) int64 labels of the prompt each
  response answers (any integers; equal label = same group).
* A response with no valid token takes no part in any statistic and gets 0.

Every estimator is also reachable through the registry :func:`compute_advantages`, whose entries
all take one :class:`AdvantageInputs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .masked import as_bool_mask, masked_sum, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "NORM_BY_STD",
    "AdvantageInputs",
    "canonical_norm_by_std",
    "compute_advantages",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_rloo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "reverse_discounted_cumsum",
    "gae_reference_loop",
    "trajectory_totals",
    "zero_variance_groups",
]

_SCAN_BLOCK = 32


# --------------------------------------------------------------------------------------------
# Scans
# --------------------------------------------------------------------------------------------


def _discount_matrix(n: int, discount: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(n, n) matrix M with M[j, i] = discount^(j - i) for j ≥ i, else 0, so that (x @ M)[i] =
    Σ_{j ≥ i} discount^(j - i) x[j]. Entries are ≤ 1 for discount ≤ 1 (no overflow)."""
    idx = torch.arange(n, device=device)
    e = idx[:, None] - idx[None, :]  # (n, n): j - i
    powers = torch.pow(torch.tensor(discount, dtype=dtype, device=device), e.clamp(min=0).to(dtype))
    return torch.where(e >= 0, powers, torch.zeros((), dtype=dtype, device=device))


def reverse_discounted_cumsum(x: torch.Tensor, discount: float, *, block: int = _SCAN_BLOCK) -> torch.Tensor:
    """``y[..., t] = Σ_{k ≥ t} discount^(k - t) · x[..., k]`` along the last dimension.

    Blocked scan: the last dimension is cut into blocks of ``block`` steps; within a block the sum
    is one matrix product with the (block, block) matrix of powers discount^(j - i) ≤ 1, and the
    value at each block start is carried backwards by the same scan, applied recursively to the
    sequence of block starts with discount^block. Work is O(T · block), depth O(log_block T), and
    no power of the discount exceeds 1, so nothing overflows (unlike the cumsum of
    ``x · discount^-t``, which overflows for long T).

    Args:
        x: (..., T) floating tensor.
        discount: in [0, 1].
        block: steps per block (default 32).

    Returns:
        Tensor of the shape and dtype of ``x``.

    Raises:
        ValueError: discount outside [0, 1] or block < 2.
    """
    if not (0.0 <= discount <= 1.0):
        raise ValueError(f"discount must be in [0, 1], got {discount!r}")
    if block < 2:
        raise ValueError(f"block must be >= 2, got {block!r}")
    lead, t = x.shape[:-1], x.shape[-1]
    if x.numel() == 0:
        return x.clone()
    flat = x.reshape(-1, t)  # (N, T)
    return _scan(flat, float(discount), block).reshape(*lead, t)


def _scan(x: torch.Tensor, c: float, block: int) -> torch.Tensor:  # (N, T) -> (N, T)
    n, t = x.shape
    if t <= block:
        return x @ _discount_matrix(t, c, x.dtype, x.device)
    nb = -(-t // block)
    if nb * block != t:  # zeros after the end add nothing
        x = torch.nn.functional.pad(x, (0, nb * block - t))
    local = x.reshape(n, nb, block) @ _discount_matrix(block, c, x.dtype, x.device)  # (N, nb, L)
    # Value at each block start = its local sum + c^L * value at the next block start. The carry
    # is (N, nb), 1/L of the data, so it runs in float64 for accuracy at no real cost.
    starts = _scan(local[:, :, 0].double(), c**block, block)  # (N, nb)
    after = torch.nn.functional.pad(starts[:, 1:], (0, 1)).to(x.dtype)  # (N, nb): value at the next block start
    tail = torch.pow(  # c^(L - i), i = 0..L-1
        torch.tensor(c, dtype=torch.float64, device=x.device),
        torch.arange(block, 0, -1, device=x.device, dtype=torch.float64),
    ).to(x.dtype)
    local.addcmul_(after[:, :, None], tail)  # (N, nb, L), in place
    out = local.view(n, nb * block)
    return out if nb * block == t else out[:, :t]


def _is_contiguous_mask(m: torch.Tensor) -> bool:
    """True when every row's valid tokens form at most one contiguous run (no holes)."""
    if m.shape[-1] == 0:
        return True
    run_starts = (m[:, 1:] & ~m[:, :-1]).sum(-1) + m[:, 0]  # (B,): number of 0->1 edges
    return bool((run_starts <= 1).all())


def _compact(x: torch.Tensor, m: torch.Tensor, dtype: torch.dtype, pos: torch.Tensor | None = None):
    """Move the valid entries of each row to the front, in order, zero-padded: (B, T) -> (B, T).

    Returns the compacted tensor and ``pos`` (B, T) int64, the compact slot of every valid
    position (pass it back in to compact a second tensor with the same mask). Masked entries are
    scattered into an extra dump column that is dropped, so they are never read.
    """
    b, t = x.shape
    if pos is None:
        # int32 cumsum is ~15x faster than int64 on CPU; T < 2**31 always.
        slot = torch.cumsum(m, dim=-1, dtype=torch.int32).long().sub_(1)  # (B, T)
        pos = torch.where(m, slot, t)  # masked -> dump column t
    out = torch.zeros(b, t + 1, dtype=dtype, device=x.device)
    out.scatter_(1, pos, x.to(dtype))
    return out[:, :t], pos


def _expand(compact: torch.Tensor, pos: torch.Tensor, mf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_compact` for a finite ``compact``: (B, T) -> (B, T), 0 where masked.

    ``mf`` is the mask as 0./1. of compact's dtype.
    """
    padded = torch.nn.functional.pad(compact, (0, 1))  # (B, T + 1): the dump column reads 0
    return padded.gather(1, pos).mul_(mf)


def _whiten_zeroed(x: torch.Tensor, mf: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """:func:`masked_whiten` for a finite ``x`` already 0 at masked positions; ``mf`` is the mask
    as 0./1. of x's dtype (fewer passes than the general function, same result)."""
    n = mf.sum()
    mean = x.sum() / n.clamp(min=1)
    centred = (x - mean).mul_(mf)  # (B, T)
    flat = centred.view(-1)
    var = torch.dot(flat, flat) / (n - 1).clamp(min=1)  # unbiased; 0 when n <= 1
    return centred.mul_(torch.rsqrt(var + eps))


def _compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 are upcast)."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def _check_bt(mask: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
    if mask.dim() != 2:
        raise ValueError(f"response_mask must be (B, T), got {tuple(mask.shape)}")
    for name, x in tensors.items():
        if tuple(x.shape) != tuple(mask.shape):
            raise ValueError(f"{name} must have the shape of response_mask {tuple(mask.shape)}, got {tuple(x.shape)}")
    return as_bool_mask(mask)


def _check_unit(name: str, value: float) -> float:
    v = float(value)
    if not (0.0 <= v <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return v


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.float32


# --------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------


def compute_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the valid tokens of each response (vectorized).

    For the valid tokens t_1 < … < t_n of a row (masked tokens are skipped, not steps):
    δ_k = r_k + γ·V_{k+1} - V_k with V_{n+1} = 0 (the value after the last valid token), and
    A_k = Σ_{j ≥ k} (γλ)^(j-k) δ_j.

    Args:
        token_level_rewards: (B, T) per-token rewards (score on the last token - β·KL).
        values: (B, T) critic values V(s_t), same reward units.
        response_mask: (B, T), non-zero = counts.
        gamma: discount γ in [0, 1].
        lam: GAE λ in [0, 1].
        whiten: whiten the returned advantages over all valid tokens of the batch
            (mean 0, unbiased std 1; verl's default).

    Returns:
        ``(advantages, returns)``, both (B, T), 0 on masked positions. ``returns`` = raw
        (unwhitened) advantages + values, the critic's regression target.

    Raises:
        ValueError: shape mismatch, gamma or lam outside [0, 1].

    Source: Schulman et al. 2016, eq. 16 (GAE); verl ``compute_gae_advantage_return`` (whitened
    advantages, returns from raw advantages, multi-turn skipping of masked tokens). The scan
    (:func:`reverse_discounted_cumsum`) runs in float32 (float64 if an input is float64) with a
    float64 carry between blocks; it equals :func:`gae_reference_loop` to the round-off of that
    dtype.
    """
    m = _check_bt(response_mask, token_level_rewards=token_level_rewards, values=values)
    gamma, lam = _check_unit("gamma", gamma), _check_unit("lam", lam)
    dtype = _compute_dtype(token_level_rewards, values)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    if _is_contiguous_mask(m):
        # Fast path (padding only): no compaction. Zero r and V outside the run; δ is then 0 after
        # the run, and any δ before it (left padding) only reaches masked positions.
        v = torch.where(m, values.to(dtype), zero)  # (B, T); V = 0 after the last valid token
        delta = torch.where(m, token_level_rewards.to(dtype), zero).sub_(v)  # r - V
        delta[:, :-1].add_(v[:, 1:], alpha=gamma)  # + γ·V_{t+1}
        mf = m.to(dtype)
        adv = reverse_discounted_cumsum(delta, gamma * lam)
        adv.mul_(mf)  # finite everywhere (inputs were sanitised), so multiplying is NaN-safe here
        returns = adv + v
        if whiten:
            adv = _whiten_zeroed(adv, mf)
    else:
        # Holes (multi-turn): compact each row's valid tokens to the front, scan, scatter back.
        mf = m.to(dtype)
        r_c, pos = _compact(token_level_rewards, m, dtype)  # (B, T)
        v_c, _ = _compact(values, m, dtype, pos)  # (B, T), zeros after each row's n valid tokens
        delta = r_c - v_c
        delta[:, :-1].add_(v_c[:, 1:], alpha=gamma)  # + γ·V_{k+1}; V = 0 after the last valid token
        adv_c = reverse_discounted_cumsum(delta, gamma * lam)  # δ = 0 on the padding
        returns = _expand(adv_c + v_c, pos, mf)
        adv = _expand(adv_c, pos, mf)
        if whiten:
            adv = _whiten_zeroed(adv, mf)
    out_dtype = _float_dtype(values)
    return adv.to(out_dtype), returns.to(out_dtype)


def gae_reference_loop(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain backward loop over t with the semantics of :func:`compute_gae` (float64).

    A reference for tests and benchmarks, O(T) Python steps; use :func:`compute_gae` instead.
    """
    m = _check_bt(response_mask, token_level_rewards=token_level_rewards, values=values)
    b, t = m.shape
    r, v = token_level_rewards.double(), values.double()
    adv = torch.zeros(b, t, dtype=torch.float64)
    next_value = torch.zeros(b, dtype=torch.float64)
    last_gae = torch.zeros(b, dtype=torch.float64)
    for i in reversed(range(t)):
        valid = m[:, i]
        delta = r[:, i] + gamma * next_value - v[:, i]
        gae = delta + gamma * lam * last_gae
        adv[:, i] = torch.where(valid, gae, 0.0)
        next_value = torch.where(valid, v[:, i], next_value)
        last_gae = torch.where(valid, gae, last_gae)
    returns = torch.where(m, adv + v, 0.0)
    if whiten:
        adv = masked_whiten(adv, m)
    dtype = _float_dtype(values)
    return adv.to(dtype), returns.to(dtype)


# --------------------------------------------------------------------------------------------
# Group (outcome) estimators
# --------------------------------------------------------------------------------------------


def _group_stats(scores: torch.Tensor, m: torch.Tensor, group_ids: torch.Tensor):
    """Per-response group statistics over participating responses (≥ 1 valid token), float64.

    Returns x, participating (B,), group index (B,), count, sum, and "constant group" flags,
    each gathered back to (B,).
    """
    b = m.shape[0]
    if tuple(scores.shape) != (b,):
        raise ValueError(f"scores must have shape (B,) = ({b},), got {tuple(scores.shape)}")
    if tuple(group_ids.shape) != (b,):
        raise ValueError(f"group_ids must have shape (B,) = ({b},), got {tuple(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    part = m.any(dim=-1)  # (B,)
    uniq, gidx = torch.unique(group_ids, return_inverse=True)  # gidx: (B,) in [0, G)
    g = uniq.numel()
    x = torch.where(part, scores.double(), 0.0)  # (B,); scores of empty rows are never read
    count = torch.zeros(g, dtype=torch.float64, device=x.device).index_add_(0, gidx, part.double())  # (G,)
    total = torch.zeros(g, dtype=torch.float64, device=x.device).index_add_(0, gidx, x)  # (G,)
    inf = torch.tensor(math.inf, dtype=torch.float64, device=x.device)
    gmax = torch.full((g,), -math.inf, dtype=torch.float64, device=x.device).scatter_reduce(
        0, gidx, torch.where(part, x, -inf), "amax"
    )
    gmin = torch.full((g,), math.inf, dtype=torch.float64, device=x.device).scatter_reduce(
        0, gidx, torch.where(part, x, inf), "amin"
    )
    constant = (gmax == gmin) | (count <= 1)  # (G,): all equal, a single member, or empty
    return x, part, gidx, count, total, constant


def _broadcast(per_seq: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B,) -> (B, T) on valid tokens, 0 elsewhere."""
    return torch.where(m, per_seq.to(dtype)[:, None], torch.zeros((), dtype=dtype, device=m.device))


def zero_variance_groups(scores: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Which responses belong to a group that carries no comparison: (B,) bool.

    True for a response whose group's participating scores (responses with ≥ 1 valid token) are
    all equal, whose group has fewer than two participants, or that does not participate itself.
    Such groups give every group-relative advantage (grpo, drgrpo, rloo,
    reinforce_plus_plus_baseline) exactly 0; DAPO's dynamic sampling drops them.

    Args:
        scores: (B,) sequence rewards; response_mask: (B, T); group_ids: (B,) int64.

    Raises:
        ValueError: shape mismatch, non-integer group_ids.

    Source: Yu et al. 2025 (DAPO, sec. 3.2, dynamic sampling: keep 0 < |correct| < G).
    """
    m = _check_bt(response_mask)
    _, part, gidx, _, _, constant = _group_stats(scores, m, group_ids)
    return constant[gidx] | ~part


NORM_BY_STD: tuple[str, ...] = ("group", "batch", "none")
"""Choices of GRPO's advantage scaling (``algo.norm_by_std``; TRL's ``scale_rewards``)."""


def canonical_norm_by_std(value: str | bool) -> str:
    """``"group"``, ``"batch"`` or ``"none"``; the old booleans map ``True``→``"group"``,
    ``False``→``"none"``.

    Raises:
        ValueError: anything else (lists the choices).
    """
    if value is True or value is False:
        return "group" if value else "none"
    if value not in NORM_BY_STD:
        raise ValueError(f"norm_by_std must be one of {', '.join(NORM_BY_STD)} (or true/false), got {value!r}")
    return value


def compute_grpo_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    norm_by_std: str | bool = "group",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: (score - group mean) / (std + eps) on every valid token.

    Args:
        scores: (B,) sequence rewards.
        response_mask: (B, T), non-zero = counts.
        group_ids: (B,) int64 prompt labels.
        norm_by_std: which std divides the centred score (one of :data:`NORM_BY_STD`):
            ``"group"`` the unbiased std of the response's group (GRPO); ``"batch"`` the
            unbiased std of all participating scores of the batch (Liu et al. 2025, "Tricks or
            Traps", group mean + batch std; TRL's ``scale_rewards="batch"``); ``"none"`` no
            division (Dr. GRPO, Liu et al. 2025), the mean subtraction only. ``True``/``False``
            are accepted as ``"group"``/``"none"``.
        eps: added to the std (verl's default 1e-6; TRL uses 1e-4).

    Returns:
        ``(advantages, returns)`` (B, T), equal (verl returns the same tensor twice), 0 on
        masked positions. A group of one, or a group whose (participating) scores are all
        equal, gets exactly 0 — never NaN nor a large number from round-off (verl gives a
        singleton its raw score instead). Responses with no valid token are left out of their
        group's mean/std. Statistics in float64; output dtype of ``scores`` (float32 for ints).

    Raises:
        ValueError: shape mismatch, non-integer group_ids, eps < 0, an unknown ``norm_by_std``.

    Source: Shao et al. 2024 (DeepSeekMath, sec. 4.1.2, outcome supervision); verl
    ``compute_grpo_outcome_advantage`` (unbiased std, eps 1e-6); Liu et al. 2025 (Dr. GRPO);
    TRL ``GRPOTrainer`` ``scale_rewards`` (group | batch | none).
    """
    m = _check_bt(response_mask)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    scale = canonical_norm_by_std(norm_by_std)
    x, part, gidx, count, total, constant = _group_stats(scores, m, group_ids)
    mean = total / count.clamp(min=1)  # (G,)
    d = torch.where(part, x - mean[gidx], 0.0)  # (B,)
    if scale == "group":
        sq = torch.zeros_like(mean).index_add_(0, gidx, d * d)  # (G,)
        std = torch.sqrt(sq / (count - 1).clamp(min=1))  # (G,) unbiased
        d = d / (std[gidx] + eps)
    elif scale == "batch":
        n = part.sum()
        xb = torch.where(part, x - x.sum() / n.clamp(min=1), 0.0)  # (B,) centred on the batch mean
        std = torch.sqrt((xb * xb).sum() / (n - 1).clamp(min=1))  # unbiased, over participating scores
        d = d / (std + eps)
    adv = torch.where(constant[gidx] | ~part, 0.0, d)  # (B,)
    out = _broadcast(adv, m, _float_dtype(scores))
    return out, out.clone()


def compute_rloo_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: each response's score minus the mean score of the *other* responses of its prompt.

    ``A_i = x_i - (S - x_i) / (n - 1)`` with S and n over the participating responses of the
    group; a group of one (no other response) or of equal scores gives 0.

    Args:
        scores: (B,); response_mask: (B, T); group_ids: (B,) int64.

    Returns:
        ``(advantages, returns)`` (B, T), equal, 0 on masked positions.

    Raises:
        ValueError: shape mismatch, non-integer group_ids.

    Source: Ahmadian et al. 2024 (RLOO, eq. 9 / Kool et al. 2019); verl ``compute_rloo_outcome_advantage``.
    """
    m = _check_bt(response_mask)
    x, part, gidx, count, total, constant = _group_stats(scores, m, group_ids)
    n = count[gidx]  # (B,)
    adv = x - (total[gidx] - x) / (n - 1).clamp(min=1)
    adv = torch.where(constant[gidx] | ~part, 0.0, adv)
    out = _broadcast(adv, m, _float_dtype(scores))
    return out, out.clone()


def compute_reinforce_pp_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over the batch.

    G_k = Σ_{j ≥ k} γ^(j-k) r_j over the valid tokens of the row (masked tokens skipped, as in
    :func:`compute_gae`).

    Args:
        token_level_rewards: (B, T) per-token rewards (score on the last token - β·KL).
        response_mask: (B, T), non-zero = counts.
        gamma: discount in [0, 1] (verl's default 1.0).

    Returns:
        ``(advantages, returns)`` (B, T): advantages = masked_whiten(G) over all valid tokens,
        returns = G (raw); 0 on masked positions.

    Raises:
        ValueError: shape mismatch, gamma outside [0, 1].

    Source: Hu 2025 (REINFORCE++, sec. 3); verl
    ``compute_reinforce_plus_plus_outcome_advantage`` (which resets the return at masked tokens;
    tether skips them, consistently with GAE).
    """
    m = _check_bt(response_mask, token_level_rewards=token_level_rewards)
    gamma = _check_unit("gamma", gamma)
    dtype = _float_dtype(token_level_rewards)
    dtype = _compute_dtype(token_level_rewards)
    r_c, pos = _compact(token_level_rewards, m, dtype)
    returns = _expand(reverse_discounted_cumsum(r_c, gamma), pos, m.to(dtype)).to(_float_dtype(token_level_rewards))
    return masked_whiten(returns, m), returns


def compute_reinforce_pp_baseline_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with baseline: subtract the group mean score, then whiten over the batch.

    ``A = masked_whiten((x_i - mean_group) on every valid token)``; whitening is over all valid
    tokens of the batch (so a long response weighs more in the statistics, as in verl).
    A group of one or of equal scores contributes 0 before whitening.

    Args:
        scores: (B,); response_mask: (B, T); group_ids: (B,) int64.

    Returns:
        ``(advantages, returns)`` (B, T), equal, 0 on masked positions.

    Raises:
        ValueError: shape mismatch, non-integer group_ids.

    Source: Hu 2025 (REINFORCE++-baseline); verl
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``.
    """
    m = _check_bt(response_mask)
    x, part, gidx, count, total, constant = _group_stats(scores, m, group_ids)
    d = x - total[gidx] / count[gidx].clamp(min=1)
    d = torch.where(constant[gidx] | ~part, 0.0, d)
    out = masked_whiten(_broadcast(d, m, torch.float64), m).to(_float_dtype(scores))
    return out, out.clone()


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


@dataclass
class AdvantageInputs:
    """The one input type of every registered advantage estimator.

    Attributes:
        token_level_rewards: (B, T) per-token rewards (score on the last valid token - β·KL).
            Outcome estimators (grpo, drgrpo, rloo, reinforce_plus_plus_baseline) use the
            per-response score ``masked sum over tokens``, as verl does, so KL placed in the
            reward flows into them.
        response_mask: (B, T), non-zero = counts.
        group_ids: (B,) int64 prompt labels; required by grpo, drgrpo, rloo,
            reinforce_plus_plus_baseline.
        values: (B, T) critic values; required by gae.
        gamma: discount (gae, reinforce_plus_plus).
        lam: GAE λ (gae).
        norm_by_std: grpo's scaling, ``"group"`` | ``"batch"`` | ``"none"`` (drgrpo forces
            ``"none"``); see :func:`compute_grpo_advantages`.
        eps: grpo's std epsilon.
        whiten: gae whitens its advantages.
        trajectory: (B,) int64 labels, or None (each row a trajectory of its own): the trajectory each row is a
            piece of (``agent.on_prefix_mismatch=split`` cuts one trajectory into several rows, which share its
            group). The outcome estimators then count each trajectory once: its score is the sum of its pieces'
            token-level rewards (the score, per-turn rewards and −β·KL of every piece: the sequence reward of the
            trajectory as a whole), its group statistics are over trajectories, and its advantage is on every
            valid token of every piece (:func:`trajectory_totals`). gae and reinforce_plus_plus refuse it: their
            returns run within a row, so what a later piece earns would not reach an earlier one.
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor | None = None
    values: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: str | bool = "group"
    eps: float = 1e-6
    whiten: bool = True
    trajectory: torch.Tensor | None = None


def trajectory_totals(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor, trajectory: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows that are pieces of trajectories, as one response per trajectory.

    Args:
        scores: (B,) each row's sequence reward; response_mask: (B, T); group_ids: (B,) int64;
        trajectory: (B,) int64, equal label = pieces of one trajectory (any integers).

    Returns:
        ``(totals, mask, groups, index)``: totals (N,) float64, each trajectory's score, the sum of its pieces'
        with a valid token; mask (N, 1) bool, the trajectory has a valid token in some piece (a one-token
        ``response_mask`` for the estimators over N responses); groups (N,) int64, its group; index (B,) int64,
        each row's trajectory in [0, N).

    Raises:
        ValueError: ``trajectory`` not (B,) integers, or the pieces of one trajectory in two groups (naming it).
    """
    b = response_mask.shape[0]
    if tuple(trajectory.shape) != (b,) or trajectory.is_floating_point() or trajectory.is_complex():
        raise ValueError(f"trajectory must be (B,) = ({b},) integers, got {tuple(trajectory.shape)} {trajectory.dtype}")
    part = response_mask.bool().any(dim=-1)  # (B,)
    labels, index = torch.unique(trajectory.to(group_ids.device), return_inverse=True)  # index: (B,) in [0, N)
    n = labels.numel()
    f64 = dict(dtype=torch.float64, device=part.device)
    totals = torch.zeros(n, **f64).index_add_(0, index, torch.where(part, scores.double(), 0.0))  # (N,)
    mask = torch.zeros(n, **f64).index_add_(0, index, part.double()) > 0  # (N,)
    lo = torch.full((n,), torch.iinfo(torch.long).max, dtype=torch.long, device=part.device)
    lo = lo.scatter_reduce(0, index, group_ids.long(), "amin")
    hi = torch.full_like(lo, torch.iinfo(torch.long).min).scatter_reduce(0, index, group_ids.long(), "amax")
    if bool((lo != hi).any()):
        k = int((lo != hi).nonzero()[0])
        raise ValueError(f"trajectory {int(labels[k])} has pieces in groups {int(lo[k])} and {int(hi[k])}")
    return totals, mask[:, None], lo, index


def _scores(inputs: AdvantageInputs) -> torch.Tensor:
    return masked_sum(inputs.token_level_rewards, inputs.response_mask, dim=-1)  # (B,)


def _need_groups(name: str, inputs: AdvantageInputs) -> torch.Tensor:
    if inputs.group_ids is None:
        raise ValueError(f"advantage estimator {name!r} needs group_ids (B,) in AdvantageInputs")
    return inputs.group_ids


def _no_trajectory(name: str, inputs: AdvantageInputs) -> None:
    if inputs.trajectory is not None:
        raise ValueError(
            f"advantage estimator {name!r} runs its returns within a row, and rows are pieces of trajectories "
            "(trajectory set): a later piece's rewards would not reach an earlier one; use an outcome estimator "
            "(grpo, drgrpo, rloo, reinforce_plus_plus_baseline)"
        )


def _outcome(name: str, inputs: AdvantageInputs, fn, *, whiten: bool = False):
    """``fn(scores (N,), mask (N, T'), group_ids (N,)) -> (adv, ret)`` over the rows, or with ``inputs.trajectory``
    over the trajectories (:func:`trajectory_totals`), each trajectory's advantage then on every valid token of its
    pieces; ``whiten``: then whitened over the batch's valid tokens (reinforce_plus_plus_baseline)."""
    ids, m = _need_groups(name, inputs), inputs.response_mask
    scores = _scores(inputs)
    if inputs.trajectory is None:
        return fn(scores, m, ids)
    totals, part, groups, index = trajectory_totals(scores, m, ids, inputs.trajectory)
    per_traj = fn(totals, part, groups)[0][:, 0]  # (N,) float64
    mb = _check_bt(m)
    out = _broadcast(per_traj[index], mb, torch.float64)  # (B, T)
    if whiten:
        out = masked_whiten(out, mb)
    out = out.to(_float_dtype(scores))
    return out, out.clone()


def _adv_gae(inputs: AdvantageInputs):
    _no_trajectory("gae", inputs)
    if inputs.values is None:
        raise ValueError("advantage estimator 'gae' needs values (B, T) in AdvantageInputs")
    return compute_gae(
        inputs.token_level_rewards,
        inputs.values,
        inputs.response_mask,
        inputs.gamma,
        inputs.lam,
        whiten=inputs.whiten,
    )


def _adv_grpo(inputs: AdvantageInputs):
    def fn(x, m, ids):
        return compute_grpo_advantages(x, m, ids, norm_by_std=inputs.norm_by_std, eps=inputs.eps)

    return _outcome("grpo", inputs, fn)


def _adv_drgrpo(inputs: AdvantageInputs):
    def fn(x, m, ids):
        return compute_grpo_advantages(x, m, ids, norm_by_std="none", eps=inputs.eps)

    return _outcome("drgrpo", inputs, fn)


def _adv_rloo(inputs: AdvantageInputs):
    return _outcome("rloo", inputs, compute_rloo_advantages)


def _adv_rpp(inputs: AdvantageInputs):
    _no_trajectory("reinforce_plus_plus", inputs)
    return compute_reinforce_pp_advantages(inputs.token_level_rewards, inputs.response_mask, gamma=inputs.gamma)


def _adv_rpp_baseline(inputs: AdvantageInputs):
    if inputs.trajectory is None:
        ids = _need_groups("reinforce_plus_plus_baseline", inputs)
        return compute_reinforce_pp_baseline_advantages(_scores(inputs), inputs.response_mask, ids)

    def centred(x, m, ids):  # the group mean subtracted, 0 for a constant group: drgrpo's advantage
        return compute_grpo_advantages(x, m, ids, norm_by_std="none")

    return _outcome("reinforce_plus_plus_baseline", inputs, centred, whiten=True)


_REGISTRY = {
    "gae": _adv_gae,
    "grpo": _adv_grpo,
    "drgrpo": _adv_drgrpo,
    "rloo": _adv_rloo,
    "reinforce_plus_plus": _adv_rpp,
    "reinforce_plus_plus_baseline": _adv_rpp_baseline,
}

ADVANTAGE_ESTIMATORS: tuple[str, ...] = tuple(_REGISTRY)
"""Names accepted by :func:`compute_advantages`."""


def compute_advantages(estimator: str, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to an advantage estimator by name; every entry takes the same :class:`AdvantageInputs`.

    Args:
        estimator: one of :data:`ADVANTAGE_ESTIMATORS`: ``gae``, ``grpo``, ``drgrpo`` (grpo
            without std), ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``.
        inputs: the batch.

    Returns:
        ``(advantages, returns)``, both (B, T), 0 on masked positions.

    Raises:
        ValueError: unknown name (lists the valid names); ``gae`` without ``values``; a group
            estimator without ``group_ids``; and the estimator's own errors.
    """
    fn = _REGISTRY.get(estimator)
    if fn is None:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid names: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return fn(inputs)
