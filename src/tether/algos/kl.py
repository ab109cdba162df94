"""KL estimators from sampled-token log-probabilities, and the KL-in-reward placement.

Notation: for a sampled token a_t ~ π, k1 = log π(a_t) - log π_ref(a_t) (the log-ratio, nats).
Schulman (2020), "Approximating KL Divergence", gives three single-sample estimators of
KL(π ‖ π_ref) = E_π[k1]:

* k1 = r                      unbiased, high variance, can be negative;
* k2 = ½ r²                   biased, low variance, ≥ 0; its gradient E_π[r ∇log π] is the exact
                               gradient of KL(π ‖ π_ref) (the sampling distribution held fixed);
* k3 = exp(-r) + r - 1        unbiased (E_π[exp(-r)] = 1), low variance, ≥ 0.

``abs`` = |r| is the heuristic verl also offers. Straight-through variants (``"k1+"``, ``"k3+"``,
...) return the forward value of the named estimator with the gradient of k2, as verl does with
``backward - backward.detach() + forward.detach()``.

The log-ratio clamp exists only to keep k3's ``exp(-r)`` finite, so (as in verl) it is applied
only inside k3: k1, abs and k2 see the exact r, and the gradient of k2 and of every ``+`` variant
is r wherever r is finite, however far the token drifted.
"""

from __future__ import annotations

import torch

from .masked import as_bool_mask, masked_mean

__all__ = [
    "KL_ESTIMATORS",
    "KL_OFF_POLICY_CORRECTIONS",
    "off_policy_kl_penalty",
    "LOGPROB_KL_ESTIMATORS",
    "canonical_kl_estimator",
    "kl_penalty",
    "apply_kl_penalty",
    "token_level_rewards_from_kl",
    "kl_to_go",
    "kl_to_go_term",
    "mean_kl_per_token",
    "last_valid_index",
]

_BASE = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

LOGPROB_KL_ESTIMATORS: tuple[str, ...] = _BASE + tuple(f"{n}+" for n in _BASE)
"""Names :func:`kl_penalty` accepts (computable from the sampled tokens' log-probs)."""

KL_ESTIMATORS: tuple[str, ...] = LOGPROB_KL_ESTIMATORS + ("full",)
"""Every valid estimator name for configs. ``"full"`` needs the logits: use :func:`kl_full`."""


def canonical_kl_estimator(name: str) -> str:
    """Map an estimator name to its canonical spelling: ``"kl"``→``"k1"``, ``"mse"``→``"k2"``,
    ``"low_var_kl"``→``"k3"`` (a trailing ``"+"`` is kept: ``"low_var_kl+"``→``"k3+"``).

    Raises:
        ValueError: unknown name; the message lists :data:`KL_ESTIMATORS`.
    """
    if not isinstance(name, str) or name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; valid names: {', '.join(KL_ESTIMATORS)}")
    plus = name.endswith("+")
    base = name[:-1] if plus else name
    return _ALIASES.get(base, base) + ("+" if plus else "")


