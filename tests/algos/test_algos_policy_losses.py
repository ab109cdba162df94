"""tether.algos.policy_loss: every mode by hand, its gradient against autograd of its paper's formula (float64),
the numbers verl's functions give on the same inputs, and the shared on-policy invariant."""

import functools
import math

import pytest
import torch

from tether.algos import (
    POLICY_LOSS_AGG,
    POLICY_LOSS_HYPER,
    POLICY_LOSSES,
    agg_loss,
    binary_kl,
    binary_tv,
    policy_loss,
    ppo_policy_loss,
)

F64 = torch.float64


def t64(x):
    return torch.tensor(x, dtype=F64)


def batch(seed=0, B=5, T=6, spread=0.4):
    """Random (B, T) inputs: log π_old in (−3, 0), log π_θ = log π_old + spread·N(0, 1) (kept < 0), a sequence-level
    advantage per row, and a mask with ragged lengths (every row has >= 2 tokens)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05
    lp = (old + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).clone()
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return lp, old, adv, mask


def grad_of(fn, lp):
    x = lp.clone().requires_grad_(True)
    out = fn(x)
    (out[0] if isinstance(out, tuple) else out).backward()
    return x.grad


# ------------------------------------------------------------------------------------------------ registry
def test_registry_names_agg_and_hyper():
    assert POLICY_LOSSES == (
        "vanilla",
        "gspo",
        "gspo_token",
        "gmpo",
        "cispo",
        "sapo",
        "clip_cov",
        "kl_cov",
        "dppo_tv",
        "dppo_kl",
        "gpg",
    )
    assert POLICY_LOSS_AGG["vanilla"] == "token-mean" and POLICY_LOSS_AGG["gspo"] == "seq-mean-token-mean"
    assert POLICY_LOSS_HYPER["gspo"] == {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}
    assert POLICY_LOSS_HYPER["sapo"] == {"tau_pos": 1.0, "tau_neg": 1.05}


def test_errors_name_the_offending_item():
    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'; valid: vanilla, gspo"):
        policy_loss("ppo", lp, old, adv, mask)
    with pytest.raises(ValueError, match="'sapo' takes no clip_eps_high; its hyper-parameters: tau_pos, tau_neg"):
        policy_loss("sapo", lp, old, adv, mask, clip_eps_high=0.3)
    with pytest.raises(ValueError, match="'gpg' takes no tau_pos; its hyper-parameters: none"):
        policy_loss("gpg", lp, old, adv, mask, tau_pos=1.0)
    with pytest.raises(ValueError, match="tau_neg must be > 0"):
        policy_loss("sapo", lp, old, adv, mask, tau_neg=0.0)
    with pytest.raises(ValueError, match="kl_cov_ratio must be in"):
        policy_loss("kl_cov", lp, old, adv, mask, kl_cov_ratio=2.0)
    with pytest.raises(ValueError, match="clip_cov_lb"):
        policy_loss("clip_cov", lp, old, adv, mask, clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValueError, match="is_cap must be >= 1"):
        policy_loss("dppo_tv", lp, old, adv, mask, is_cap=0.5)
    with pytest.raises(ValueError, match="advantages must have the shape"):
        policy_loss("gspo", lp, old, adv[:, :3], mask)


def test_vanilla_is_ppo_policy_loss():
    lp, old, adv, mask = batch(spread=0.5)
    w = torch.rand(lp.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    a, ma = policy_loss("vanilla", lp, old, adv, mask, weights=w, clip_eps_high=0.28)
    b, mb = ppo_policy_loss(lp, old, adv, mask, clip_eps_high=0.28, weights=w)
    assert a.item() == b.item() and ma == mb


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_on_policy_every_mode_is_the_policy_gradient(name):
    """At θ = θ_old each ratio is 1 and each gate's slope 1: ∂loss/∂log π_t = −A_t·(the aggregation's weight of t),
    for every mode (the covariance modes' selected tokens aside, none of which exist at these bounds)."""
    lp, _, adv, mask = batch(seed=4)
    hyper = (
        {"clip_cov_lb": 50.0, "clip_cov_ub": 60.0}
        if name == "clip_cov"
        else {"kl_cov_coef": 0.0}
        if name == "kl_cov"
        else {}
    )
    g = grad_of(lambda x: policy_loss(name, x, lp.detach(), adv, mask, **hyper), lp)
    ref = grad_of(lambda x: agg_loss(-adv * x, mask, POLICY_LOSS_AGG[name]), lp)
    assert torch.allclose(g, ref, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_masked_garbage_never_reaches_the_loss_or_gradient(name):
    lp, old, adv, mask = batch(seed=5)
    lp, old = lp.clone(), old.clone()
    lp[mask == 0], old[mask == 0] = -math.inf, math.nan
    loss, metrics = policy_loss(name, lp, old, adv, mask)
    g = grad_of(lambda x: policy_loss(name, x, old, adv, mask), lp)
    assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in metrics.values())
    assert torch.isfinite(g).all() and (g[mask == 0] == 0).all()


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_weights_multiply_each_tokens_loss(name):
    lp, old, adv, mask = batch(seed=6)
    w = torch.full(lp.shape, 0.5, dtype=F64)
    a, _ = policy_loss(name, lp, old, adv, mask, generator=torch.Generator().manual_seed(0))
    b, _ = policy_loss(name, lp, old, adv, mask, weights=w, generator=torch.Generator().manual_seed(0))
    assert b.item() == pytest.approx(0.5 * a.item(), rel=1e-12, abs=1e-15)


# ------------------------------------------------------------------------------------------------ by hand
ONE = torch.ones(1, 2, dtype=torch.long)


def test_gspo_by_hand():
    """Two tokens, log r = (0.2, −0.1): s = exp(0.05) = 1.05127 > 1 + 4e-4; A = 1: ℓ = max(−s, −(1+4e-4)) = −1.0004."""
    old = t64([[-1.0, -2.0]])
    lp = old + t64([[0.2, -0.1]])
    loss, m = policy_loss("gspo", lp, old, t64([[1.0, 1.0]]), ONE)
    assert loss.item() == pytest.approx(-1.0004, abs=1e-12)
    assert (
        m["policy/clipfrac"] == 1.0
        and m["policy/seq_ratio_mean"] == pytest.approx(math.exp(0.05), rel=1e-12)
        and m["policy/seq_ratio_abs_dev"] == pytest.approx(math.exp(0.05) - 1, rel=1e-12)
    )
    assert m["policy/approx_kl"] == pytest.approx(-0.05, abs=1e-12)
    loss, _ = policy_loss("gspo", lp, old, t64([[-1.0, -1.0]]), ONE)  # A < 0: the unclipped side, s
    assert loss.item() == pytest.approx(math.exp(0.05), rel=1e-12)


def test_gspo_one_token_past_the_ratio_clamp_moves_the_sequence_ratio_by_its_excess_over_the_length():
    """Four tokens, log r = (25, 0, 0, −1) with the ±20 clamp (docs/api.md, deviations): log s = (20 + 0 + 0 − 1)/4 =
    4.75 instead of 6: s is off by e^{(25 − 20)/4} = e^1.25, and the metric reports the clamped s. A = −1 takes the
    unclipped side, ℓ = s."""
    old = t64([[-30.0, -1.0, -1.0, -1.0]])
    lp = old + t64([[25.0, 0.0, 0.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.long)
    loss, m = policy_loss("gspo", lp, old, t64([[-1.0] * 4]), mask)
    assert loss.item() == pytest.approx(math.exp(4.75), rel=1e-12)
    assert m["policy/seq_ratio_mean"] == pytest.approx(math.exp(4.75), rel=1e-12)
    assert math.exp(6.0) / loss.item() == pytest.approx(math.exp((25 - 20) / 4), rel=1e-12)
    wide, _ = policy_loss("gspo", lp, old, t64([[-1.0] * 4]), mask, log_ratio_clamp=30.0)  # no clamp binds: exact
    assert wide.item() == pytest.approx(math.exp(6.0), rel=1e-12)


def test_gmpo_by_hand():
    """log r = (0.6, −0.1), A = 1 > 0: the token above e^0.4 is clipped to 0.4, the other kept: ratio exp(0.15);
    A = −1: the pessimistic side keeps 0.6 and clips nothing below: −A·exp(0.25)."""
    old = t64([[-1.0, -2.0]])
    lp = old + t64([[0.6, -0.1]])
    loss, m = policy_loss("gmpo", lp, old, t64([[1.0, 1.0]]), ONE)
    assert loss.item() == pytest.approx(-math.exp(0.15), rel=1e-12)
    assert m["policy/clipfrac"] == 0.5 and m["policy/clipfrac_lower"] == 0.0
    loss, m = policy_loss("gmpo", lp, old, t64([[-1.0, -1.0]]), ONE)
    assert loss.item() == pytest.approx(math.exp(0.25), rel=1e-12)
    assert m["policy/clipfrac_lower"] == 0.5


def test_cispo_by_hand_and_no_token_loses_its_gradient():
    """r = (e^0.5, e^−0.5), ε_high 0.2, no lower bound: weights (1.2, e^−0.5); ℓ = −w·A·log π, token-mean."""
    old = t64([[-1.0, -2.0]])
    lp = old + t64([[0.5, -0.5]])
    adv = t64([[1.0, 1.0]])
    loss, m = policy_loss("cispo", lp, old, adv, ONE)
    assert loss.item() == pytest.approx(-(1.2 * -0.5 + math.exp(-0.5) * -2.5) / 2, rel=1e-12)
    assert m["policy/clipfrac"] == 0.5 and m["policy/clipfrac_lower"] == 0.0
    g = grad_of(lambda x: policy_loss("cispo", x, old, adv, ONE), lp)
    assert torch.allclose(g, t64([[-1.2 / 2, -math.exp(-0.5) / 2]]), rtol=1e-12)  # PPO would give the first token 0
    _, m = policy_loss("cispo", lp, old, adv, ONE, clip_eps_low=0.2)  # verl's two-sided bound
    assert m["policy/clipfrac_lower"] == 0.5


def test_sapo_by_hand():
    """r = e^0.3, A = 2 > 0, τ = 1: ℓ = −4σ(r − 1)·2; A = −2, τ = 1.05: ℓ = (4/1.05)σ(1.05(r − 1))·2."""
    old = t64([[-1.0]])
    lp = old + 0.3
    r = math.exp(0.3)
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    loss, _ = policy_loss("sapo", lp, old, t64([[2.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-4 * sig(r - 1) * 2, rel=1e-12)
    loss, _ = policy_loss("sapo", lp, old, t64([[-2.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(4 / 1.05 * sig(1.05 * (r - 1)) * 2, rel=1e-12)


def test_gpg_by_hand():
    loss, _ = policy_loss("gpg", t64([[-1.0, -2.0]]), t64([[-5.0, -5.0]]), t64([[3.0, -1.0]]), ONE)
    assert loss.item() == pytest.approx((3.0 * 1.0 + -1.0 * 2.0) / 2, rel=1e-12)


def test_binary_divergences_by_hand():
    p, q = 0.3, 0.5  # π_old, π_θ
    assert binary_tv(t64(math.log(q)), t64(math.log(p))).item() == pytest.approx(0.2, abs=1e-15)
    want = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert binary_kl(t64(math.log(q)), t64(math.log(p))).item() == pytest.approx(want, rel=1e-12)
    assert binary_kl(t64(0.0), t64(0.0)).item() == 0.0  # a certain token that stays certain: 0, not NaN
    assert math.isfinite(binary_kl(t64(0.0), t64(math.log(0.5))).item())


def test_dppo_masks_only_the_unsafe_direction():
    """π_old = (0.3, 0.3, 0.6, 0.6), π_θ = (0.6, 0.1, 0.3, 0.7), A = (+, +, −, −), δ = 0.2 (TV):
    token 1 rose by 0.3 > δ with A > 0 -> masked; token 2 fell (safe for A > 0); token 3 fell by 0.3 with A < 0 ->
    masked; token 4 rose (safe for A < 0)."""
    old = t64([[0.3, 0.3, 0.6, 0.6]]).log()
    lp = t64([[0.6, 0.1, 0.3, 0.7]]).log()
    adv = t64([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = policy_loss("dppo_tv", lp, old, adv, mask)
    r = (lp - old).exp()
    want = (-(r[0, 1] * 1 * lp[0, 1]) - (r[0, 3] * -1 * lp[0, 3])) / 4
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert m["policy/clipfrac"] == 0.5
    g = grad_of(lambda x: policy_loss("dppo_tv", x, old, adv, mask), lp)
    assert g[0, 0] == 0 and g[0, 2] == 0 and g[0, 1] != 0 and g[0, 3] != 0
    # binary KL of 0.3 -> 0.6 is 0.19 > 0.05 and of 0.6 -> 0.3 is 0.19: the same two tokens masked
    _, m = policy_loss("dppo_kl", lp, old, adv, mask)
    assert m["policy/clipfrac"] == 0.5


def test_dppo_caps_the_detached_ratio():
    old, lp = t64([[-5.0]]), t64([[-1.0]])  # r = e^4 = 54.6 > C = 20; TV 0.36 - 0.0067 > δ so set δ high
    loss, m = policy_loss("dppo_tv", lp, old, t64([[-1.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(20.0 * -1.0, rel=1e-12)  # −M·min(r, C)·A·log π = −20·(−1)·(−1)
    assert m["policy/clipfrac_lower"] == 1.0


def test_kl_cov_penalises_the_top_covariance_token():
    """Covariance terms (A − Ā)(log π − mean log π): the largest is token 0's; with k = 1 it alone gets coef·|log r|."""
    old = t64([[-1.0, -2.0, -3.0]])
    lp = old + t64([[0.1, 0.2, -0.3]])
    adv = t64([[1.0, 0.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, m = policy_loss("kl_cov", lp, old, adv, mask, kl_cov_coef=1.0)
    r = (lp - old).exp()
    base = (-adv * r).sum() / 3
    # covariances: lp = (-0.9, -1.8, -3.3), mean -2.0: (1)(1.1)=1.1, 0, (-1)(-1.3)=1.3 -> token 2 is the largest
    assert loss.item() == pytest.approx(base.item() + 0.3 / 3, rel=1e-12)
    assert m["policy/cov_selected_frac"] == pytest.approx(1 / 3)


def test_clip_cov_detaches_its_draws_deterministically():
    lp, old, adv, mask = batch(seed=8, B=8, T=6, spread=0.05)
    adv = adv * 4  # covariance terms of a few units: inside (1, 5)
    kw = dict(clip_cov_ratio=0.1, generator=None)
    a = policy_loss("clip_cov", lp, old, adv, mask, **{**kw, "generator": torch.Generator().manual_seed(1)})
    b = policy_loss("clip_cov", lp, old, adv, mask, **{**kw, "generator": torch.Generator().manual_seed(1)})
    assert a[0].item() == b[0].item() and a[1] == b[1]
    n = int(mask.sum())
    assert a[1]["policy/cov_selected_frac"] == pytest.approx(max(int(0.1 * n), 1) / n)
    g = grad_of(
        lambda x: policy_loss("clip_cov", x, old, adv, mask, **{**kw, "generator": torch.Generator().manual_seed(1)}),
        lp,
    )
    assert int(((g == 0) & (mask == 1)).sum()) >= max(int(0.1 * n), 1)


# ------------------------------------------------------------------------------- against the papers' formulas
def paper(name, lp, old, adv, mask, **h):
    """Each paper's objective written directly (products of probabilities, not log-space sums), negated."""
    m = mask.to(F64)
    p, q = lp.exp(), old.exp()
    r = torch.where(mask.bool(), p / q, torch.ones((), dtype=F64))
    n = m.sum(-1)
    A = (adv * m).sum(-1) / n
    if name in ("gspo", "gspo_token"):
        s = torch.prod(r, dim=-1) ** (1 / n)  # (π_θ(y|x)/π_old(y|x))^(1/|y|)
        lo, hi = 1 - h.get("clip_eps_low", 3e-4), 1 + h.get("clip_eps_high", 4e-4)
        return -torch.minimum(s * A, s.clamp(lo, hi) * A).mean()
    if name == "gmpo":
        e = h.get("eps", 0.4)
        rc = r.clamp(math.exp(-e), math.exp(e))
        rt = torch.where(A.unsqueeze(-1) > 0, torch.minimum(r, rc), torch.maximum(r, rc))
        return -(A * torch.prod(rt, dim=-1) ** (1 / n)).mean()
    if name == "sapo":
        tau = torch.where(adv > 0, t64(1.0), t64(1.05))
        f = 4 / tau * torch.sigmoid(tau * (r - 1))
        return -((f * adv * m).sum(-1) / n).mean()
    if name == "cispo":
        rc = r.clamp(max=1.2).detach()
        return -(rc * adv * torch.log(p) * m).sum() / m.sum()
    if name in ("dppo_tv", "dppo_kl"):
        M = h["M"]
        # eq. 11 with the ratio itself (below the cap its gradient is r·∇log π)
        return -(M * r * adv * m).sum() / m.sum()
    if name == "gpg":
        return -(adv * torch.log(p) * m).sum() / m.sum()
    if name == "kl_cov":
        sel = h["sel"]
        return -((adv * r - h["coef"] * sel * torch.log(r).abs()) * m).sum() / m.sum()
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "gmpo", "sapo", "cispo", "gpg"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_and_gradient_match_the_paper(name, seed):
    lp, old, adv, mask = batch(seed=seed, spread=0.002 if name.startswith("gspo") else 0.3)  # GSPO's clip is 4e-4 wide
    if name.startswith("gspo") and seed == 2:
        lp = old + 0.01  # every response clipped: the gradient is 0 on the clipped side
    got = policy_loss(name, lp, old, adv, mask)[0].item()
    want = paper(name, lp, old, adv, mask).item()
    if name not in ("cispo", "gpg"):  # CISPO's and GPG's loss values are −w·A·log π, the papers' own form too
        assert got == pytest.approx(want, rel=1e-10, abs=1e-14)
    g = grad_of(lambda x: policy_loss(name, x, old, adv, mask), lp)
    ref = grad_of(lambda x: paper(name, x, old, adv, mask), lp)
    assert torch.allclose(g, ref, rtol=1e-9, atol=1e-13)


def test_gspo_token_with_token_advantages_differs_from_gspo():
    """GSPO-token takes token advantages; with A constant per response it equals GSPO (above); otherwise GSPO uses
    their mean and GSPO-token each token's own, so the gradients differ."""
    lp, old, adv, mask = batch(seed=3, spread=0.0001)
    adv = adv + torch.linspace(-1, 1, adv.shape[1], dtype=F64)
    ga = grad_of(lambda x: policy_loss("gspo", x, old, adv, mask), lp)
    gb = grad_of(lambda x: policy_loss("gspo_token", x, old, adv, mask), lp)
    assert not torch.allclose(ga, gb)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_gradient_matches_eq_11(name):
    lp, old, adv, mask = batch(seed=9, spread=0.6)
    lpd = lp.detach()
    if name == "dppo_tv":
        d = lpd.exp() - old.exp()
        M = torch.where(adv > 0, d <= 0.2, d >= -0.2)
    else:
        d = binary_kl(lpd, old)
        M = torch.where(adv > 0, (d <= 0.05) | (lpd <= old), (d <= 0.05) | (lpd >= old))
    assert (lp - old).exp().max() < 20  # below the cap
    assert 0 < int((~M & mask.bool()).sum()) < int(mask.sum())  # some masked, some kept
    g = grad_of(lambda x: policy_loss(name, x, old, adv, mask), lp)
    ref = grad_of(lambda x: paper(name, x, old, adv, mask, M=M.to(F64)), lp)
    assert torch.allclose(g, ref, rtol=1e-10, atol=1e-14)


def test_kl_cov_gradient_matches_eq_12():
    lp, old, adv, mask = batch(seed=10, spread=0.3)
    loss, m = policy_loss("kl_cov", lp, old, adv, mask, kl_cov_ratio=0.2, kl_cov_coef=1.0)
    mb = mask.bool()
    cov = (adv - adv[mb].mean()) * (lp - lp[mb].mean())
    k = max(int(0.2 * int(mask.sum())), 1)
    thr = cov[mb].topk(k).values.min()
    sel = (cov >= thr) & mb
    assert m["policy/cov_selected_frac"] == pytest.approx(k / int(mask.sum()))
    g = grad_of(lambda x: policy_loss("kl_cov", x, old, adv, mask, kl_cov_ratio=0.2, kl_cov_coef=1.0), lp)
    ref = grad_of(lambda x: paper("kl_cov", x, old, adv, mask, sel=sel.to(F64), coef=1.0), lp)
    assert torch.allclose(g, ref, rtol=1e-10, atol=1e-14)


# ------------------------------------------------------------------------------- against verl's functions
def verl_loss(name, old, lp, adv, mask, **c):
    """verl's core_algos policy losses (trainer/ppo/core_algos.py, 2026 HEAD), transcribed for float64, each with
    its own aggregation; loss values only (metrics aside)."""
    m = mask.to(F64)

    def tok_mean(x):
        return (x * m).sum() / m.sum()

    def seq_mean_tok_mean(x):
        return ((x * m).sum(-1) / m.sum(-1)).mean()

    nkl = lp - old
    if name == "gspo":  # verl's gspo is tether's gspo_token, with a max-only clamp of 10
        seq = (nkl * m).sum(-1) / m.sum(-1).clamp(min=1)
        s = torch.exp((lp - lp.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0))
        return seq_mean_tok_mean(torch.maximum(-adv * s, -adv * s.clamp(1 - c["lo"], 1 + c["hi"])))
    if name == "sapo":
        r = nkl.clamp(-20, 20).exp()
        tau = torch.where(adv > 0, t64(1.0), t64(1.05))
        return seq_mean_tok_mean(-(torch.sigmoid(tau * (r - 1)) * 4 / tau) * adv)
    if name == "cispo":
        r = nkl.clamp(-20, 20).exp()
        return tok_mean(-r.clamp(1 - c["lo"], 1 + c["hi"]).detach() * adv * lp)
    if name == "geo_mean":
        sgn = torch.sign(adv)
        k = torch.min(sgn * nkl, sgn * nkl.clamp(-c["lo"], c["hi"])) * sgn
        n = m.sum(-1)
        ratio = torch.exp((k * m).sum(-1) / (n + 1e-8))
        return (-(adv * m).sum(-1) / (n + 1e-8) * ratio).mean()
    if name == "gpg":
        return tok_mean(-lp * adv)
    if name in ("dppo_tv", "dppo_kl"):
        r = nkl.clamp(-20, 20).exp()
        tr = r.clamp(max=c["C"]).detach()
        p, q = lp.exp(), old.exp()
        if name == "dppo_tv":
            valid = torch.where(adv > 0, (p - q) <= c["hi"], (p - q) >= -c["lo"])
        else:
            bkl = q * (old - lp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
            valid = torch.where(adv > 0, (bkl <= c["hi"]) | (p <= q), (bkl <= c["lo"]) | (p >= q))
        return tok_mean(-adv * tr * lp * valid.to(F64))
    if name == "kl_cov":
        r = nkl.exp()
        valid = mask.bool()
        cov = (adv[valid] - adv[valid].mean()) * (lp[valid] - lp[valid].mean())
        k = max(1, int(cov.numel() * c["ratio"]))
        flat = torch.nonzero(valid.reshape(-1)).squeeze(-1)[cov.topk(k).indices]
        pen = torch.zeros_like(r).reshape(-1)
        pen[flat] = c["coef"] * nkl.abs().reshape(-1)[flat]
        return tok_mean(-adv * r + pen.reshape(r.shape))
    if name == "clip_cov":  # every candidate drawn (clip_num >= their count): no randomness
        r = nkl.exp()
        l1, l2 = -adv * r, -adv * r.clamp(1 - c["lo"], 1 + c["hi"])
        by = (l2 > l1) & mask.bool()
        cov = (adv - tok_mean(adv)) * (lp - tok_mean(lp))
        cov = torch.where(mask.bool() & ~by, cov, -math.inf)
        sel = (cov < c["ub"]) & (cov > c["lb"]) & mask.bool()
        return tok_mean(torch.maximum(l1, l2) * (~sel).to(F64))
    raise AssertionError(name)


VERL_CASES = [
    ("gspo_token", "gspo", dict(clip_eps_low=3e-4, clip_eps_high=4e-4), dict(lo=3e-4, hi=4e-4)),
    ("gspo_token", "gspo", dict(clip_eps_low=0.2, clip_eps_high=0.2), dict(lo=0.2, hi=0.2)),  # verl's default ε
    ("sapo", "sapo", {}, {}),
    ("cispo", "cispo", dict(clip_eps_low=0.2, clip_eps_high=0.2), dict(lo=0.2, hi=0.2)),
    ("gmpo", "geo_mean", dict(clip_eps_low=0.2, clip_eps_high=0.2), dict(lo=0.2, hi=0.2)),
    ("gmpo", "geo_mean", {}, dict(lo=0.4, hi=0.4)),
    ("gpg", "gpg", {}, {}),
    ("dppo_tv", "dppo_tv", dict(is_cap=3.0), dict(lo=0.2, hi=0.2, C=3.0)),
    ("dppo_kl", "dppo_kl", dict(is_cap=3.0), dict(lo=0.05, hi=0.05, C=3.0)),
    ("kl_cov", "kl_cov", dict(kl_cov_ratio=0.1, kl_cov_coef=1.0), dict(ratio=0.1, coef=1.0)),
    (
        "clip_cov",
        "clip_cov",
        dict(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=5.0),
        dict(lo=0.2, hi=0.2, lb=0.05, ub=5.0),
    ),
]


@pytest.mark.parametrize("ours,theirs,hyper,c", VERL_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(VERL_CASES)])
def test_loss_and_gradient_equal_verls(ours, theirs, hyper, c):
    """Same loss and gradient as verl on random batches. GMPO: verl's mean over responses adds 1e-8 to each length
    (rel 1e-7). dppo_kl: verl adds 1e-8 inside both logs of the binary KL (only the masks could differ, and do not)."""
    for seed in range(6):
        lp, old, adv, mask = batch(seed=seed, B=6, T=7, spread=0.3)
        if ours == "clip_cov":
            adv = adv * 2
        got = policy_loss(ours, lp, old, adv, mask, **hyper)[0]
        want = verl_loss(theirs, old, lp, adv, mask, **c)
        tol = 1e-7 if ours == "gmpo" else 1e-12
        assert got.item() == pytest.approx(want.item(), rel=tol, abs=1e-14)
        g = grad_of(
            functools.partial(lambda x, o, a, m: policy_loss(ours, x, o, a, m, **hyper), o=old, a=adv, m=mask), lp
        )
        ref = grad_of(
            functools.partial(lambda x, o, a, m: verl_loss(theirs, o, x, a, m, **c), o=old, a=adv, m=mask), lp
        )
        assert torch.allclose(g, ref, rtol=tol, atol=1e-14)


def test_unclamped_exponents_stay_finite_here():
    """A log-ratio of 800 nats (a broken old log-prob): verl's kl_cov and clip_cov exponentiate it and give inf; every
    tether mode clamps at 20 nats first and stays finite."""
    lp, old, adv, mask = batch(seed=11)
    old = old.clone()
    old[0, 0] = -800.0
    assert not math.isfinite(verl_loss("kl_cov", old, lp, adv.abs(), mask, ratio=0.1, coef=1.0).item())
    for name in POLICY_LOSSES:
        loss, metrics = policy_loss(name, lp, old, adv, mask)
        assert math.isfinite(loss.item()), name


@pytest.mark.parametrize("name", ["kl_cov", "clip_cov"])
def test_covariance_modes_take_a_column_slice_of_a_bool_mask(name):
    """The actor passes ``update_mask[:, :t]``: a non-contiguous bool view."""
    lp, old, adv, mask = batch(seed=12)
    wide = torch.zeros(mask.shape[0], mask.shape[1] + 3, dtype=torch.bool)
    wide[:, : mask.shape[1]] = mask.bool()
    view = wide[:, : mask.shape[1]]
    assert not view.is_contiguous()
    a = policy_loss(name, lp, old, adv, view, generator=torch.Generator().manual_seed(0))
    b = policy_loss(name, lp, old, adv, mask, generator=torch.Generator().manual_seed(0))
    assert a[0].item() == b[0].item() and a[1] == b[1]
