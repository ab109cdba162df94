"""Training on the highest-entropy tokens (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv 2506.01939).

Only a minority of the tokens of a chain of thought are "forks" where the policy is uncertain; the
paper trains the policy gradient on the top ρ = 20% of tokens by entropy and matches or beats
training on all of them. TRL has it as ``top_entropy_quantile`` (``GRPOTrainer.get_high_entropy_mask``).
"""

from __future__ import annotations

import math

import torch

from .masked import as_bool_mask

__all__ = ["entropy_quantile_threshold", "top_entropy_mask"]


def entropy_quantile_threshold(entropy: torch.Tensor, mask: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of ``entropy`` over the counted positions, by linear interpolation between
    order statistics (``torch.quantile``'s default, which TRL uses): with the n counted values sorted
    as v_0 ≤ … ≤ v_{n−1} and p = q·(n − 1), it is v_⌊p⌋ + (p − ⌊p⌋)·(v_⌈p⌉ − v_⌊p⌋).

    Computed in float64 by a sort, so it has no input-size limit (``torch.quantile`` refuses more
    than 2²⁴ values) and is exactly the same for the same values in any order; a p within 1e-9 of an
    integer is taken as that integer (``1 − 0.9`` is 0.0999…98 in floating point, which would
    otherwise interpolate a hair away from the order statistic it means).

    Args:
        entropy: (B, T) entropy per position, nats (any float dtype).
        mask: (B, T), non-zero = the position counts.
        q: the quantile, in [0, 1].

    Returns:
        The threshold in nats (a Python float); NaN when no position counts.

    Raises:
        ValueError: ``q`` outside [0, 1], or shapes that differ.
    """
    if not (isinstance(q, (int, float)) and 0.0 <= q <= 1.0):
        raise ValueError(f"q must be a number in [0, 1], got {q!r}")
    if entropy.shape != mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and mask {tuple(mask.shape)} must have the same shape")
    values = entropy.detach()[as_bool_mask(mask)].to(torch.float64)
    n = values.numel()
    if n == 0:
        return float("nan")
    v = torch.sort(values).values
    p = q * (n - 1)
    # 1 - rho's float rounding (1 - 0.9 = 0.0999...98) must not move p off an order statistic
    if abs(p - round(p)) < 1e-9:
        p = float(round(p))
    lo = math.floor(p)
    hi = min(lo + 1, n - 1)
    frac = p - lo
    a, b = float(v[lo]), float(v[hi])
    return a + frac * (b - a) if frac > 0 else a


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> tuple[torch.Tensor, float]:
    """The counted positions whose entropy is among the highest fraction ``quantile`` (ρ) of them.

    With τ = :func:`entropy_quantile_threshold` (entropy, mask, 1 − ρ) over all counted positions of
    the batch, a position is kept when it counts and its entropy is ≥ τ (TRL's
    ``get_high_entropy_mask``). Ties at τ are all kept, so slightly more than ρ of the positions may
    be kept (all of them when every entropy is equal); ρ = 1 keeps every counted position
    (τ = the minimum).

    The trainer computes it once per step over the whole batch from π_old's entropy, so the kept
    tokens do not depend on how the update splits the batch, and multiplies it into the policy
    loss's per-token weights only (the paper's and TRL's choice: the KL term and the entropy bonus
    keep every token, and the loss's denominators are unchanged).

    Args:
        entropy: (B, T) entropy of the policy at each position, nats.
        mask: (B, T), non-zero = the position counts.
        quantile: ρ in (0, 1]: the fraction of counted positions to keep (0.2 in the paper).

    Returns:
        (keep (B, T) bool, τ in nats; NaN and keep all-False when nothing counts).

    Raises:
        ValueError: ``quantile`` outside (0, 1], or shapes that differ.
    """
    if not (isinstance(quantile, (int, float)) and 0.0 < quantile <= 1.0):
        raise ValueError(f"quantile (rho) must be a number in (0, 1], got {quantile!r}")
    threshold = entropy_quantile_threshold(entropy, mask, 1.0 - float(quantile))
    m = as_bool_mask(mask)
    if math.isnan(threshold):
        return torch.zeros_like(m), threshold
    keep = m & (entropy.detach().to(torch.float64) >= threshold)
    return keep, threshold
