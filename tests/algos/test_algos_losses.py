"""tether.algos.losses: agg modes by hand, micro-batch invariance, PPO policy/value losses, KL loss."""

import math

import pytest
import torch

from tether.algos import (
    AGG_MODES,
    agg_loss,
    kl_loss,
    kl_penalty,
    loss_normalizers,
    ppo_policy_loss,
    ppo_value_loss,
)

F64 = torch.float64
INF, NAN = math.inf, math.nan


def t64(x):
    return torch.tensor(x, dtype=F64)


# ---------------------------------------------------------------- agg_loss

LOSS = t64([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [INF, NAN, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])  # the third response is empty


@pytest.mark.parametrize(
    "mode,kwargs,expected",
    [
        ("token-mean", {}, (1 + 2 + 5 + 6 + 7) / 5),
        ("token-sum", {}, 1 + 2 + 5 + 6 + 7),  # no count: the empty row adds 0
        ("token-sum", {"total_tokens": 10, "total_seqs": 7}, 21),  # and the totals change nothing
        ("seq-mean-token-sum", {}, (3 + 18) / 2),  # the empty row is not a response: S = 2
        ("seq-mean-token-mean", {}, (1.5 + 6) / 2),
        ("seq-mean-token-sum-norm", {}, (3 / 4 + 18 / 4) / 2),  # C = T = 4
        ("seq-mean-token-sum-norm", {"norm_constant": 10}, (0.3 + 1.8) / 2),
        ("token-mean", {"total_tokens": 10}, 21 / 10),
        ("seq-mean-token-sum", {"total_seqs": torch.tensor(7)}, 21 / 7),
    ],
)
def test_agg_loss_hand_values(mode, kwargs, expected):
    out = agg_loss(LOSS, MASK, mode, **kwargs)
    assert out.item() == pytest.approx(expected, abs=1e-12)


def test_agg_loss_empty_mask_is_zero_and_masked_garbage_never_reaches_gradient():
    for mode in AGG_MODES:
        assert agg_loss(LOSS, torch.zeros(3, 4), mode).item() == 0.0
        x = LOSS.clone().requires_grad_(True)
        agg_loss(x, MASK, mode).backward()
        assert torch.isfinite(x.grad).all() and (x.grad[~MASK.bool()] == 0).all()


def test_agg_loss_errors():
    with pytest.raises(ValueError, match="token-mean, token-sum, seq-mean-token-sum"):
        agg_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="total_tokens"):
        agg_loss(LOSS, MASK, "token-mean", total_tokens=-1)
    with pytest.raises(ValueError, match="norm_constant"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=0)
    with pytest.raises(ValueError, match="loss_mat"):
        agg_loss(LOSS[:, :2], MASK)


def test_loss_normalizers():
    assert loss_normalizers(MASK) == (5, 2)  # 5 valid tokens, 2 responses with at least one


@pytest.mark.parametrize("mode", [m for m in AGG_MODES if m.startswith("seq-mean")])
def test_a_dropped_empty_row_does_not_change_seq_mean_losses(mode):
    # issue 10 item 2: [[1,1],[2,2],[0,0]] with the last row dropped is the loss of [[1,1],[2,2]]
    loss, mask = t64([[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]), torch.tensor([[1, 1], [1, 1], [0, 0]])
    expected = {"seq-mean-token-mean": 1.5, "seq-mean-token-sum": 3.0, "seq-mean-token-sum-norm": 1.5}[mode]
    assert agg_loss(loss, mask, mode).item() == pytest.approx(expected, abs=1e-12)
    assert agg_loss(loss[:2], mask[:2], mode).item() == pytest.approx(expected, abs=1e-12)


def _split(x, sizes):
    return list(torch.split(x, sizes, dim=0))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_sum_equals_mini_batch_loss_and_gradient(mode):
    g = torch.Generator().manual_seed(0)
    b, t = 9, 7
    loss_mat = torch.randn(b, t, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) > 0.4
    mask[4] = False  # an empty response inside a micro-batch
    mask[3] = False  # and a micro-batch (rows 3:4) holding only an empty response
    full = loss_mat.clone().requires_grad_(True)
    whole = agg_loss(full, mask, mode, norm_constant=t)
    whole.backward()
    total_tokens, total_seqs = loss_normalizers(mask)
    part = loss_mat.clone().requires_grad_(True)
    acc = torch.zeros((), dtype=F64)
    for lm, mm in zip(_split(part, [3, 1, 5]), _split(mask, [3, 1, 5]), strict=True):
        micro = agg_loss(lm, mm, mode, total_tokens=total_tokens, total_seqs=total_seqs, norm_constant=t)
        micro.backward()  # gradient accumulation by plain summation
        acc = acc + micro.detach()
    assert acc.item() == pytest.approx(whole.item(), abs=1e-12)
    torch.testing.assert_close(part.grad, full.grad, atol=1e-12, rtol=0)
    # without the mini-batch totals, the micro-batch means do not add up (this test can fail); token-sum has no
    # totals, so its micro-batch sums add up by themselves
    naive = sum(
        agg_loss(lm, mm, mode, norm_constant=t)
        for lm, mm in zip(_split(loss_mat, [3, 1, 5]), _split(mask, [3, 1, 5]), strict=True)
    )
    if mode == "token-sum":
        assert naive.item() == pytest.approx(whole.item(), abs=1e-12)
    else:
        assert abs(naive.item() - whole.item()) > 1e-3


# ---------------------------------------------------------------- PPO policy loss

RATIOS = [1.0, 1.5, 0.5, 0.5, 5.0, 1.1]
ADV = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]


