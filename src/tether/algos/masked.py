"""Masked statistics over (B, T) tensors.

Every function takes a ``mask`` of the same shape as ``x`` (or broadcastable to it) in which a
non-zero entry means "this position counts" (tether never uses the reverse convention). Masked
positions are removed with :func:`torch.where`, never by multiplying with the mask, so an ``inf``
or ``NaN`` stored at a masked position cannot leak into a result or into a gradient
(``0 * inf`` is ``NaN``; ``where`` selects without arithmetic).
"""

from __future__ import annotations

import torch

Dim = int | tuple[int, ...] | None

__all__ = ["as_bool_mask", "masked_sum", "masked_count", "masked_mean", "masked_var", "masked_whiten"]


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as a bool tensor (non-zero = the position counts).

    Shape: unchanged. Accepts bool, integer or floating masks.
    """
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, *, keepdim: bool = False) -> torch.Tensor:
    """Sum of ``x`` over the positions where ``mask`` is non-zero.

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape as ``x`` (broadcastable); non-zero = counts.
        dim: dimension(s) to reduce; ``None`` reduces everything to a 0-d tensor.
        keepdim: keep reduced dimensions with size 1.

    Returns:
        The masked sum, in the units of ``x``. Masked entries never contribute, even inf/NaN.
    """
    kept = torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return kept.sum()
    return kept.sum(dim=dim, keepdim=keepdim)


def masked_count(mask: torch.Tensor, dim: Dim = None, *, keepdim: bool = False) -> torch.Tensor:
    """Number of counted positions (int64), reduced like :func:`masked_sum`."""
    m = as_bool_mask(mask)
    if dim is None:
        return m.sum()
    return m.sum(dim=dim, keepdim=keepdim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, *, keepdim: bool = False) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is non-zero.

    Args:
        x: any shape, e.g. (B, T) per-token values (units of ``x``).
        mask: same shape as ``x``; non-zero = counts.
        dim: dimension(s) to reduce; ``None`` gives the global mean over all counted positions
            (e.g. the per-token mean over a whole batch), ``dim=-1`` the per-response mean (B,).

    Returns:
        The masked mean. Where no position counts the result is 0 (verl divides by
        ``count + 1e-8``, which gives the same 0; tether divides by ``max(count, 1)`` so that a
        non-empty mean is exact).

    Source: ``verl.utils.torch_functional.masked_mean`` (same value on non-empty masks).
    """
    total = masked_sum(x, mask, dim, keepdim=keepdim)
    count = masked_count(mask, dim, keepdim=keepdim).clamp(min=1).to(total.dtype)
    return total / count


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, *, dim: Dim = None, keepdim: bool = False
) -> torch.Tensor:
    """Variance of ``x`` over the counted positions (two-pass: centre first, then square).

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape as ``x``; non-zero = counts.
        unbiased: divide by ``n - 1`` (Bessel) instead of ``n``.
        dim: dimension(s) to reduce; ``None`` reduces everything.

    Returns:
        The variance in units of ``x`` squared. With fewer than two counted positions (unbiased)
        or none (biased) the variance is undefined and 0 is returned. verl raises a ValueError
        in that case (which costs a host sync on GPU); tether returns 0 so that whitening a
        single token gives 0 rather than a crash.
    """
    m = as_bool_mask(mask)
    mean = masked_mean(x, m, dim, keepdim=True)
    centred = torch.where(m, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))
    sq = masked_sum(centred * centred, m, dim, keepdim=keepdim)
    n = masked_count(m, dim, keepdim=keepdim).to(sq.dtype)
    denom = (n - 1.0) if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp(min=1.0), torch.zeros((), dtype=sq.dtype, device=sq.device))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Whiten ``x`` with the mean and unbiased variance of its counted positions.

    ``out = (x - mean) / sqrt(var + eps)`` on counted positions (``+ mean`` again when
    ``shift_mean=False``), 0 on masked positions. Statistics are global over all counted
    positions of the tensor (for advantages: over every valid token of the batch).

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape; non-zero = counts.
        shift_mean: if False, keep the original mean (only rescale).
        eps: added to the variance before the square root (verl's default 1e-8).

    Returns:
        Tensor of the shape of ``x``, dimensionless (units of ``x`` when ``shift_mean=False``
        keeps the mean), 0 at masked positions.

    Source: ``verl.utils.torch_functional.masked_whiten`` (same formula; tether additionally
    zeroes masked positions).
    """
    m = as_bool_mask(mask)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    n = m.sum().to(x.dtype)
    # where() before any arithmetic: (x - mean) * rsqrt(var) would otherwise send 0 * inf = NaN
    # into d/d(var) from a masked inf.
    mean = torch.where(m, x, zero).sum() / n.clamp(min=1)
    centred = torch.where(m, x - mean, zero)  # (same shape as x), 0 where masked
    var = torch.where(n > 1, (centred * centred).sum() / (n - 1).clamp(min=1), zero)  # unbiased
    out = centred * torch.rsqrt(var + eps)
    if shift_mean:
        return out
    return torch.where(m, out + mean, zero)
