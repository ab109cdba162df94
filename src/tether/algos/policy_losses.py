"""The policy-loss family: one registry, one signature (``algo.policy_loss``).

Every mode maps the same inputs to ``(loss, metrics)``::

    policy_loss(name, logprobs, old_logprobs, advantages, response_mask, *, agg_mode, weights=None, **hyper)

with ``logprobs`` (B, T) log π_θ of the sampled tokens (nats, differentiable), ``old_logprobs`` (B, T)
log π_old of the policy that sampled them (nats), ``advantages`` (B, T) and ``response_mask`` (B, T).
Each mode builds a (B, T) per-token loss ℓ; ``weights`` (the rollout-correction weights, used
detached) multiply it, and :func:`tether.algos.agg_loss` reduces it with ``agg_mode``. A
sequence-level mode (``gspo``, ``gmpo``) puts its per-response loss on each of the response's tokens,
so ``seq-mean-token-mean`` (their papers' aggregation, :data:`POLICY_LOSS_AGG`) averages it over
responses. Every exponent is of a log-ratio clamped at ±``log_ratio_clamp`` (20 nats by default, the
clamp of :func:`tether.algos.ppo_policy_loss`): verl exponentiates ``clip_cov``'s, ``kl_cov``'s and
``geo_mean``'s log-ratios without one.

At θ = θ_old every mode's gradient is the policy gradient −E[A ∇log π_θ] of its aggregation (each
ratio is 1, each gate's slope is 1), except that ``clip_cov`` and ``kl_cov`` leave out the tokens
they select and ``top``-style masks zero theirs. They differ off-policy: in how far a token's (or a
response's) ratio may move before its gradient is cut, bent or capped. ``docs/training.md``
("Policy losses") compares them; ``docs/stability.md`` measures them against the embedded task's
exact optimum.

Metrics (floats, over this call's valid tokens), for every mode: ``policy/pg_loss``,
``policy/clipfrac`` (the fraction of tokens whose gradient the mode's trust region cut or capped),
``policy/clipfrac_lower`` (the lower side where a mode has one, else 0), ``policy/approx_kl``
(mean log π_old − log π, nats per token, the k1 estimate of KL(π_old‖π_θ)). Sequence-level modes add
``policy/seq_ratio_mean`` and ``policy/seq_ratio_abs_dev`` (mean |s − 1|), each response weighted by its tokens;
``clip_cov`` and ``kl_cov``
add ``policy/cov_selected_frac``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .losses import Count, _check_pair, agg_loss, ppo_policy_loss
from .masked import as_bool_mask, masked_mean

__all__ = ["POLICY_LOSSES", "POLICY_LOSS_AGG", "POLICY_LOSS_HYPER", "policy_loss", "binary_tv", "binary_kl"]


@dataclass(frozen=True)
class _Mode:
    fn: Callable
    agg_mode: str  # the paper's aggregation
    hyper: dict = field(default_factory=dict)  # name -> default


def _sanitise(m, *xs):
    """``x`` with masked positions replaced by 0 (no inf/NaN from padding reaches a loss or a gradient)."""
    return [torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in xs]


def _log_ratio(lp, old, m, clamp):
    return torch.where(m, lp - old, torch.zeros((), dtype=lp.dtype, device=lp.device)).clamp(-clamp, clamp)


def _frac(x: torch.Tensor, m: torch.Tensor) -> float:
    return float(masked_mean(x.to(torch.float64), m))


def _seq_means(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) mean of ``x`` over each row's valid tokens, and (B,) whether the row has any."""
    n = m.sum(dim=-1)
    return x.sum(dim=-1) / n.clamp(min=1).to(x.dtype), n > 0


