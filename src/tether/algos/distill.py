"""On-policy distillation: a divergence to a frozen teacher, on the student's own samples.

Notation: π_θ the student being trained, π_old the student that sampled the batch, π_T the frozen teacher; for a
response y = (a_1, ..., a_n) to a prompt x, s_t = (x, a_<t).

**k1** (``distill.estimator=k1``, :func:`distill_k1`): the sampled-token reverse KL as a per-token reward. The
objective term is −λ·KL_seq(π ‖ π_T), the reverse KL (student first) between the two distributions over whole
responses, which the chain rule splits into the per-state KLs along π's own path:

    KL_seq(π ‖ π_T) = E_{y~π}[Σ_t log π(a_t|s_t) − log π_T(a_t|s_t)] = E_{y~π}[Σ_t KL(π(·|s_t) ‖ π_T(·|s_t))].

k1_t = log π_old(a_t|s_t) − log π_T(a_t|s_t) at the sampled token is the single-sample estimate of both: under
a_t ~ π_old(·|s_t), E[k1_t | s_t] = KL(π_old(·|s_t) ‖ π_T(·|s_t)) (nats), and E_{y~π_old}[Σ_t k1_t] =
KL_seq(π_old ‖ π_T). As a reward (−λ·k1_t on each response token, held constant in the gradient), its REINFORCE
gradient with return-to-go is −λ·∇_θ KL_seq(π_θ ‖ π_T) exactly at θ = θ_old: ∇KL_seq = E[Σ_t (Σ_u k1_u)·∇log π_θ(a_t)]
+ E[Σ_t ∇log π_θ(a_t)], the second term is 0 (the score has mean 0), and the terms u < t of the first vanish in
expectation. ``tests/algos/test_algos_distill.py`` checks this by enumeration, and what does not hold: samples of
another policy μ ≠ π_θ without an importance ratio give E_μ[...] ≠ −λ∇KL_seq(π_θ ‖ π_T).

**Full-vocabulary estimators** (``reverse``, ``forward``, ``jsd``; :func:`distill_divergence`) use both models' logits
at every visited state. Each optimises

    D(θ) = E_{y~π_θ}[Σ_t f_t(θ)],    f_t(θ) = f(π_θ(·|s_t), π_T(·|s_t)),

with f the reverse KL KL(π_θ(·|s) ‖ π_T(·|s)) (then D = KL_seq(π_θ ‖ π_T)), the forward KL KL(π_T(·|s) ‖ π_θ(·|s)),
or GKD's generalised JSD. θ enters D twice, through f at fixed states and through which states are visited:

    ∇D(θ) = E_{y~π_θ}[Σ_t ∇f_t(θ)]  +  E_{y~π_θ}[Σ_t ∇log π_θ(a_t|s_t) · Σ_{u>t} f_u(θ)].
            (per-state part)            (state-visitation part)

The per-state part is the gradient of the loss term Σ_t f_t(θ) (what GKD-style trainers optimise alone); the
visitation part is the REINFORCE gradient of the per-token reward −f_u held constant (:func:`subtract_token_penalty`
with ``penalty`` = the detached f_t at θ_old): its return-to-go Σ_{u≥t} also carries u = t, whose term has mean 0
because f_t depends on s_t only and E[∇log π_θ(a_t|s_t) | s_t] = 0. Under y ~ π_old with θ = θ_old (on-policy) the
expected gradient of loss term plus reward is exactly ∇D; the loss term alone misses the visitation part. Under another
policy's samples μ ≠ π_θ: with the sequence weight π_θ(y)/μ(y) on both parts and f at θ it is exact again; with what
PPO applies (the per-token ratio π_θ(a_t|s_t)/μ(a_t|s_t) on the reward's policy gradient, f in the reward frozen at
μ = π_old, the loss term unweighted at μ's states) it is the gradient of a surrogate that equals ∇D at θ = θ_old and
differs from it by O(‖θ − θ_old‖) after (a PPO epoch's later mini-batches). ``tests/algos/test_algos_distill.py``
enumerates each of these.

Source: the per-token reverse-KL reward of on-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of
Language Models", GKD with the reverse KL; Thinking Machines' "On-Policy Distillation", 2025; the same design in
slime, prime-rl and verl's recipe): the student samples, the teacher scores the sampled tokens. The per-state
divergences and the generalised JSD: Agarwal et al. 2024, Eq. (1) and Section 3.
"""

from __future__ import annotations

import math

import torch

from .logprobs import _chunks, _rows_per_chunk
from .masked import as_bool_mask, masked_mean

__all__ = [
    "DISTILL_ESTIMATORS",
    "FULL_DISTILL_ESTIMATORS",
    "distill_k1",
    "distill_divergence",
    "subtract_token_penalty",
    "sequence_kl_mean",
    "DIVERGENCE_CHUNK_TEMPORARIES",
]