def _policy_inputs():
    old = torch.zeros(1, 6, dtype=F64)
    lp = torch.log(t64([RATIOS])).requires_grad_(True)
    return lp, old, t64([ADV]), torch.ones(1, 6)


def test_ppo_policy_loss_hand_values_and_gradient():
    lp, old, adv, m = _policy_inputs()
    loss, metrics = ppo_policy_loss(lp, old, adv, m)  # eps 0.2/0.2, dual clip c = 3
    # per token: max(-A r, -A clip(r)) -> (-1, -1.2*, -0.5, 0.8*, 5, 1.1); dual clip on A < 0: 5 -> 3
    per_token = [-1.0, -1.2, -0.5, 0.8, 3.0, 1.1]
    assert loss.item() == pytest.approx(sum(per_token) / 6, abs=1e-12)
    assert metrics["policy/pg_loss"] == pytest.approx(sum(per_token) / 6, abs=1e-12)
    assert metrics["policy/clipfrac"] == pytest.approx(2 / 6, abs=1e-12)  # tokens 1 and 3
    assert metrics["policy/clipfrac_lower"] == pytest.approx(1 / 6, abs=1e-12)  # token 4
    assert metrics["policy/approx_kl"] == pytest.approx(-sum(math.log(r) for r in RATIOS) / 6, abs=1e-12)
    assert all(type(v) is float for v in metrics.values())
    loss.backward()
    # d/d log pi of -A r is -A r where unclipped; 0 where a clip (or the dual clip) is active
    torch.testing.assert_close(lp.grad, t64([[-1.0, 0.0, -0.5, 0.0, 0.0, 1.1]]) / 6, atol=1e-12, rtol=0)


def test_clip_higher_and_disabling_dual_clip():
    old, adv, m = torch.zeros(1, 2, dtype=F64), t64([[1.0, -1.0]]), torch.ones(1, 2)
    lp = torch.log(t64([[1.25, 5.0]]))
    sym, _ = ppo_policy_loss(lp, old, adv, m)  # 1.25 clipped to 1.2: -1.2; dual clip: 3
    assert sym.item() == pytest.approx((-1.2 + 3.0) / 2, abs=1e-12)
    higher, met = ppo_policy_loss(lp, old, adv, m, clip_eps_high=0.28)  # 1.25 < 1.28: unclipped
    assert higher.item() == pytest.approx((-1.25 + 3.0) / 2, abs=1e-12) and met["policy/clipfrac"] == 0.0
    no_dual, met = ppo_policy_loss(lp, old, adv, m, dual_clip_c=None)
    assert no_dual.item() == pytest.approx((-1.2 + 5.0) / 2, abs=1e-12) and met["policy/clipfrac_lower"] == 0.0


def test_policy_loss_guards():
    old, adv, m = torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    lp = torch.tensor([[100.0, -100.0]], requires_grad=True)  # log-ratio clamped to +-20 before exp
    loss, metrics = ppo_policy_loss(lp, old, adv, m)
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
    assert metrics["policy/approx_kl"] == pytest.approx(0.0, abs=1e-6)  # (-20 + 20) / 2
    for kwargs, arg in [
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"clip_eps_low": 1.0}, "clip_eps_low"),
        ({"clip_eps_high": -0.1}, "clip_eps_high"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
        ({"agg_mode": "sum"}, "aggregation"),
    ]:
        with pytest.raises(ValueError, match=arg):
            ppo_policy_loss(lp, old, adv, m, **kwargs)


def test_policy_loss_masked_inf_and_nan_never_leak():
    lp = torch.tensor([[-1.0, -2.0, INF]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -INF]])
    adv = torch.tensor([[1.0, -0.5, NAN]])
    m = torch.tensor([[1, 1, 0]])
    for mode in AGG_MODES:
        loss, metrics = ppo_policy_loss(lp, old, adv, m, agg_mode=mode)
        assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
        lp.grad = None
        loss.backward()
        assert torch.isfinite(lp.grad).all() and lp.grad[0, 2].item() == 0.0