def _seq_ratio_metrics(s: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    """The sequence ratios' mean and mean distance from 1, each response weighted by its valid tokens (so that the
    actor's token-share average over micro-batches and ranks is exact)."""
    s = s.detach().to(torch.float64).unsqueeze(-1).expand(m.shape)
    return {
        "policy/seq_ratio_mean": float(masked_mean(s, m)) if bool(m.any()) else 1.0,
        "policy/seq_ratio_abs_dev": _frac((s - 1).abs(), m),
    }


# ------------------------------------------------------------------------------------------------ modes
def _gspo(lp, old, adv, m, *, log_ratio_clamp, clip_eps_low, clip_eps_high, **_):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071, eqs. 5-7): s_i = (π_θ(y_i|x)/π_old(y_i|x))^(1/|y_i|)
    = exp(mean_t log r_t), clipped at [1−ε_low, 1+ε_high] per response, ℓ_i = max(−Â_i s_i, −Â_i clip(s_i)),
    Â_i = the mean of the response's token advantages (a sequence-level advantage, as GRPO's is)."""
    lr = _log_ratio(lp, old, m, log_ratio_clamp)
    log_s, _ = _seq_means(lr, m)
    a, _ = _seq_means(adv, m)
    s = torch.exp(log_s)  # (B,)
    unclipped, clipped = -a * s, -a * s.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    loss_seq = torch.maximum(unclipped, clipped)
    cut = (clipped > unclipped).unsqueeze(-1).expand_as(m)
    loss_tok = loss_seq.unsqueeze(-1).expand_as(lp)
    return loss_tok, {"policy/clipfrac": _frac(cut, m), **_seq_ratio_metrics(s, m)}


def _gspo_token(lp, old, adv, m, *, log_ratio_clamp, clip_eps_low, clip_eps_high, **_):
    """GSPO-token (arXiv 2507.18071, eqs. 13-14): s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)], equal to s_i in value
    with the gradient s_i ∇log π_θ(y_t), so token-level advantages may differ within a response; with one
    advantage per response and ``seq-mean-token-mean`` it is GSPO, value and gradient (verl's ``gspo``)."""
    lr = _log_ratio(lp, old, m, log_ratio_clamp)
    log_s, _ = _seq_means(lr, m)
    log_st = (lp - lp.detach()) + log_s.detach().unsqueeze(-1)
    st = torch.exp(log_st)
    unclipped, clipped = -adv * st, -adv * st.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    return torch.maximum(unclipped, clipped), {
        "policy/clipfrac": _frac(clipped > unclipped, m),
        **_seq_ratio_metrics(torch.exp(log_s), m),
    }


def _gmpo(lp, old, adv, m, *, log_ratio_clamp, clip_eps_low, clip_eps_high, **_):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673, eq. 4): the geometric mean of the token ratios, each clipped in
    log space at [−ε_low, ε_high] on the side that would raise the objective:
    log r̃_t = sgn(Â)·min(sgn(Â)·log r_t, sgn(Â)·clip(log r_t)); ℓ_i = −Â_i·exp(mean_t log r̃_t); Â_i = the mean of
    the response's token advantages. Defaults ε = 0.4 (the paper's (e^−0.4, e^0.4)); verl's ``geo_mean`` reuses its
    ``clip_ratio`` (0.2)."""
    lr = _log_ratio(lp, old, m, log_ratio_clamp)
    a, _ = _seq_means(adv, m)
    sgn = torch.sign(adv)  # per token, as verl (one advantage per response: the response's sign)
    lr_c = lr.clamp(-clip_eps_low, clip_eps_high)
    lr_t = sgn * torch.minimum(sgn * lr, sgn * lr_c)
    log_s, _ = _seq_means(torch.where(m, lr_t, torch.zeros((), dtype=lr.dtype, device=lr.device)), m)
    s = torch.exp(log_s)
    loss_tok = (-a * s).unsqueeze(-1).expand_as(lp)
    cut = lr != lr_c
    return loss_tok, {
        "policy/clipfrac": _frac(cut & (adv > 0), m),
        "policy/clipfrac_lower": _frac(cut & (adv < 0), m),
        **_seq_ratio_metrics(s, m),
    }


def _cispo(lp, old, adv, m, *, log_ratio_clamp, clip_eps_low, clip_eps_high, **_):
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4): ℓ_t = −sg(r̂_t)·A_t·log π_θ(y_t), r̂ = clip(r, 1−ε_low, 1+ε_high):
    the importance weight is capped, never the gradient, so no token loses its gradient. ``clip_eps_low`` None = no
    lower bound (the paper's choice); verl bounds both sides with its ``clip_ratio`` (0.2)."""
    r = torch.exp(_log_ratio(lp, old, m, log_ratio_clamp))
    lo = 0.0 if clip_eps_low is None else 1 - clip_eps_low
    rc = r.clamp(lo, 1 + clip_eps_high)
    return -rc.detach() * adv * lp, {"policy/clipfrac": _frac(r > rc, m), "policy/clipfrac_lower": _frac(r < rc, m)}


