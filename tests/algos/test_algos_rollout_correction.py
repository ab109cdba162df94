"""Rollout correction (engine vs trainer): hand-worked values, exact enumeration, and verl's formulas."""

from __future__ import annotations

import math

import pytest
import torch

from tether.algos import REJECT_CRITERIA, kl_loss, ppo_policy_loss, rollout_correction

F64 = torch.float64
# δ = old − rollout = [[0.2, 0, -1], [0, -1, pad]]
OLD = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]], dtype=F64)
ROLLOUT = torch.tensor([[-1.2, -0.5, -1.0], [-0.3, -0.2, float("nan")]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
E = math.exp


def close(x: torch.Tensor, want) -> bool:
    return torch.allclose(x, torch.tensor(want, dtype=x.dtype), rtol=0, atol=1e-12)


def correct(**kw):
    return rollout_correction(OLD, ROLLOUT, MASK, **kw)


def test_token_truncation_by_hand():
    w, keep, m = correct(level="token", threshold=1.1)
    assert close(w, [[1.1, 1.0, E(-1)], [1.0, E(-1), 0.0]])  # e^0.2 = 1.221 > 1.1: truncated
    assert keep.tolist() == MASK.bool().tolist()
    assert m["rollout_corr/truncated_frac"] == pytest.approx(1 / 5)
    assert m["rollout_corr/kl"] == pytest.approx((-0.2 + 0 + 1 + 0 + 1) / 5)  # k1 of KL(π_rollout‖π_old)
    k3 = [E(d) - 1 - d for d in (0.2, 0.0, -1.0, 0.0, -1.0)]
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(k3) / 5, rel=1e-9)
    raw = [E(0.2), 1.0, E(-1), 1.0, E(-1)]
    assert m["rollout_corr/weight_max"] == pytest.approx(E(0.2)) and m["rollout_corr/weight_min"] == pytest.approx(
        E(-1)
    )
    assert m["rollout_corr/weight_mean"] == pytest.approx(sum(raw) / 5)
    used = [1.1, 1.0, E(-1), 1.0, E(-1)]
    assert m["rollout_corr/ess"] == pytest.approx(sum(used) ** 2 / (5 * sum(x * x for x in used)), rel=1e-12)


def test_k3_kl_metric_clamps_delta_at_20_nats():
    """δ = (95, 0): the engine gave the first token e^-95 of the trainer's probability. k3 = e^δ − 1 − δ overflows
    float32 there (verl's metric is inf); tether clamps δ at 20 first, as the weights are (docs/api.md,
    deviations): k3_kl = (e^20 − 21 + 0)/2, finite in float32."""
    old = torch.tensor([[-1.0, -0.5]])
    rollout = torch.tensor([[-96.0, -0.5]])
    _, _, m = rollout_correction(old, rollout, torch.ones(1, 2), threshold=2.0)
    assert math.isfinite(m["rollout_corr/k3_kl"])
    assert m["rollout_corr/k3_kl"] == pytest.approx((E(20) - 21) / 2, rel=1e-6)  # float32 rounding of e^20


def test_sequence_product_and_geometric_mean_by_hand():
    w, _, _ = correct(level="sequence", threshold=10.0)
    assert close(w, [[E(-0.8)] * 3, [E(-1.0)] * 2 + [0.0]])
    w, _, _ = correct(level="geometric", threshold=10.0)
    assert close(w, [[E(-0.8 / 3)] * 3, [E(-0.5)] * 2 + [0.0]])


def test_mask_mode_zeroes_weights_outside_the_band_and_keeps_their_count():
    w, keep, m = correct(level="token", mode="mask", threshold=2.0)  # lower = 1/2: e^-1 is outside
    assert close(w, [[E(0.2), 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert keep.tolist() == MASK.bool().tolist()  # masked, not rejected: still counted by the loss
    assert m["rollout_corr/masked_frac"] == pytest.approx(2 / 5) and m["rollout_corr/rejected_frac"] == 0
    w, _, _ = correct(level="token", mode="mask", threshold=2.0, lower=0.3)
    assert close(w, [[E(0.2), 1.0, E(-1)], [1.0, E(-1), 0.0]])


@pytest.mark.parametrize(
    "criterion,threshold,kept",
    [
        ("token_k3", 0.3, [[1, 1, 0], [1, 0, 0]]),  # k3(δ=-1) = e^-1 = 0.368 > 0.3
        ("token_k1", 0.5, [[1, 1, 0], [1, 0, 0]]),  # |k1| = 1 > 0.5
        ("token_k1", 1.5, [[1, 1, 1], [1, 1, 0]]),
        ("seq_mean_k3", 0.15, [[1, 1, 1], [0, 0, 0]]),  # row means 0.1298 and 0.1839
        ("seq_sum_k3", 0.38, [[0, 0, 0], [1, 1, 0]]),  # row sums 0.3893 and 0.3679
        ("seq_max_k2", 0.4, [[0, 0, 0], [0, 0, 0]]),  # ½·1² = 0.5 in both rows
        ("seq_sum_k1", 0.9, [[1, 1, 1], [0, 0, 0]]),  # sums of k1 = -δ: 0.8 and 1.0
    ],
)
def test_rejection_by_hand(criterion, threshold, kept):
    w, keep, m = correct(level="none", reject=criterion, reject_threshold=threshold)
    assert keep.int().tolist() == kept
    assert close(w, kept)
    assert m["rollout_corr/rejected_frac"] == pytest.approx(1 - sum(map(sum, kept)) / 5)


def test_batch_normalisation_makes_the_kept_weights_average_one():
    w, keep, m = correct(level="token", threshold=10.0, batch_normalize=True)
    assert float(w[keep].mean()) == pytest.approx(1.0, rel=1e-12)
    assert m["rollout_corr/batch_norm_factor"] == pytest.approx((E(0.2) + 1 + E(-1) + 1 + E(-1)) / 5)
    w, _, _ = correct(level="sequence", threshold=10.0, batch_normalize=True)
    assert (float(w[0, 0]) + float(w[1, 0])) / 2 == pytest.approx(1.0, rel=1e-12)  # mean over sequences


def test_unknown_engine_logprobs_get_no_correction_and_are_counted():
    rollout = ROLLOUT.clone()
    rollout[0, 2] = float("nan")
    w, _, m = rollout_correction(OLD, rollout, MASK, level="token", threshold=10.0)
    assert float(w[0, 2]) == 1.0
    assert m["rollout_corr/unknown_frac"] == pytest.approx(1 / 5)


def test_bypass_leaves_truncation_to_the_ppo_clip():
    w, _, m = correct(level="token", threshold=1.1, apply_truncation=False)
    assert w.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert m["rollout_corr/truncated_frac"] == pytest.approx(1 / 5)  # measured all the same
    w, _, _ = correct(level="token", mode="mask", threshold=2.0, apply_truncation=False)
    assert w.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]  # 0/1 factors


def test_no_valid_token_gives_zero_weights_and_no_metrics():
    w, keep, m = rollout_correction(OLD, ROLLOUT, torch.zeros_like(MASK), level="token")
    assert not bool(w.any()) and not bool(keep.any()) and m == {}


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="level 'tok'"):
        correct(level="tok")
    with pytest.raises(ValueError, match="reject_threshold"):
        correct(reject="token_k3")
    with pytest.raises(ValueError, match="lower"):
        correct(mode="mask", threshold=2.0, lower=3.0)
    with pytest.raises(ValueError, match="threshold"):
        correct(threshold=0.0)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        rollout_correction(OLD, ROLLOUT[:, :2], MASK)


# ------------------------------------------------------------------------------- exact enumeration

P_ROLLOUT = torch.softmax(torch.tensor([0.2, -0.4, 1.0, 0.1, -0.8], dtype=F64), -1)
P_OLD = torch.softmax(torch.tensor([0.5, -0.1, 0.4, 0.3, -1.5], dtype=F64), -1)
F = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=F64)  # any per-token quantity (a loss, an advantage)


def enumerate_weights(threshold: float, mode: str = "truncate") -> torch.Tensor:
    """The weight of each of the 5 actions, one (1, 1) token each."""
    old = P_OLD.log().view(5, 1)
    rollout = P_ROLLOUT.log().view(5, 1)
    w, _, _ = rollout_correction(old, rollout, torch.ones(5, 1), level="token", mode=mode, threshold=threshold)
    return w.view(5)


def test_untruncated_weights_make_the_rollout_expectation_the_old_one_exactly():
    """Under a ~ π_rollout, E[w·f] = E_{π_old}[f] with w = π_old/π_rollout (no weight above the threshold)."""
    w = enumerate_weights(threshold=100.0)
    assert float((P_ROLLOUT * w * F).sum()) == pytest.approx(float((P_OLD * F).sum()), rel=1e-12)


def test_truncation_bias_is_the_clipped_mass():
    """TIS at C: E_rollout[min(w, C)·f] − E_old[f] = −Σ π_rollout(a)·(w_a − C)⁺·f(a), worked out by hand."""
    ratio = P_OLD / P_ROLLOUT
    c = float(ratio.sort().values[2])  # clip the two largest
    w = enumerate_weights(threshold=c)
    bias = float((P_ROLLOUT * w * F).sum() - (P_OLD * F).sum())
    assert bias == pytest.approx(-float((P_ROLLOUT * (ratio - c).clamp(min=0) * F).sum()), rel=1e-12)
    assert abs(bias) > 1e-3


def test_mask_bias_is_the_masked_mass():
    ratio = P_OLD / P_ROLLOUT
    w = enumerate_weights(threshold=1.25, mode="mask")
    outside = (ratio < 0.8) | (ratio > 1.25)
    assert bool(outside.any())
    bias = float((P_ROLLOUT * w * F).sum() - (P_OLD * F).sum())
    assert bias == pytest.approx(-float((P_OLD * F)[outside].sum()), rel=1e-12)


# ------------------------------------------------------------------------------- verl's formulas

SAFETY = 20.0


def verl_like(old, rollout, mask, *, level, threshold, batch_normalize, rs, rs_threshold):
    """verl's compute_rollout_correction_and_rejection_mask (trainer/ppo/rollout_corr_helper.py, 2026 HEAD),
    transcribed: token/sequence IS weights truncated at the threshold, one rejection criterion, kl/k3_kl."""
    m = mask.to(old.dtype)
    log_ratio = old - rollout
    if level == "token":
        w = torch.exp(log_ratio.clamp(-SAFETY, SAFETY))
    else:
        w = torch.exp((log_ratio * m).sum(-1, keepdim=True).clamp(-SAFETY, SAFETY)).expand_as(log_ratio)
    w = (w * m).clamp(max=threshold)
    if batch_normalize:
        if level == "token":
            mean = (w * m).sum() / m.sum()
        else:
            seq = (w * m).sum(-1) / m.sum(-1)
            mean = seq.mean()
        w = w / mean
    keep = torch.ones_like(m)
    if rs is not None:
        lr = log_ratio.clamp(-SAFETY, SAFETY)
        stat = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1 - lr}[rs[-2:]]
        if rs.startswith("token"):
            per = stat
        elif rs.startswith("seq_sum"):
            per = (stat * m).sum(-1, keepdim=True).expand_as(stat)
        elif rs.startswith("seq_mean"):
            per = ((stat * m).sum(-1) / m.sum(-1))[:, None].expand_as(stat)
        else:
            per = stat.masked_fill(m == 0, float("-inf")).amax(-1, keepdim=True).expand_as(stat)
        if rs.endswith("k1"):  # verl: a ratio bound T, lower 1/T, applied to k1 in log space
            ok = (per >= math.log(1 / rs_threshold)) & (per <= math.log(rs_threshold))
        else:
            ok = per <= rs_threshold
        keep = ok.to(m.dtype)
    kl = ((rollout - old) * m).sum() / m.sum()
    k3 = ((torch.exp(log_ratio) - log_ratio - 1) * m).sum() / m.sum()
    return w, (mask.to(m.dtype) * keep), float(kl), float(k3)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(
    "rs,batch_normalize",
    [
        (None, False),
        (None, True),
        ("token_k3", False),
        ("seq_mean_k1", False),
        ("seq_sum_k2", False),
        ("seq_max_k3", False),
    ],
)
def test_matches_verls_formulas(level, rs, batch_normalize):
    """Same weights, kept tokens, kl and k3_kl as verl on random batches; verl's k1 ratio bound T is tether's log T
    (nats). Where verl and tether differ by design: verl's weights are not zeroed at rejected tokens (its
    response_mask drops them from the loss instead), so weights are compared on the kept tokens; and with
    rejection, verl normalises over every token while tether normalises over the kept ones (not compared)."""
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        B, T = 6, 7
        mask = (torch.rand(B, T, generator=g) < 0.8).long()
        mask[:, 0] = 1
        old = -torch.rand(B, T, generator=g, dtype=F64) * 3
        rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
        thr_verl = {None: None, "token_k3": 0.05, "seq_mean_k1": 1.2, "seq_sum_k2": 0.1, "seq_max_k3": 0.06}[rs]
        thr_tether = math.log(thr_verl) if rs is not None and rs.endswith("k1") else thr_verl
        w_v, keep_v, kl_v, k3_v = verl_like(
            old,
            rollout,
            mask,
            level=level,
            threshold=2.0,
            batch_normalize=batch_normalize,
            rs=rs,
            rs_threshold=thr_verl,
        )
        w_t, keep_t, m = rollout_correction(
            old,
            rollout,
            mask,
            level=level,
            threshold=2.0,
            batch_normalize=batch_normalize,
            reject=rs or "none",
            reject_threshold=thr_tether,
        )
        assert keep_t.to(F64).tolist() == keep_v.tolist()
        assert torch.allclose(w_t[keep_t], w_v[keep_t], rtol=1e-12, atol=0)
        assert m["rollout_corr/kl"] == pytest.approx(kl_v, rel=1e-12)
        assert m["rollout_corr/k3_kl"] == pytest.approx(k3_v, rel=1e-9)