DIVERGENCE_CHUNK_TEMPORARIES: dict[str, int] = {"reverse": 9, "forward": 9, "jsd": 10}
"""Float32 tensors of one chunk's (rows, V) size alive at once in :func:`distill_divergence`'s forward, by estimator,
counted from the code (``_divergence``): the scaled logits z and z_T, log p and log q (4), then in ``_plogp_diff``
p, the two masked log-probs, their product and the ``where`` output (5); ``jsd`` keeps log m beside them (10). A
(rows, V) bool mask (1 byte an element) comes on top. With ``top_k`` all but z and z_T are (rows, k): fewer bytes.
``tether plan`` counts these (:func:`tether.plan.full_logits_bytes`)."""

FULL_DISTILL_ESTIMATORS: tuple[str, ...] = ("reverse", "forward", "jsd")
"""The ``distill.estimator`` values computed from both models' logits (:func:`distill_divergence`)."""

DISTILL_ESTIMATORS: tuple[str, ...] = ("k1",) + FULL_DISTILL_ESTIMATORS
"""``distill.estimator`` values: ``k1`` (:func:`distill_k1`, log-probs of the sampled tokens) and
:data:`FULL_DISTILL_ESTIMATORS`."""


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


def _plogp_diff(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Σ_v p_v (log p_v − log q_v) over the last axis, with 0·(anything) = 0 where p_v = 0 (a −inf log p), also in
    the gradient; +inf where p_v > 0 = q_v (the exact value)."""
    p = logp.exp()
    live = p > 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp = torch.where(live, logp, zero)
    lq = torch.where(live, logq, zero)
    return torch.where(live, p * (lp - lq), zero).sum(-1)


def distill_divergence(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    estimator: str,
    *,
    jsd_beta: float = 0.5,
    top_k: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The exact per-state divergence f(π_θ(·|s), π_T(·|s)) between the student and the teacher at each position.

    With p = softmax(logits/τ) (the student π_θ(·|s)) and q = softmax(teacher_logits/τ) (the teacher π_T(·|s)):

    * ``reverse``: KL(p ‖ q) = Σ_v p_v (log p_v − log q_v), the student first (mode-seeking);
    * ``forward``: KL(q ‖ p) = Σ_v q_v (log q_v − log p_v), the teacher first (mass-covering);
    * ``jsd``: GKD's generalised JSD with b = ``jsd_beta``: JSD_b = b·KL(q ‖ m) + (1 − b)·KL(p ‖ m), m = b·q + (1 − b)·p
      (the mixture puts weight b on the teacher, as Agarwal et al. 2024 Eq. (1) with P = teacher, Q = student). As
      b → 0, JSD_b / b → KL(q ‖ p) (forward); as b → 1, JSD_b / (1 − b) → KL(p ‖ q) (reverse); b = 0.5 is the JSD.

    With ``top_k`` = k the sum runs over K(s), the teacher's k most likely tokens at that state, and both p and q are
    renormalised over K(s) (p|K, q|K): f = D(p|K, q|K). Its bias: it ignores the student's mass outside K(s) (a
    student that is q's shape on K(s) has f = 0 however much mass it puts elsewhere) and the teacher's tail. It does
    not reward shrinking the student's mass on K(s): f is unchanged when every logit in K(s) moves by the same
    constant. (The unrenormalised Σ_{v∈K} p_v (log p_v − log q_v) does: it falls, below 0, as p's mass on K(s)
    shrinks; not offered.) k ≥ V is the full vocabulary.

    Under y ~ π_old, Σ_t f_t at θ = θ_old is an unbiased estimate of D(θ_old) = E_{y~π_old}[Σ_t f_t] (the module
    docstring); for ``reverse`` D is KL_seq(π_old ‖ π_T) and its estimate has no sampling noise inside a state (lower
    variance than k1's).

    Args:
        logits: (..., V) student logits, differentiable.
        teacher_logits: (..., V) teacher logits, the same shape (no gradient is needed through them).
        estimator: one of :data:`FULL_DISTILL_ESTIMATORS`.
        jsd_beta: b ∈ (0, 1), the teacher's weight in ``jsd``'s mixture; ignored otherwise.
        top_k: k ≥ 1 or None (the full vocabulary).
        temperature: τ > 0; both logit tensors are divided by it (``rollout.temperature``).
        chunk_size: positions per chunk; ``None`` as :func:`tether.algos.kl_full` (at most 2**22 logits a chunk on
            CPU, 2**24 on an accelerator).

    Returns:
        (...,) divergence in nats per state, float32 at least (float64 for float64 inputs), ≥ 0 up to round-off;
        +inf for ``reverse`` where the student gives mass to a token the teacher cannot emit (and for ``forward``
        the other way round), the exact value. Computed in chunks of positions, as :func:`tether.algos.kl_full`: the
        forward holds :data:`DIVERGENCE_CHUNK_TEMPORARIES` float32 chunks, the backward recomputes each chunk and
        builds the (..., V) gradient of the inputs that need one.

    Raises:
        ValueError: an unknown estimator (lists the valid ones), shapes that differ, jsd_beta outside (0, 1),
            top_k < 1, temperature ≤ 0, chunk_size < 1.
    """
    if estimator not in FULL_DISTILL_ESTIMATORS:
        raise ValueError(
            f"distill_divergence: unknown estimator {estimator!r}; use one of {', '.join(FULL_DISTILL_ESTIMATORS)} "
            "(k1 needs only log-probs: distill_k1)"
        )
    if tuple(logits.shape) != tuple(teacher_logits.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} and teacher_logits {tuple(teacher_logits.shape)} must have the same shape"
        )
    if not 0.0 < jsd_beta < 1.0:
        raise ValueError(f"jsd_beta must be in (0, 1), got {jsd_beta!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    dtype = torch.promote_types(torch.promote_types(logits.dtype, teacher_logits.dtype), torch.float32)
    lead, v = tuple(logits.shape[:-1]), logits.shape[-1]
    x = logits.reshape(1, -1, v) if logits.dim() != 3 else logits
    xt = teacher_logits.to(device=logits.device).reshape(x.shape)
    rows = _rows_per_chunk(v, chunk_size, logits.device)
    fn = _DivergenceFn(estimator, float(jsd_beta), top_k, float(temperature), dtype)
    return _ChunkedDivergence.apply(x, xt, fn, rows).reshape(lead)


class _DivergenceFn:
    """f per position of one (kb, kt, V) chunk of both logit tensors: :func:`distill_divergence`'s formulas."""

    def __init__(self, estimator: str, jsd_beta: float, top_k: int | None, temperature: float, dtype: torch.dtype):
        self.estimator, self.b, self.top_k = estimator, jsd_beta, top_k
        self.temperature, self.dtype = temperature, dtype

    def __call__(self, logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        z = logits.to(self.dtype) / self.temperature
        zt = teacher_logits.to(self.dtype) / self.temperature
        if self.top_k is not None and self.top_k < z.shape[-1]:
            idx = zt.topk(self.top_k, dim=-1).indices  # K(s): the teacher's k most likely tokens
            z, zt = z.gather(-1, idx), zt.gather(-1, idx)
        logp = torch.log_softmax(z, dim=-1)  # the student, renormalised over K(s) under top_k
        logq = torch.log_softmax(zt, dim=-1)  # the teacher
        if self.estimator == "reverse":
            return _plogp_diff(logp, logq)
        if self.estimator == "forward":
            return _plogp_diff(logq, logp)
        b = self.b
        logm = torch.logaddexp(logq + math.log(b), logp + math.log1p(-b))  # log(b·q + (1 − b)·p)
        return b * _plogp_diff(logq, logm) + (1.0 - b) * _plogp_diff(logp, logm)


class _ChunkedDivergence(torch.autograd.Function):
    """f over a (B, T, V) grid in chunks of at most ``rows`` positions: the forward keeps no (B, T, V) temporary,
    the backward recomputes each chunk under autograd and writes its gradient into the (B, T, V) result (f of a
    position depends on that position's logits only, so the chunks' gradients do not overlap). The same operations
    per position as one unchunked call, so the same values and gradients to float rounding. Not twice
    differentiable."""

    @staticmethod
    def forward(ctx, logits, teacher_logits, fn, rows):  # (B, T, V), (B, T, V)
        b, t, _ = logits.shape
        out = torch.empty(b, t, dtype=fn.dtype, device=logits.device)
        for bs, ts in _chunks(b, t, rows):
            out[bs, ts] = fn(logits[bs, ts], teacher_logits[bs, ts])
        ctx.save_for_backward(logits, teacher_logits)
        ctx.fn, ctx.rows = fn, rows
        return out

    @staticmethod
    def backward(ctx, g):
        logits, teacher_logits = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        grads = [torch.empty_like(x) if n else None for x, n in zip((logits, teacher_logits), need, strict=True)]
        b, t, _ = logits.shape
        for bs, ts in _chunks(b, t, ctx.rows):
            with torch.enable_grad():
                xs = [x[bs, ts].detach().requires_grad_(n) for x, n in zip((logits, teacher_logits), need, strict=True)]
                f = ctx.fn(*xs)
                wrt = [x for x in xs if x.requires_grad]
                got = iter(torch.autograd.grad(f, wrt, g[bs, ts].to(f.dtype)))
            for gr, n in zip(grads, need, strict=True):
                if n:
                    gr[bs, ts] = next(got)
        return grads[0], grads[1], None, None