def _sapo(lp, old, adv, m, *, log_ratio_clamp, tau_pos, tau_neg, **_):
    """SAPO (Gao et al. 2025, arXiv 2511.20347, eqs. 5-6): a soft gate instead of a clip,
    ℓ_t = −f_τ(r_t)·A_t, f_τ(r) = (4/τ)·σ(τ(r − 1)), τ = τ_pos where A > 0 else τ_neg. f'(1) = 1 (the policy
    gradient on-policy); off-policy the gradient fades smoothly as r leaves 1. Defaults τ_pos 1.0, τ_neg 1.05 (the
    paper's and verl's)."""
    r = torch.exp(_log_ratio(lp, old, m, log_ratio_clamp))
    tau = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=r.dtype), torch.as_tensor(tau_neg, dtype=r.dtype))
    gate = torch.sigmoid(tau * (r - 1)) * (4 / tau)
    return -gate * adv, {}


def _gpg(lp, old, adv, m, **_):
    """GPG (Chu et al. 2025, arXiv 2504.02546, eq. 5): no surrogate, ℓ_t = −A_t·log π_θ(y_t). Its gradient ignores
    π_old, so it is the policy gradient only on-policy (one epoch, one mini-batch)."""
    return -adv * lp, {}


def _cov(adv, lp, m):
    """Per-token centred covariance term (A − mean A)(log π − mean log π) over this call's valid tokens (detached)."""
    a, l_ = adv.detach(), lp.detach()
    return (a - masked_mean(a, m)) * (l_ - masked_mean(l_, m))


def _clip_cov(
    lp,
    old,
    adv,
    m,
    *,
    log_ratio_clamp,
    clip_eps_low,
    clip_eps_high,
    clip_cov_ratio,
    clip_cov_lb,
    clip_cov_ub,
    generator=None,
    **_,
):
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617, eq. 11): PPO's clipped surrogate, and in addition
    max(1, ⌊r·N⌋) tokens drawn at random from those the clip left alone whose covariance term
    (A − Ā)(log π − mean log π) lies in (lb, ub) lose their gradient (their loss is 0, as verl). Defaults
    r = 2e-4, lb 1, ub 5 (the paper's and verl's); N and the means are this call's valid tokens (per micro-batch,
    as verl). ``generator`` draws the tokens (deterministic given its seed)."""
    r = torch.exp(_log_ratio(lp, old, m, log_ratio_clamp))
    unclipped, clipped = -adv * r, -adv * r.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    by_clip = (clipped > unclipped) & m
    cov = _cov(adv, lp, m)
    cand = m & ~by_clip & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    n_sel = max(int(clip_cov_ratio * int(m.sum())), 1)
    idx = torch.nonzero(cand.reshape(-1)).squeeze(-1)
    sel = torch.zeros(m.shape, dtype=torch.bool, device=m.device)  # contiguous: m may be a column slice
    if idx.numel():
        pick = idx[torch.randperm(idx.numel(), generator=generator)[:n_sel].to(idx.device)]
        sel.view(-1)[pick] = True
    loss_tok = torch.where(sel, torch.zeros((), dtype=lp.dtype, device=lp.device), torch.maximum(unclipped, clipped))
    return loss_tok, {"policy/clipfrac": _frac(by_clip, m), "policy/cov_selected_frac": _frac(sel, m)}


def _kl_cov(lp, old, adv, m, *, log_ratio_clamp, kl_cov_ratio, kl_cov_coef, **_):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617, eq. 12): no clip; the max(1, ⌊k·N⌋) tokens with the largest
    covariance term (A − Ā)(log π − mean log π) get a penalty coef·|log r_t| besides −A_t r_t (the others −A_t r_t).
    Defaults k = 2e-4 and coef 0.1 (verl's; the paper tunes k per model, 2e-3 at 7B). N and the means are this
    call's valid tokens (per micro-batch, as verl)."""
    lr = _log_ratio(lp, old, m, log_ratio_clamp)
    base = -adv * torch.exp(lr)
    cov = torch.where(m, _cov(adv, lp, m), torch.full((), -math.inf, dtype=lp.dtype, device=lp.device))
    n_valid = int(m.sum())
    sel = torch.zeros(m.shape, dtype=torch.bool, device=m.device)  # contiguous: m may be a column slice
    if n_valid:
        k = min(max(int(n_valid * kl_cov_ratio), 1), n_valid)
        sel.view(-1)[torch.topk(cov.reshape(-1), k).indices] = True
        sel &= m
    loss_tok = torch.where(sel, base + kl_cov_coef * lr.abs(), base)
    return loss_tok, {"policy/cov_selected_frac": _frac(sel, m)}