def _k3(r: torch.Tensor) -> torch.Tensor:
    """exp(-r) + r - 1, accurate and ≥ 0 for every r (series near 0, expm1 elsewhere)."""
    # Near 0, exp(-r) + r - 1 cancels catastrophically (and can round to a negative number);
    # the Taylor series Σ_{n≥2} (-r)^n / n! up to r^6 is exact to ~1e-9 relative for |r| < 0.1.
    series = r * r * (0.5 + r * (-1 / 6 + r * (1 / 24 + r * (-1 / 120 + r * (1 / 720)))))
    direct = torch.expm1(-r) + r
    return torch.where(r.abs() < 0.1, series, direct)


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    *,
    log_ratio_clamp: float | None = 20.0,
    value_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL(π ‖ π_ref) estimate from the log-probs of the sampled tokens.

    Args:
        logprobs: (B, T) log π(a_t | s_t), nats (differentiable for a KL loss).
        ref_logprobs: (B, T) log π_ref(a_t | s_t), nats.
        estimator: one of :data:`LOGPROB_KL_ESTIMATORS` — ``"k1"``/``"kl"``, ``"abs"``,
            ``"k2"``/``"mse"``, ``"k3"``/``"low_var_kl"``, each optionally with a trailing
            ``"+"`` (straight-through: forward value of the named estimator, gradient of k2).
        log_ratio_clamp: inside k3 only, r is clamped to [-c, c] before ``exp(-r)`` (verl: 20),
            which keeps k3 finite; past the clamp k3 has no gradient (verl's too). k1, abs and
            k2 and every straight-through gradient use the unclamped r, so a token that drifted
            far keeps its pull back (∂k1/∂log π = 1, ∂abs/∂log π = sign r, ∂k2/∂log π = r).
            ``None`` disables the clamp (then k3 overflows to inf for r < -88 in float32).
        value_clamp: k3 is clamped to [-c, c] after evaluation (verl: 10). Only k3.

    Returns:
        (B, T) per-token estimate in nats, float32 at least (inputs are upcast from
        bf16/fp16). k1, abs and k2 are exact, so a token π_ref gives probability 0 (r = +inf)
        has KL inf there (the trainer's non-finite guard then skips the step); k3 stays within
        ±``value_clamp``. The gradient of k2 and of every ``+`` variant is r where r is finite
        and 0 where r = ±inf. Positions where both log-probs are -inf (padding) give NaN; mask
        them out with ``torch.where`` (every tether consumer does).

    Raises:
        ValueError: unknown estimator (lists the valid names), ``"full"`` (which needs logits:
            call :func:`tether.algos.kl_full`), shape mismatch, or a clamp ≤ 0.

    Source: Schulman 2020 (k1, k2, k3); verl ``core_algos.kl_penalty`` (names, aliases, clamps,
    and the ``+`` straight-through trick).
    """
    if estimator == "full":
        raise ValueError(
            "kl_penalty cannot compute estimator 'full' from log-probs of the sampled tokens alone; call "
            "kl_full(logits, ref_logits, temperature) with both logit tensors instead"
        )
    name = canonical_kl_estimator(estimator)
    if tuple(logprobs.shape) != tuple(ref_logprobs.shape):
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} must have the same shape"
        )
    for arg, val in (("log_ratio_clamp", log_ratio_clamp), ("value_clamp", value_clamp)):
        if val is not None and not val > 0:
            raise ValueError(f"{arg} must be > 0 or None, got {val!r}")
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, ref_logprobs.dtype), torch.float32)
    r = logprobs.to(dtype) - ref_logprobs.to(dtype)  # (B, T) log-ratio k1, unclamped
    plus = name.endswith("+")
    base = name[:-1] if plus else name
    if base == "k1":
        value = r
    elif base == "abs":
        value = r.abs()
    elif base == "k2":
        value = 0.5 * r * r
    else:  # k3: the only estimator that exponentiates, so the only one clamped
        rc = r if log_ratio_clamp is None else r.clamp(-log_ratio_clamp, log_ratio_clamp)
        value = _k3(rc)
        if value_clamp is not None:
            value = value.clamp(-value_clamp, value_clamp)
    if not plus and base != "k2":
        return value
    return value.detach() + _k2_gradient(r)


KL_OFF_POLICY_CORRECTIONS: tuple[str, ...] = ("ratio", "none")
"""``kl.off_policy_correction`` values: ``ratio`` (:func:`off_policy_kl_penalty`) or ``none`` (verl's KL loss)."""

#: estimators whose value is an unbiased estimate of KL(π‖π_ref) under π (k1, k3) or of E_π[|r|] (abs):
#: off-policy they get the differentiable ratio π_θ/π_old; the rest (k2 and every ``+``) are gradient
#: estimators and get the detached ratio.
_VALUE_ESTIMATORS = ("k1", "abs", "k3")


def off_policy_kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    estimator: str = "k3",
    *,
    log_ratio_clamp: float | None = 20.0,
    value_clamp: float | None = 10.0,
    is_log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_ref) loss term for tokens sampled from π_old, importance-weighted so that it
    is right off-policy (later mini-batches, PPO epochs, async or engine-sampled batches).

    With ρ = π_θ(a_t)/π_old(a_t) and k the named estimator (:func:`kl_penalty`):

    * ``k1``, ``k3`` (and ``abs``): ρ·k with ρ **differentiable**. Under a_t ~ π_old(·|s_t),
      E[ρ·k] = E_{π_θ}[k] as a function of θ, so for k1 and k3 the expected value is
      KL(π_θ(·|s_t) ‖ π_ref(·|s_t)) and the expected gradient is its gradient, exactly, for every θ
      (on-policy too, where plain k3's gradient is that of KL(π_ref‖π_θ) and plain k1's is 0). For
      ``abs`` they are E_{π_θ}[|r|] and its gradient (not a KL).
    * ``k2`` and every ``+`` variant (straight-through: the named value, k2's gradient): sg(ρ)·k with ρ
      **detached**. Under a_t ~ π_old the expected gradient is E_{π_θ}[r ∇log π_θ] = ∇KL(π_θ‖π_ref),
      exactly; the expected value is E_{π_θ}[k]: KL(π_θ‖π_ref) for ``k1+`` and ``k3+``, E_{π_θ}[½r²]
      (k2's bias, as on-policy) for ``k2``/``k2+``, E_{π_θ}[|r|] for ``abs+``.

    The states s_t are those π_old's samples visited: the correction is per token, exact per state, and
    (as PPO's surrogate) leaves the state distribution π_old's. It stays per token when the policy loss
    is sequence-level.

    The clamp: log ρ is clamped to ±``is_log_ratio_clamp`` before exp, as the policy loss clamps its
    ratio (verl: 20). Where |log ρ| ≤ c the term is exact; past it ρ is e^{±c} and, for the
    differentiable variants, carries no gradient, so the expectation over such tokens is off by
    π_old(a)·(ρ − e^{±c})·k. With c = 20 that needs a token whose probability moved by a factor of
    4.9e8 since sampling; ``tests/algos/test_algos_kl_off_policy.py`` checks the cost by enumeration
    at a small c. k3's ``value_clamp`` (default 10) is the other clamp that can bind: a token whose k3 exceeds
    it (π_ref/π_θ > 13.6 or π_θ/π_ref > 6.0e4 at 10) gets the value ``value_clamp`` and a detached ρ, so no
    gradient, as plain k3's clamp gives none on-policy; the expectation misses that token's π_θ(a)·k3(a) and its
    gradient. ``value_clamp=None`` makes k1/k3 exact (enumerated in the same test file).

    Args:
        logprobs: (B, T) log π_θ(a_t | s_t), nats, differentiable.
        ref_logprobs: (B, T) log π_ref(a_t | s_t), nats.
        old_logprobs: (B, T) log π_old(a_t | s_t) of the policy that sampled a_t, nats (detached here).
        estimator: a name from :data:`LOGPROB_KL_ESTIMATORS` (not ``"full"``, which sums over the
            vocabulary at each visited state and needs no token ratio).
        log_ratio_clamp, value_clamp: k3's guards, see :func:`kl_penalty`.
        is_log_ratio_clamp: c > 0, the clamp of log ρ (nats).

    Returns:
        (B, T) per-token term in nats, float32 at least. Positions where the log-probs are -inf
        (padding) give NaN; mask them with ``torch.where`` before use (:func:`tether.algos.kl_loss` does).

    Raises:
        ValueError: as :func:`kl_penalty`, a shape mismatch of ``old_logprobs``, or c ≤ 0.

    Source: Schulman 2020 (estimators); importance sampling of the KL term as in TRL ≥ 1.10's GRPO
    (k3 times the differentiable per-token ratio); the detached-ratio form for gradient estimators is
    tether's. verl's ``use_kl_loss`` has no ratio (``kl.off_policy_correction=none``).
    """
    if tuple(old_logprobs.shape) != tuple(logprobs.shape):
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)} and logprobs {tuple(logprobs.shape)} must have the same shape"
        )
    if not is_log_ratio_clamp > 0:
        raise ValueError(f"is_log_ratio_clamp must be > 0, got {is_log_ratio_clamp!r}")
    kl = kl_penalty(logprobs, ref_logprobs, estimator, log_ratio_clamp=log_ratio_clamp, value_clamp=value_clamp)
    name = canonical_kl_estimator(estimator)
    log_rho = (logprobs.to(kl.dtype) - old_logprobs.detach().to(kl.dtype)).clamp(
        -is_log_ratio_clamp, is_log_ratio_clamp
    )
    rho = torch.exp(log_rho)  # (B, T) π_θ/π_old, differentiable through logprobs
    if name not in _VALUE_ESTIMATORS:
        return rho.detach() * kl
    if name == "k3" and value_clamp is not None:
        # a k3 held at its clamp has no gradient of its own; a differentiable ρ times the constant would push
        # π_θ(a) down, away from π_ref, where π_ref/π_θ is large: such a token gets no gradient at all, as on-policy
        rho = torch.where(kl.abs() >= value_clamp, rho.detach(), rho)
    return rho * kl


def kl_to_go(kl: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The KL still to come after each token: ``G[b, t] = Σ_{u > t, u valid} kl[b, u]`` on valid tokens.

    Sums over the later valid tokens of the same row, across turns: pass the model's tokens as the mask
    (an observation token is not an action and has no KL of its own).

    Args:
        kl: (B, T) per-token KL values, nats (k1 of the sampled tokens, or the exact per-state KL).
        response_mask: (B, T), non-zero = the token counts.

    Returns:
        (B, T), nats, dtype of ``kl``; 0 at masked positions and at each row's last valid token (whatever
        ``kl`` holds at masked positions, inf and NaN included, is never read).

    Raises:
        ValueError: shape mismatch.
    """
    if kl.dim() != 2 or tuple(kl.shape) != tuple(response_mask.shape):
        raise ValueError(f"kl {tuple(kl.shape)} and response_mask {tuple(response_mask.shape)} must both be (B, T)")
    m = as_bool_mask(response_mask)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    z = torch.where(m, kl, zero)  # (B, T)
    inclusive = z.flip(-1).cumsum(-1).flip(-1)  # (B, T): Σ_{u ≥ t}
    return torch.where(m, inclusive - z, zero)


def kl_to_go_term(
    logprobs: torch.Tensor,
    to_go: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    is_log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """The KL-to-go loss term: 0 in value, gradient ρ_t · G_t · ∇log π_θ(a_t|s_t) per token (G_t detached).

    Why it is needed. Let a trajectory τ interleave the model's tokens a_t ~ π_θ(·|s_t) with environment
    tokens o ~ P(·|history) that do not depend on θ (a tool's output; none single-turn). Its probability
    is P_θ(τ) = Π_t π_θ(a_t|s_t) · Π P(o|…), and π_ref's is the same with π_ref: the environment's
    factors are equal in both and cancel in the log-ratio, log P_θ(τ)/P_ref(τ) = Σ_t k1_t with
    k1_t = log π_θ(a_t|s_t) − log π_ref(a_t|s_t) over the model's tokens only. So KL_traj(π_θ‖π_ref) =
    E_{P_θ}[Σ_t k1_t], and (score function; the term E[Σ_t ∇k1_t] = E[Σ_t ∇log π_θ(a_t|s_t)] = 0; a
    k1_u before t is fixed given s_t, so E[k1_u ∇log π_θ(a_t|s_t)] = 0)

        ∇KL_traj = E[Σ_t ∇log π_θ(a_t|s_t) · k1_t] + E[Σ_t ∇log π_θ(a_t|s_t) · Σ_{u>t} k1_u].

    The first sum is Σ_t E_{s_t}[∇_θ KL(π_θ(·|s_t) ‖ π_ref(·|s_t))] with the states' distribution held
    fixed: what a per-token KL loss's expected gradient is (:func:`off_policy_kl_penalty` for k1, k3, k2
    and every ``+``; plain k2 and the ``+`` variants). The second, how a token changes which later states
    (and so which later KLs) occur, is what per-token KL losses leave out (Tang & Munos 2025,
    arXiv 2506.09477): this term's. Under a_t ~ π_old with θ = θ_old, and G_t = :func:`kl_to_go` of the
    later model tokens' k1 (or of the exact per-state KLs, E[k1_u | s_u]), its expected gradient is that
    second sum exactly, so per-token term + this term has expected gradient ∇_θ KL_traj(π_θ‖π_ref)
    (``tests/algos/test_algos_kl_to_go.py`` enumerates it, single- and multi-turn, and the gap without).
    For θ ≠ θ_old (later mini-batches, PPO epochs) ρ corrects each token's own choice but, as PPO's
    surrogate, neither the states' distribution nor the later tokens' (π_old's): not exact there.

    Args:
        logprobs: (B, T) log π_θ(a_t|s_t), nats, differentiable.
        to_go: (B, T) G_t, nats (:func:`kl_to_go`); used detached.
        response_mask: (B, T), non-zero = the token counts (the model's tokens).
        old_logprobs: (B, T) log π_old of the sampling policy, nats (detached); ρ = π_θ/π_old, clamped as
            in :func:`off_policy_kl_penalty`. None: ρ = π_θ/sg(π_θ) (1 in value).
        is_log_ratio_clamp: c > 0, the clamp of log ρ (nats); past it ρ has no gradient.

    Returns:
        (B, T) zeros in value (so the logged KL loss is unchanged), float32 at least; the gradient as above
        on valid tokens, none on masked ones.

    Raises:
        ValueError: shape mismatch or c ≤ 0.

    Source: the decomposition is the policy-gradient theorem applied to KL_traj (Tang & Munos 2025, who
    show the per-token k1/k2/k3 losses' gradients miss it); the term's form (ρ − sg ρ)·sg(G) is tether's.
    """
    for name, x in (("to_go", to_go), ("response_mask", response_mask)) + (
        (("old_logprobs", old_logprobs),) if old_logprobs is not None else ()
    ):
        if tuple(x.shape) != tuple(logprobs.shape):
            raise ValueError(f"{name} {tuple(x.shape)} must have the shape of logprobs {tuple(logprobs.shape)}")
    if not is_log_ratio_clamp > 0:
        raise ValueError(f"is_log_ratio_clamp must be > 0, got {is_log_ratio_clamp!r}")
    m = as_bool_mask(response_mask)
    dtype = torch.promote_types(torch.promote_types(logprobs.dtype, to_go.dtype), torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    lp = torch.where(m, logprobs.to(dtype), zero)  # masked positions never reach the graph
    base = lp.detach() if old_logprobs is None else torch.where(m, old_logprobs.detach().to(dtype), zero)
    rho = torch.exp((lp - base).clamp(-is_log_ratio_clamp, is_log_ratio_clamp))  # (B, T)
    g = torch.where(m, to_go.detach().to(dtype), zero)
    return (rho - rho.detach()) * g


def _k2_gradient(r: torch.Tensor) -> torch.Tensor:
    """(B, T) zeros in the forward pass whose gradient w.r.t. r is r (k2's), and 0 where r = ±inf.

    ``r·(r − r)`` with the first factor detached: exactly 0 forward (no ``inf − inf`` even where
    ½r² overflows), ∂/∂r = r. Non-finite r (a token π_ref gives probability 0) has no finite
    gradient, so it gets none.
    """
    finite = torch.isfinite(r)
    r_f = torch.where(finite, r, torch.zeros((), dtype=r.dtype, device=r.device))  # (B, T)
    return r_f.detach() * (r_f - r_f.detach())


def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) int64 index of the last counted position of each row of a (B, T) mask; -1 if none."""
    m = as_bool_mask(response_mask)
    t = m.shape[-1]
    pos = torch.arange(t, device=m.device).expand_as(m)
    return torch.where(m, pos, torch.full_like(pos, -1)).amax(dim=-1)


def token_level_rewards_from_kl(
    scores: torch.Tensor,
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float | torch.Tensor,
    *,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Place each sequence score on its last valid token and subtract β·KL on every valid token.

    ``r[b, t] = -coef·kl[b, t] + [t = last valid t of row b]·scores[b] + turn_rewards[b, t]`` on valid
    tokens, 0 on masked tokens (whatever ``kl`` holds there, inf and NaN included). Multi-turn, pass the
    model's tokens as ``response_mask`` (``RolloutBatch.action_mask``): the score then lands on the last
    token the model wrote, never on an observation, and per-turn rewards sit where
    :func:`tether.algos.place_turn_rewards` put them (each turn's last model token).

    Args:
        scores: (B,) sequence-level rewards.
        kl: (B, T) per-token KL estimate, nats per token.
        response_mask: (B, T), non-zero = the token counts.
        coef: β ≥ 0 (float or 0-d tensor; a detached value is used as a constant).
        turn_rewards: (B, T) per-turn rewards already placed on valid tokens (reward units), added where
            ``response_mask`` is non-zero; None = none.

    Returns:
        (B, T) ``token_level_rewards``, dtype of ``kl``. A row with no valid token gets no reward
        at all (its score has nowhere to go).

    Raises:
        ValueError: shape mismatch, a negative coef, or a non-zero turn reward on a masked token of a row
            that has valid ones (it would be lost: place it with :func:`tether.algos.place_turn_rewards` on
            the same mask). A row with no valid token (a dropped sample) loses its turn rewards silently.

    Source: Ziegler et al. 2019 and InstructGPT (Ouyang et al. 2022, eq. 2): reward r(x, y) -
    β·log(π/π_ref); verl ``apply_kl_penalty`` places the score on the last valid token the same
    way (``token_level_scores`` at ``response_length - 1``).
    """
    if kl.dim() != 2 or tuple(kl.shape) != tuple(response_mask.shape):
        raise ValueError(f"kl {tuple(kl.shape)} and response_mask {tuple(response_mask.shape)} must both be (B, T)")
    if tuple(scores.shape) != (kl.shape[0],):
        raise ValueError(f"scores must have shape (B,) = ({kl.shape[0]},), got {tuple(scores.shape)}")
    if not isinstance(coef, torch.Tensor) and coef < 0:
        raise ValueError(f"coef (beta) must be >= 0, got {coef!r}")
    m = as_bool_mask(response_mask)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(m, -coef * torch.where(m, kl, zero), zero)  # (B, T)
    last = last_valid_index(m)  # (B,)
    t = m.shape[-1]
    at_last = torch.arange(t, device=m.device)[None, :] == last[:, None]  # (B, T); no hit when last = -1
    rewards = rewards + torch.where(at_last, scores.to(kl.dtype)[:, None], zero)
    if turn_rewards is None:
        return rewards
    if tuple(turn_rewards.shape) != tuple(kl.shape):
        raise ValueError(f"turn_rewards {tuple(turn_rewards.shape)} must have the shape of kl {tuple(kl.shape)}")
    tr = turn_rewards.to(device=kl.device, dtype=kl.dtype)
    lost = ~m & (tr != 0) & m.any(dim=-1, keepdim=True)  # a dropped row (no valid token) loses all, as its score
    if bool(lost.any()):
        b, pos = (int(i) for i in lost.nonzero()[0])
        raise ValueError(
            f"turn_rewards row {b} holds a reward at position {pos}, which is not a counted model token; place "
            "per-turn rewards with place_turn_rewards on the same mask"
        )
    return rewards + torch.where(m, tr, zero)


def apply_kl_penalty(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float | torch.Tensor,
    estimator: str = "k1",
    *,
    log_ratio_clamp: float | None = 20.0,
    value_clamp: float | None = 10.0,
) -> torch.Tensor:
    """KL in the reward: ``token_level_rewards`` = score on the last valid token - β·KL per token.

    Pure: it reads ``coef`` and updates no controller (the trainer calls the controller's
    ``update`` itself with :func:`mean_kl_per_token`).

    Args:
        scores: (B,) sequence rewards.
        logprobs: (B, T) log π of the sampled tokens (rollout policy), nats.
        ref_logprobs: (B, T) log π_ref, nats.
        response_mask: (B, T), non-zero = counts.
        coef: β ≥ 0.
        estimator: a name from :data:`LOGPROB_KL_ESTIMATORS` (verl's default here is k1).
        log_ratio_clamp, value_clamp: see :func:`kl_penalty`.

    Returns:
        (B, T) token-level rewards, 0 on masked positions. Computed under ``torch.no_grad``
        semantics is the caller's choice; the result carries gradients if the inputs do.

    Raises:
        ValueError: see :func:`kl_penalty` and :func:`token_level_rewards_from_kl`.

    Source: verl ``ray_trainer.apply_kl_penalty`` without its hidden controller update.
    """
    kl = kl_penalty(logprobs, ref_logprobs, estimator, log_ratio_clamp=log_ratio_clamp, value_clamp=value_clamp)
    return token_level_rewards_from_kl(scores, kl, response_mask, coef)


def mean_kl_per_token(kl: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The logged ``kl/ref_mean``: masked mean over each response's tokens, then mean over responses.

    Args:
        kl: (B, T) per-token KL, nats per token.
        response_mask: (B, T), non-zero = counts.

    Returns:
        0-d tensor, nats per token. Responses with no valid token are left out of the mean
        over responses; with none valid at all the result is 0. This is the quantity to pass to
        a KL controller's ``update(current_kl=...)`` (verl computes the same:
        ``masked_mean(kld, mask, axis=-1).mean()``).
    """
    m = as_bool_mask(response_mask)
    per_seq = masked_mean(kl, m, dim=-1)  # (B,)
    return masked_mean(per_seq, m.any(dim=-1))
