"""CUDA gives the CPU results (skipped without a GPU; run on an H200 for this change)."""

import math

import pytest
import torch

import tether.algos as A

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEV = "cuda"


def _close(a, b, atol):
    torch.testing.assert_close(a.detach().double().cpu(), b.detach().double().cpu(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_entropy_and_gradients(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, 5000, generator=g) * 3
    logits[:, :, :10] = -math.inf  # a masked vocabulary
    ids = torch.randint(10, 5000, (4, 300), generator=g)
    xc = logits.to(dtype).clone().requires_grad_(True)
    xg = logits.to(dtype).to(DEV).requires_grad_(True)
    lc, ec = A.logprobs_and_entropy_from_logits(xc, ids, 0.7)
    lg, eg = A.logprobs_and_entropy_from_logits(xg, ids.to(DEV), 0.7)
    (lc.sum() + ec.sum()).backward()
    (lg.sum() + eg.sum()).backward()
    _close(lg, lc, 2e-4)
    _close(eg, ec, 2e-4)
    assert torch.isfinite(xg.grad.float()).all()
    _close(xg.grad.float(), xc.grad.float(), 2e-3)
    ref = torch.randn(4, 300, 5000, generator=g)
    ref[:, :, :10] = -math.inf
    _close(A.kl_full(logits.to(DEV), ref.to(DEV), 0.9), A.kl_full(logits, ref, 0.9), 1e-4)


def test_advantages_losses_and_kl():
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(64, 4096, generator=g), torch.randn(64, 4096, generator=g)
    padded = torch.arange(4096)[None] < torch.randint(2048, 4097, (64,), generator=g)[:, None]
    holes = padded & (torch.rand(64, 4096, generator=g) > 0.1)
    for m in (padded, holes):
        adv_c, ret_c = A.compute_gae(r, v, m, 0.99, 0.95)
        adv_g, ret_g = A.compute_gae(r.to(DEV), v.to(DEV), m.to(DEV), 0.99, 0.95)
        _close(adv_g, adv_c, 1e-4)
        _close(ret_g, ret_c, 1e-4)
    scores, gid = torch.randn(64, generator=g), torch.arange(64) // 8
    for fn in (
        A.compute_grpo_advantages,
        A.compute_rloo_advantages,
        A.compute_reinforce_pp_baseline_advantages,
    ):
        _close(fn(scores.to(DEV), holes.to(DEV), gid.to(DEV))[0], fn(scores, holes, gid)[0], 1e-5)
    rpp_g = A.compute_reinforce_pp_advantages(r.to(DEV), holes.to(DEV))[0]
    _close(rpp_g, A.compute_reinforce_pp_advantages(r, holes)[0], 1e-4)
    lp = torch.randn(64, 4096, generator=g) * 0.1 - 1
    old = torch.randn(64, 4096, generator=g) * 0.1 - 1
    for mode in A.AGG_MODES:
        loss_c, _ = A.ppo_policy_loss(lp, old, r, holes, agg_mode=mode)
        loss_g, _ = A.ppo_policy_loss(lp.to(DEV), old.to(DEV), r.to(DEV), holes.to(DEV), agg_mode=mode)
        _close(loss_g, loss_c, 1e-5)
    for est in A.LOGPROB_KL_ESTIMATORS:
        _close(A.kl_penalty(lp.to(DEV), old.to(DEV), est), A.kl_penalty(lp, old, est), 1e-6)


def test_kl_gradient_past_the_clamp_and_batch_std_scaling():
    lp = torch.tensor([[-25.0, -1.0, -40.0]])
    ref = torch.tensor([[-50.0, -1.5, -1.0]])  # r = [25, 0.5, -39]: two past the +-20 clamp
    for est in ("k3+", "k1+", "k2", "k1", "abs", "k3"):
        grads = []
        for dev in ("cpu", DEV):
            x = lp.to(dev).requires_grad_(True)
            A.kl_penalty(x, ref.to(dev), est).sum().backward()
            grads.append(x.grad)
        _close(grads[1], grads[0], 1e-6)
    g = torch.Generator().manual_seed(2)
    scores, gid, m = torch.randn(64, generator=g), torch.arange(64) // 8, torch.ones(64, 3)
    for choice in ("group", "batch", "none"):
        got = A.compute_grpo_advantages(scores.to(DEV), m.to(DEV), gid.to(DEV), norm_by_std=choice)[0]
        _close(got, A.compute_grpo_advantages(scores, m, gid, norm_by_std=choice)[0], 1e-5)
