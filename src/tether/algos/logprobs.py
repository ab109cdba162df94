"""Log-probabilities, entropy and exact KL from logits, in chunks over the sequence.

Shapes: ``logits`` is (B, T, V) (any leading dims work: (..., V)), ``ids`` is (B, T). ``logits[b, t]``
must be the logits that predict ``ids[b, t]`` (the caller shifts a causal LM's outputs by one).
Logits are divided by the sampling ``temperature`` before every quantity, for the policy and the
reference alike (as verl does in its actor and reference workers).

Why custom autograd functions: the naive ``log_softmax(logits).gather(...)`` materialises a full
(B, T, V) float32 tensor, and under autograd keeps it alive until backward. Here the forward pass
walks over ``chunk_size`` token positions at a time and keeps only (B, T) results; backward
recomputes the softmax of one chunk at a time from the saved logits (which the caller holds
anyway). Extra memory is therefore O(chunk_size · V), not O(B · T · V). The gradient with respect
to the logits is, of course, a full (B, T, V) tensor.

All computations run in float32 (float64 if the logits are float64); results are float32/float64.
Logits equal to -inf (a masked vocabulary) are allowed: they get probability 0, contribute 0 to
entropy and KL, and receive a 0 gradient. A row whose logits are *all* -inf has no distribution
and gives NaN.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "logprobs_from_logits",
    "entropy_from_logits",
    "logprobs_and_entropy_from_logits",
    "kl_full",
]

DEFAULT_CHUNK_ELEMENTS = {"cpu": 1 << 22, "accelerator": 1 << 24}
"""Default chunk budget in logits per chunk: 2**22 on CPU (16 MiB per float32 temporary, 27 positions at
V=151936; below glibc's mmap threshold, so chunks reuse heap memory), 2**24 on GPUs (64 MiB, 110
positions: fewer, larger kernels; about twice as fast as 2**22 on an H200, see docs/performance.md)."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(vocab: int, chunk_size: int | None, device: torch.device) -> int:
    if chunk_size is None:
        budget = DEFAULT_CHUNK_ELEMENTS["cpu" if device.type == "cpu" else "accelerator"]
        return max(1, budget // max(vocab, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of token positions, got {chunk_size}")
    return int(chunk_size)


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def _scaled(chunk: torch.Tensor, temperature: float, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """``chunk / temperature`` in ``dtype``; also says whether the result is a private copy
    (safe to modify in place) or a view of the caller's logits (never modify)."""
    if chunk.dtype != dtype:
        z = chunk.to(dtype)
        return (z.div_(temperature) if temperature != 1.0 else z), True
    if temperature != 1.0:
        return chunk / temperature, True
    return chunk, False


def _zero_nan_(x: torch.Tensor) -> torch.Tensor:
    """In place: NaN -> 0 (from 0 · -inf, i.e. the convention 0 · log 0 = 0); ±inf kept."""
    return torch.nan_to_num_(x, nan=0.0, posinf=math.inf, neginf=-math.inf)


def _log_probs(chunk: torch.Tensor, temperature: float, dtype: torch.dtype, lse: torch.Tensor) -> torch.Tensor:
    """Private (kb, kt, V) log-softmax of ``chunk / temperature`` given its logsumexp (kb, kt)."""
    z, private = _scaled(chunk, temperature, dtype)
    return z.sub_(lse[..., None]) if private else z - lse[..., None]


def _chunks(b: int, t: int, rows: int):
    """Yield (batch slice, time slice) pairs covering a (B, T) grid with ≤ ``rows`` positions each.

    Chunks are taken directly from the (B, T, V) tensor, so a non-contiguous input (for example
    ``model_logits[:, :-1]``) is never copied as a whole; at most one chunk is copied.
    """
    if t == 0 or b == 0:
        return
    if rows >= t:
        k = rows // t
        for b0 in range(0, b, k):
            yield slice(b0, min(b0 + k, b)), slice(0, t)
    else:
        for bi in range(b):
            for t0 in range(0, t, rows):
                yield slice(bi, bi + 1), slice(t0, min(t0 + rows, t))


class _LogprobEntropy(torch.autograd.Function):
    """Chunked log π(ids) and entropy H(π) per position; see the module docstring.

    Per chunk, forward holds at most the scaled chunk, logsumexp's temporaries, and log p / p;
    backward holds log p and p and builds the chunk's gradient in their buffers.
    """

    @staticmethod
    def forward(ctx, logits, ids, temperature, rows, with_logprobs, with_entropy):  # (B, T, V), (B, T)
        b, t, _ = logits.shape
        dtype = _compute_dtype(logits.dtype)
        lse = torch.empty(b, t, dtype=dtype, device=logits.device)
        lp = torch.empty((b, t) if with_logprobs else (0,), dtype=dtype, device=logits.device)
        ent = torch.empty((b, t) if with_entropy else (0,), dtype=dtype, device=logits.device)
        for bs, ts in _chunks(b, t, rows):
            z, private = _scaled(logits[bs, ts], temperature, dtype)  # (kb, kt, V)
            c_lse = torch.logsumexp(z, dim=-1)  # (kb, kt)
            lse[bs, ts] = c_lse
            if with_logprobs:
                lp[bs, ts] = z.gather(-1, ids[bs, ts, None]).squeeze(-1) - c_lse
            if with_entropy:
                logp = z.sub_(c_lse[..., None]) if private else z - c_lse[..., None]  # (kb, kt, V)
                ent[bs, ts] = -_zero_nan_(logp.exp().mul_(logp)).sum(-1)  # -Σ p log p, 0 log 0 = 0
                del logp
            del z
        ctx.save_for_backward(logits, ids, lse, ent)
        ctx.temperature, ctx.rows = temperature, rows
        # an output the loss does not use (entropy kept only as a metric) gets None, not a zero
        # gradient, so backward skips its per-chunk work
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, ids, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        temp, rows = ctx.temperature, ctx.rows
        dtype = lse.dtype
        grad = torch.empty_like(logits)
        use_lp = g_lp is not None and g_lp.numel() > 0
        use_ent = g_ent is not None and g_ent.numel() > 0
        b, t, _ = logits.shape
        for bs, ts in _chunks(b, t, rows):
            logp = _log_probs(logits[bs, ts], temp, dtype, lse[bs, ts])  # (kb, kt, V), private
            p = logp.exp()
            if use_ent:
                # d H / d z_j = -p_j (log p_j + H), built in logp's buffer
                gz = _zero_nan_(logp.add_(ent[bs, ts, None]).mul_(p)).mul_(-g_ent[bs, ts, None].to(dtype))
                if use_lp:
                    gz.addcmul_(p, g_lp[bs, ts, None].to(dtype), value=-1.0)
            elif use_lp:
                gz = p.mul_(-g_lp[bs, ts, None].to(dtype))
            else:
                gz = p.zero_()
            if use_lp:
                # d log p_i / d z_j = [i = j] - p_j: the one-hot part
                gz.scatter_add_(-1, ids[bs, ts, None], g_lp[bs, ts, None].to(dtype))
            if temp != 1.0:
                gz.div_(temp)
            grad[bs, ts] = gz
            del logp, p, gz
        return grad, None, None, None, None, None


def _as_btv(logits: torch.Tensor, ids: torch.Tensor | None):
    """View (..., V) logits as (B, T, V) and ids as (B, T); returns the leading shape too."""
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (..., V), got {tuple(logits.shape)}")
    lead = tuple(logits.shape[:-1])
    if ids is not None and tuple(ids.shape) != lead:
        raise ValueError(f"ids must have shape {lead} to match logits {tuple(logits.shape)}, got {tuple(ids.shape)}")
    if logits.dim() == 2:  # (N, V) -> (1, N, V)
        x = logits.unsqueeze(0)
    elif logits.dim() == 3:
        x = logits
    else:
        x = logits.reshape(-1, logits.shape[-2], logits.shape[-1])
    i = None
    if ids is not None:
        i = ids.long().reshape(x.shape[:2])
    return lead, x, i


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = True,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``ids`` and entropy of the token distribution, fused, in chunks.

    Args:
        logits: (B, T, V) raw logits, any float dtype; ``logits[b, t]`` predicts ``ids[b, t]``.
        ids: (B, T) integer token ids in ``[0, V)``.
        temperature: sampling temperature τ > 0; logits are divided by τ first.
        with_entropy: also return the entropy (else ``None``).
        chunk_size: token positions per chunk; ``None`` picks ``max(1, N // V)`` so one chunk
            holds at most N logits, N = 2**22 on CPU and 2**24 on a GPU
            (:data:`DEFAULT_CHUNK_ELEMENTS`).

    Returns:
        ``(logprobs, entropy)``: (B, T) log π(ids | ·) in nats (≤ 0) and (B, T) entropy
        H = -Σ_v π_v log π_v in nats (or ``None``), in float32 (float64 for float64 logits).
        Both are differentiable with respect to ``logits``; the memory beyond the inputs is
        O(chunk_size · V) in forward and backward.

    Raises:
        ValueError: bad shapes, temperature ≤ 0 or non-finite, chunk_size < 1.

    Source: log-softmax + gather as in verl ``logprobs_from_logits`` and entropy as in verl
    ``entropy_from_logits`` (logsumexp(z) - Σ softmax(z)·z), rewritten with 0·log 0 = 0 so that
    -inf logits give finite values and gradients.
    """
    t = _check_temperature(temperature)
    lead, x, i = _as_btv(logits, ids)
    rows = _rows_per_chunk(x.shape[-1], chunk_size, x.device)
    lp, ent = _LogprobEntropy.apply(x, i, t, rows, True, with_entropy)
    return lp.reshape(lead), (ent.reshape(lead) if with_entropy else None)


def logprobs_from_logits(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, *, chunk_size: int | None = None
) -> torch.Tensor:
    """(B, T) log π(ids[b, t]) in nats from (B, T, V) logits divided by ``temperature``.

    Chunked and differentiable; see :func:`logprobs_and_entropy_from_logits` for details,
    errors and source.
    """
    return logprobs_and_entropy_from_logits(logits, ids, temperature, with_entropy=False, chunk_size=chunk_size)[0]


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, *, chunk_size: int | None = None
) -> torch.Tensor:
    """(B, T) entropy H(π(· | s_t)) in nats of the softmax of ``logits / temperature`` (B, T, V).

    0 · log 0 is taken as 0, so -inf logits are allowed: the entropy of logits [0, 0, -inf] is
    ln 2 and its gradient is finite (here exactly 0). Chunked and differentiable; see
    :func:`logprobs_and_entropy_from_logits` for errors and source.
    """
    t = _check_temperature(temperature)
    lead, x, _ = _as_btv(logits, None)
    rows = _rows_per_chunk(x.shape[-1], chunk_size, x.device)
    _, ent = _LogprobEntropy.apply(x, None, t, rows, False, True)
    return ent.reshape(lead)


class _FullKL(torch.autograd.Function):
    """Chunked exact KL(softmax(z) ‖ softmax(z_ref)) per position."""

    @staticmethod
    def _log_softmax(chunk, temperature, dtype):
        z, _ = _scaled(chunk, temperature, dtype)
        return torch.log_softmax(z, dim=-1)

    @staticmethod
    def forward(ctx, logits, ref_logits, temperature, rows):  # (B, T, V), (B, T, V)
        b, t, _ = logits.shape
        dtype = _compute_dtype(torch.promote_types(logits.dtype, ref_logits.dtype))
        out = torch.empty(b, t, dtype=dtype, device=logits.device)
        for bs, ts in _chunks(b, t, rows):
            logp = _FullKL._log_softmax(logits[bs, ts], temperature, dtype)  # (kb, kt, V)
            diff = _FullKL._log_softmax(ref_logits[bs, ts], temperature, dtype).neg_().add_(logp)  # log p - log q
            out[bs, ts] = _zero_nan_(diff.mul_(logp.exp_())).sum(-1)  # Σ p (log p - log q), 0 log 0 = 0
            del logp, diff
        ctx.save_for_backward(logits, ref_logits, out)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, g):
        logits, ref_logits, kl = ctx.saved_tensors
        temp, rows = ctx.temperature, ctx.rows
        need_p, need_q = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gp = torch.empty_like(logits) if need_p else None
        gq = torch.empty_like(ref_logits) if need_q else None
        b, t, _ = logits.shape
        for bs, ts in _chunks(b, t, rows):
            logp = _FullKL._log_softmax(logits[bs, ts], temp, kl.dtype)  # (kb, kt, V)
            logq = _FullKL._log_softmax(ref_logits[bs, ts], temp, kl.dtype)
            p = logp.exp()
            gc = g[bs, ts, None].to(kl.dtype) / temp  # (kb, kt, 1)
            if need_q:
                # d KL / d z_ref_j = q_j - p_j
                gq[bs, ts] = logq.exp().sub_(p).mul_(gc)
            if need_p:
                # d KL / d z_j = p_j (log p_j - log q_j - KL)
                gp[bs, ts] = _zero_nan_(logp.sub_(logq).sub_(kl[bs, ts, None]).mul_(p)).mul_(gc)
            del logp, logq, p
        return gp, gq, None, None


def kl_full(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Exact per-position KL(π ‖ π_ref) = Σ_v π_v (log π_v - log π_ref,v) over the vocabulary.

    Args:
        logits: (B, T, V) policy logits.
        ref_logits: (B, T, V) reference logits (same shape), divided by the same temperature.
        temperature: sampling temperature τ > 0.
        chunk_size: token positions per chunk; ``None``: as in :func:`logprobs_and_entropy_from_logits`.

    Returns:
        (B, T) KL in nats per token, ≥ 0 (up to round-off), float32 (float64 for float64
        inputs). Differentiable with respect to both logit tensors, in chunks. A token that π
        can emit but π_ref cannot (π_ref logit -inf where π's is finite) has KL = +inf, which is
        the exact value; mask it out or clamp downstream.

    Raises:
        ValueError: shapes differ, temperature ≤ 0 or non-finite, chunk_size < 1.

    Source: the definition of KL; this is verl's ``kl_penalty="full"`` estimator, which needs
    the logits (tether does not accept it in :func:`kl_penalty`, which sees only log-probs).
    """
    if tuple(logits.shape) != tuple(ref_logits.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} must have the same shape"
        )
    t = _check_temperature(temperature)
    lead, x, _ = _as_btv(logits, None)
    _, xr, _ = _as_btv(ref_logits, None)
    rows = _rows_per_chunk(x.shape[-1], chunk_size, x.device)
    return _FullKL.apply(x, xr, t, rows).reshape(lead)