def binary_tv(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Signed binary total variation π_θ(y_t) − π_old(y_t) of the sampled token (DPPO, arXiv 2602.04879, eq. 13: the
    TV between the two Bernoulli distributions "this token / any other token" is its absolute value).

    Shapes: any, elementwise; probabilities (no unit)."""
    return torch.exp(logprobs) - torch.exp(old_logprobs)


def binary_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(Bern(π_old(y_t)) ‖ Bern(π_θ(y_t))) of the sampled token, nats (DPPO, arXiv 2602.04879, eq. 14):
    p log(p/q) + (1−p) log((1−p)/(1−q)), p = π_old, q = π_θ; 0 log 0 = 0, and 1 − q floored at 1e-12 so a
    certain token gives a large finite value, not inf (verl adds 1e-8 inside both logs instead).

    Shapes: any, elementwise."""
    p, q = torch.exp(old_logprobs), torch.exp(logprobs)
    one_p, one_q = (1 - p).clamp(min=0), (1 - q).clamp(min=1e-12)
    return p * (old_logprobs - logprobs) + torch.xlogy(one_p, one_p) - one_p * torch.log(one_q)


def _dppo(divergence, lp, old, adv, m, *, log_ratio_clamp, delta_low, delta_high, is_cap, **_):
    """DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv 2602.04879, eqs. 11-12): no ratio clip;
    a token's gradient is masked when its update has already moved π_θ from π_old by more than δ in the direction
    its advantage pushes (A > 0 and the token's probability rose, A < 0 and it fell), the divergence measured on
    the sampled token's binary distribution (:func:`binary_tv` or :func:`binary_kl`). ℓ_t = −M_t·sg(min(r_t, C))·
    A_t·log π_θ(y_t): the ratio enters detached and capped at C (truncated IS, the paper's section 5.4)."""
    r = torch.exp(_log_ratio(lp, old, m, log_ratio_clamp))
    lpd = lp.detach()
    if divergence == "tv":
        d = binary_tv(lpd, old)
        valid = torch.where(adv > 0, d <= delta_high, d >= -delta_low)
    else:
        d = binary_kl(lpd, old)  # the direction comes from the sign of the probability change
        valid = torch.where(adv > 0, (d <= delta_high) | (lpd <= old), (d <= delta_low) | (lpd >= old))
    capped = r.clamp(max=is_cap)
    loss_tok = -valid.to(lp.dtype) * capped.detach() * adv * lp
    return loss_tok, {"policy/clipfrac": _frac(~valid, m), "policy/clipfrac_lower": _frac((r > is_cap) & valid, m)}


def _dppo_tv(*a, **k):
    return _dppo("tv", *a, **k)


def _dppo_kl(*a, **k):
    return _dppo("kl", *a, **k)


_PPO_HYPER = {"clip_eps_low": 0.2, "clip_eps_high": 0.2}
_MODES: dict[str, _Mode] = {
    "vanilla": _Mode(None, "token-mean", {**_PPO_HYPER, "dual_clip_c": 3.0}),
    "gspo": _Mode(_gspo, "seq-mean-token-mean", {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}),
    "gspo_token": _Mode(_gspo_token, "seq-mean-token-mean", {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}),
    "gmpo": _Mode(_gmpo, "seq-mean-token-mean", {"clip_eps_low": 0.4, "clip_eps_high": 0.4}),
    "cispo": _Mode(_cispo, "token-mean", {"clip_eps_low": None, "clip_eps_high": 0.2}),
    "sapo": _Mode(_sapo, "seq-mean-token-mean", {"tau_pos": 1.0, "tau_neg": 1.05}),
    "clip_cov": _Mode(
        _clip_cov, "token-mean", {**_PPO_HYPER, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
    ),
    "kl_cov": _Mode(_kl_cov, "token-mean", {"kl_cov_ratio": 2e-4, "kl_cov_coef": 0.1}),
    "dppo_tv": _Mode(_dppo_tv, "token-mean", {"delta_low": 0.2, "delta_high": 0.2, "is_cap": 20.0}),
    "dppo_kl": _Mode(_dppo_kl, "token-mean", {"delta_low": 0.05, "delta_high": 0.05, "is_cap": 20.0}),
    "gpg": _Mode(_gpg, "token-mean", {}),
}

POLICY_LOSSES: tuple[str, ...] = tuple(_MODES)
"""Names accepted by :func:`policy_loss` (``algo.policy_loss``)."""

POLICY_LOSS_AGG: dict[str, str] = {k: v.agg_mode for k, v in _MODES.items()}
"""Each mode's aggregation in its paper (the default of ``algo.loss_agg_mode: null``)."""

POLICY_LOSS_HYPER: dict[str, dict] = {k: dict(v.hyper) for k, v in _MODES.items()}
"""Each mode's hyper-parameters and their defaults."""


def _check_hyper(name: str, hyper: dict) -> dict:
    allowed = POLICY_LOSS_HYPER[name]
    unknown = sorted(set(hyper) - set(allowed))
    if unknown:
        raise ValueError(
            f"policy loss {name!r} takes no {', '.join(unknown)}; its hyper-parameters: {', '.join(allowed) or 'none'}"
        )
    h = {**allowed, **hyper}
    for k, v in h.items():
        if k == "clip_eps_low" and v is None and name == "cispo":
            continue
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"policy loss {name!r}: {k} must be a finite number, got {v!r}")
        if k == "clip_eps_low" and name != "gmpo" and not 0 <= v < 1:
            raise ValueError(f"policy loss {name!r}: clip_eps_low must be in [0, 1), got {v!r}")
        if k in ("kl_cov_ratio", "clip_cov_ratio") and not 0 < v <= 1:
            raise ValueError(f"policy loss {name!r}: {k} must be in (0, 1], got {v!r}")
        if k in ("clip_eps_high", "tau_pos", "tau_neg", "delta_low", "delta_high") and not v > 0:
            raise ValueError(f"policy loss {name!r}: {k} must be > 0, got {v!r}")
        if k in ("kl_cov_coef",) and v < 0:
            raise ValueError(f"policy loss {name!r}: {k} must be >= 0, got {v!r}")
        if k == "is_cap" and not v >= 1:
            raise ValueError(f"policy loss {name!r}: is_cap must be >= 1, got {v!r}")
    if name == "gmpo" and not h["clip_eps_low"] > 0:
        raise ValueError(f"policy loss 'gmpo': clip_eps_low (log space) must be > 0, got {h['clip_eps_low']!r}")
    if name == "clip_cov" and not h["clip_cov_lb"] < h["clip_cov_ub"]:
        raise ValueError(
            f"policy loss 'clip_cov': clip_cov_lb ({h['clip_cov_lb']}) must be below clip_cov_ub ({h['clip_cov_ub']})"
        )
    return h


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    agg_mode: str | None = None,
    weights: torch.Tensor | None = None,
    total_tokens: Count = None,
    total_seqs: Count = None,
    norm_constant: float | None = None,
    log_ratio_clamp: float = 20.0,
    generator: torch.Generator | None = None,
    **hyper,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss ``name`` (one of :data:`POLICY_LOSSES`), aggregated.

    Args:
        name: ``vanilla`` (PPO clip with clip-higher and dual clip, :func:`tether.algos.ppo_policy_loss`),
            ``gspo``, ``gspo_token``, ``gmpo``, ``cispo``, ``sapo``, ``clip_cov``, ``kl_cov``, ``dppo_tv``,
            ``dppo_kl`` or ``gpg``: each mode's formula, paper and defaults are in its docstring below and in
            ``docs/training.md``.
        logprobs: (B, T) log π_θ, nats, differentiable.
        old_logprobs: (B, T) log π_old of the sampling policy, nats.
        advantages: (B, T).
        response_mask: (B, T), non-zero = counts.
        agg_mode: see :func:`tether.algos.agg_loss`; None = the mode's own (:data:`POLICY_LOSS_AGG`).
        weights: (B, T) rollout-correction weights multiplying each token's loss, used detached; None = 1.
        total_tokens, total_seqs, norm_constant: see :func:`tether.algos.agg_loss`.
        log_ratio_clamp: clamp of every log-ratio before exp, nats (> 0).
        generator: draws ``clip_cov``'s random tokens; None = torch's global generator.
        **hyper: the mode's hyper-parameters (:data:`POLICY_LOSS_HYPER`; missing ones take the defaults).

    Returns:
        ``(loss, metrics)``: a 0-d tensor and the metrics of the module docstring.

    Raises:
        ValueError: unknown mode (lists them), a hyper-parameter the mode does not take or out of range,
            shape mismatch, bad aggregation arguments, log_ratio_clamp ≤ 0.

    Source: verl ``core_algos`` ``POLICY_LOSS_REGISTRY`` (same names; ``gmpo`` is verl's ``geo_mean``) and the
    papers named per mode; deliberate differences from verl are listed in ``docs/api.md``.
    """
    if name not in _MODES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    h = _check_hyper(name, hyper)
    agg = POLICY_LOSS_AGG[name] if agg_mode is None else agg_mode
    if name == "vanilla":
        return ppo_policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            response_mask,
            agg_mode=agg,
            total_tokens=total_tokens,
            total_seqs=total_seqs,
            norm_constant=norm_constant,
            log_ratio_clamp=log_ratio_clamp,
            weights=weights,
            **h,
        )
    for n, x in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        _check_pair(n, x, response_mask)
    if not log_ratio_clamp > 0:
        raise ValueError(f"log_ratio_clamp must be > 0, got {log_ratio_clamp!r}")
    m = as_bool_mask(response_mask)
    lp, old, adv = _sanitise(m, logprobs, old_logprobs.to(logprobs.dtype), advantages.to(logprobs.dtype))
    loss_tok, extra = _MODES[name].fn(lp, old, adv, m, log_ratio_clamp=log_ratio_clamp, generator=generator, **h)
    zero = torch.zeros((), dtype=loss_tok.dtype, device=loss_tok.device)
    if weights is not None:
        _check_pair("weights", weights, response_mask)
        loss_tok = loss_tok * torch.where(m, weights.detach().to(loss_tok.dtype), zero)
    loss = agg_loss(loss_tok, m, agg, total_tokens=total_tokens, total_seqs=total_seqs, norm_constant=norm_constant)
    with torch.no_grad():
        metrics = {
            "policy/pg_loss": float(loss.detach()),
            "policy/clipfrac": 0.0,
            "policy/clipfrac_lower": 0.0,
            "policy/approx_kl": float(masked_mean(-_log_ratio(lp, old, m, log_ratio_clamp), m)),
            **extra,
        }
    return loss, metrics