def test_policy_loss_micro_batches_with_totals_match_the_mini_batch():
    g = torch.Generator().manual_seed(1)
    b, t = 8, 5
    lp0 = torch.randn(b, t, generator=g, dtype=F64) * 0.3 - 1
    old = lp0 + torch.randn(b, t, generator=g, dtype=F64) * 0.3
    adv = torch.randn(b, t, generator=g, dtype=F64)
    m = torch.rand(b, t, generator=g) > 0.3
    for mode in AGG_MODES:
        full = lp0.clone().requires_grad_(True)
        whole, _ = ppo_policy_loss(full, old, adv, m, agg_mode=mode)
        whole.backward()
        tt, ts = loss_normalizers(m)
        part = lp0.clone().requires_grad_(True)
        total = 0.0
        for sl in (slice(0, 3), slice(3, 8)):
            micro, _ = ppo_policy_loss(part[sl], old[sl], adv[sl], m[sl], agg_mode=mode, total_tokens=tt, total_seqs=ts)
            micro.backward()
            total += micro.item()
        assert total == pytest.approx(whole.item(), abs=1e-12)
        torch.testing.assert_close(part.grad, full.grad, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- value loss


def test_value_loss_hand_values():
    values = t64([[1.0, 2.0, 0.0, NAN]]).requires_grad_(True)
    old = t64([[0.0, 1.0, 0.2, INF]])
    returns = t64([[1.0, 0.0, 0.5, 1.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = ppo_value_loss(values, old, returns, m, clip_range=0.5)
    # t0: V_clip 0.5 -> max(0, 0.25) = 0.25 (clipped); t1: V_clip 1.5 -> max(4, 2.25) = 4; t2: 0.25 both
    assert loss.item() == pytest.approx(0.5 * (0.25 + 4.0 + 0.25) / 3, abs=1e-12)
    assert metrics == pytest.approx({"value/loss": 0.75, "value/clipfrac": 1 / 3}, abs=1e-12)
    loss.backward()
    # d/dV: t0 clipped -> 0; t1: 0.5 * 2 (V - R) / 3 = 2/3; t2: both branches equal, each 0.5 * 2 * (-0.5) / 3
    torch.testing.assert_close(values.grad, t64([[0.0, 2 / 3, -1 / 6, 0.0]]), atol=1e-12, rtol=0)
    unclipped, metrics = ppo_value_loss(values, old, returns, m, clip_range=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.0 + 4.0 + 0.25) / 3, abs=1e-12)
    assert metrics["value/clipfrac"] == 0.0
    with pytest.raises(ValueError, match="clip_range"):
        ppo_value_loss(values, old, returns, m, clip_range=0.0)


def test_value_clipfrac_counts_no_token_inside_the_clip_range():
    """Inside the range V_clip = V_old + (V − V_old) is V only up to rounding: in float32 (the critic's dtype) this
    token's V_clip = 0.16153106 ≠ V = 0.16153105 makes the clipped error the larger by a rounding, yet |V − V_old| =
    0.43 < 0.5 cuts nothing: clipfrac 0 (it counted 1 and flipped between world sizes 1 and 2)."""
    values, old, returns = (torch.tensor([[x]], dtype=torch.float32) for x in (0.16153105, 0.58914572, 2.11284852))
    v_clip = old + (values - old).clamp(-0.5, 0.5)
    assert v_clip != values and (v_clip - returns).square() > (values - returns).square()  # the rounding tie
    loss, metrics = ppo_value_loss(values, old, returns, torch.ones(1, 1), clip_range=0.5)
    assert metrics["value/clipfrac"] == 0.0
    # and a token past the range still counts: V − V_old = 0.6 > 0.5 with the clipped error the larger
    _, metrics = ppo_value_loss(t64([[0.6]]), t64([[0.0]]), t64([[1.0]]), torch.ones(1, 1), clip_range=0.5)
    assert metrics["value/clipfrac"] == 1.0


# ---------------------------------------------------------------- KL loss


def test_kl_loss_matches_agg_of_kl_penalty_and_ignores_masked_padding():
    lp = torch.tensor([[-1.0, -2.0, -INF], [-0.3, -INF, -INF]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -INF], [-0.4, -0.1, -INF]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, metrics = kl_loss(lp, ref, m, "low_var_kl")
    r = [0.5, -1.0, 0.1]
    assert loss.item() == pytest.approx(sum(math.exp(-x) + x - 1 for x in r) / 3, abs=1e-6)
    assert metrics["policy/kl_loss"] == pytest.approx(loss.item(), abs=0)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[~m.bool()] == 0).all()
    valid_lp, valid_ref = torch.tensor([[-1.0, -2.0, -0.3]]), torch.tensor([[-1.5, -1.0, -0.4]])
    expected = agg_loss(kl_penalty(valid_lp, valid_ref, "k3"), torch.ones(1, 3))
    assert loss.item() == pytest.approx(expected.item(), abs=1e-7)