def test_every_criterion_runs():
    for criterion in REJECT_CRITERIA[1:]:
        w, keep, m = correct(level="token", reject=criterion, reject_threshold=0.2)
        assert torch.isfinite(w).all() and set(m) >= {"rollout_corr/rejected_frac", "rollout_corr/ess"}


# ------------------------------------------------------------------------------- the losses take the weights


def test_policy_and_kl_losses_multiply_each_token_by_its_weight():
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(2, 3, generator=g, dtype=F64) * 2).requires_grad_(True)
    old = lp.detach() + 0.1 * torch.randn(2, 3, generator=g, dtype=F64)
    ref = lp.detach() - 0.2
    adv = torch.randn(2, 3, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w = torch.tensor([[0.5, 2.0, 9.0], [1.0, 0.0, 1.5]], dtype=F64)
    for fn in (
        lambda weights: ppo_policy_loss(lp, old, adv, mask, weights=weights)[0],
        lambda weights: kl_loss(lp, ref, mask, "k3", old_logprobs=old, weights=weights)[0],
    ):
        per_token = [
            fn(
                torch.zeros(2, 3, dtype=F64).index_put_(
                    (torch.tensor(i), torch.tensor(j)), torch.tensor(1.0, dtype=F64)
                )
            )
            for i, j in ((0, 0), (0, 1), (1, 0), (1, 1), (1, 2))
        ]
        want = sum(
            float(w[i, j]) * float(x)
            for (i, j), x in zip(((0, 0), (0, 1), (1, 0), (1, 1), (1, 2)), per_token, strict=True)
        )
        assert float(fn(w)) == pytest.approx(want, rel=1e-12)
