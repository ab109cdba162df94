"""tether.algos.logprobs: chunked log-probs, entropy and exact KL; gradients; -inf logits; memory."""

import math

import pytest
import torch

from tether.algos import entropy_from_logits, kl_full, logprobs_and_entropy_from_logits, logprobs_from_logits

F64 = torch.float64


def _naive(logits, ids, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, ids[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_hand_values_with_temperature():
    # logits [0, 2 ln 2] at temperature 2 are [0, ln 2]: p = (1/3, 2/3)
    logits = torch.tensor([[[0.0, 2 * math.log(2.0)]]], dtype=F64)
    ids = torch.tensor([[1]])
    lp, ent = logprobs_and_entropy_from_logits(logits, ids, temperature=2.0)
    assert lp.item() == pytest.approx(math.log(2 / 3), abs=1e-12)
    assert ent.item() == pytest.approx(-(1 / 3) * math.log(1 / 3) - (2 / 3) * math.log(2 / 3), abs=1e-12)
    assert logprobs_from_logits(logits, ids).item() == pytest.approx(math.log(4 / 5), abs=1e-12)  # p = (1/5, 4/5)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 7, 8, 1000, None])
def test_chunked_matches_naive_log_softmax(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=F64) * 3
    ids = torch.randint(0, 11, (3, 5), generator=g)
    lp, ent = logprobs_and_entropy_from_logits(logits, ids, 0.7, chunk_size=chunk_size)
    ref_lp, ref_ent = _naive(logits, ids, 0.7)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy_from_logits(logits, 0.7, chunk_size=chunk_size), ref_ent, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        logprobs_from_logits(logits, ids, 0.7, chunk_size=chunk_size), ref_lp, atol=1e-12, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_logits_are_computed_in_float32(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 4, 50, generator=g) * 4).to(dtype)
    ids = torch.randint(0, 50, (2, 4), generator=g)
    lp, ent = logprobs_and_entropy_from_logits(logits, ids, chunk_size=3)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_lp, ref_ent = _naive(logits, ids, 1.0)  # the same (rounded) logits, in float64
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)


def test_leading_shapes_and_non_contiguous_input():
    g = torch.Generator().manual_seed(2)
    full = torch.randn(3, 6, 9, generator=g, dtype=F64)
    logits = full[:, :-1]  # (3, 5, 9), not contiguous: model outputs shifted by one
    ids = torch.randint(0, 9, (3, 5), generator=g)
    ref_lp, ref_ent = _naive(logits, ids, 1.0)
    for cs in (1, 4, 6, None):
        lp, ent = logprobs_and_entropy_from_logits(logits, ids, chunk_size=cs)
        torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    flat = logprobs_from_logits(logits.reshape(15, 9), ids.reshape(15))  # (N, V)
    torch.testing.assert_close(flat, ref_lp.reshape(15), atol=1e-12, rtol=0)


def test_inputs_are_not_modified():
    logits = torch.randn(2, 3, 7)
    before = logits.clone()
    ids = torch.zeros(2, 3, dtype=torch.long)
    logprobs_and_entropy_from_logits(logits, ids, chunk_size=2)
    kl_full(logits, logits.flip(-1), chunk_size=2)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_gradcheck_logprobs_entropy_and_kl_full(chunk_size):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, generator=g, dtype=F64).requires_grad_(True)
    y = torch.randn(2, 3, 5, generator=g, dtype=F64).requires_grad_(True)
    ids = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(
        lambda a: logprobs_and_entropy_from_logits(a, ids, 0.8, chunk_size=chunk_size), (x,)
    )
    assert torch.autograd.gradcheck(lambda a: entropy_from_logits(a, 1.3, chunk_size=chunk_size), (x,))
    assert torch.autograd.gradcheck(lambda a, b: kl_full(a, b, 0.9, chunk_size=chunk_size), (x, y))


def test_entropy_of_two_equal_logits_and_minus_inf_is_ln2_with_finite_gradient():
    logits = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)
    ent = entropy_from_logits(logits)
    assert ent.item() == pytest.approx(math.log(2.0), abs=1e-7)
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad.abs().max().item() == 0.0  # H is stationary at the uniform distribution
    # the naive formula gives NaN here: the reason for 0 · log 0 = 0
    naive = torch.log_softmax(torch.tensor([0.0, 0.0, -math.inf]), -1)
    assert torch.isnan(-(naive.exp() * naive).sum())


def test_minus_inf_logits_give_finite_logprobs_and_gradients():
    logits = torch.tensor([[[0.0, 0.0, -math.inf], [1.0, -math.inf, 2.0]]], requires_grad=True)
    ids = torch.tensor([[0, 2]])
    lp, ent = logprobs_and_entropy_from_logits(logits, ids)
    p = 1 / (1 + math.exp(-1))  # softmax([1, 2]) at index 1 ... = e^2 / (e + e^2)
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.5), math.log(p)]]), atol=1e-6, rtol=0)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    # d log p_0 / dz = onehot - p = (0.5, -0.5, 0); d H / dz = 0 at the uniform pair
    torch.testing.assert_close(logits.grad[0, 0], torch.tensor([0.5, -0.5, 0.0]), atol=1e-6, rtol=0)
    assert logits.grad[0, 1, 1].item() == 0.0


def test_kl_full_hand_values():
    # p = (1/2, 1/2); q = (1/4, 3/4) at temperature 2 from logits (0, 2 ln 3)
    p = torch.zeros(1, 1, 2, dtype=F64)
    q = torch.tensor([[[0.0, 2 * math.log(3.0)]]], dtype=F64)
    assert kl_full(p, q, temperature=2.0).item() == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    assert kl_full(q, q).item() == pytest.approx(0.0, abs=1e-15)


def test_kl_full_matches_naive_and_is_nonnegative():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, 2, 7, 13, generator=g, dtype=F64)
    out = kl_full(a, b, 1.5, chunk_size=3)
    lp, lq = torch.log_softmax(a / 1.5, -1), torch.log_softmax(b / 1.5, -1)
    torch.testing.assert_close(out, (lp.exp() * (lp - lq)).sum(-1), atol=1e-12, rtol=0)
    assert (out >= 0).all()


def test_kl_full_with_shared_masked_vocabulary_is_finite():
    a = torch.tensor([[[0.0, 1.0, -math.inf]]], requires_grad=True)
    b = torch.tensor([[[0.5, 0.0, -math.inf]]], requires_grad=True)
    out = kl_full(a, b)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()
    lp, lq = torch.log_softmax(a[..., :2], -1), torch.log_softmax(b[..., :2], -1)
    assert out.item() == pytest.approx((lp.exp() * (lp - lq)).sum().item(), abs=1e-6)


def test_backward_saves_no_full_size_intermediate():
    """Only the caller's logits (and (B, T)-sized tensors) are kept for backward, never a (B, T, V) copy."""
    b, t, v = 2, 8, 64
    logits = torch.randn(b, t, v, requires_grad=True)
    ref = torch.randn(b, t, v)
    ids = torch.randint(0, v, (b, t))
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        lp, ent = logprobs_and_entropy_from_logits(logits, ids, 0.9, chunk_size=4)
        kl = kl_full(logits, ref, 0.9, chunk_size=4)
    big = [x for x in saved if x.numel() > b * t]
    assert big and all(x.data_ptr() in (logits.data_ptr(), ref.data_ptr()) for x in big)
    (lp.sum() + ent.sum() + kl.sum()).backward()
    # the naive formula would keep a (B, T, V) log-softmax alive: the check above would catch it
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        torch.log_softmax(logits / 0.9, -1).gather(-1, ids[..., None])
    assert any(x.numel() == b * t * v and x.data_ptr() != logits.data_ptr() for x in saved)


def test_errors():
    logits = torch.randn(2, 3, 4)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(logits, ids, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(logits, temperature=math.nan)
    with pytest.raises(ValueError, match="ids must have shape"):
        logprobs_from_logits(logits, ids[:, :2])
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_from_logits(logits, ids, chunk_size=0)
    with pytest.raises(ValueError, match="same shape"):
        kl_full(logits, logits[:, :2])
    with pytest.raises(ValueError, match=r"\(\.\.\., V\)"):
        entropy_from_logits(torch.randn(4))


def test_unused_entropy_output_costs_no_gradient_and_changes_nothing():
    """Entropy kept only as a metric (not in the loss) gives the same logits gradient as log-probs alone."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 7, (2, 5))
    w = torch.randn(2, 5, dtype=torch.float64)
    lp, ent = logprobs_and_entropy_from_logits(logits, ids, 0.9, with_entropy=True, chunk_size=2)
    (g_both,) = torch.autograd.grad((lp * w).sum(), logits, retain_graph=True)
    lp_only = logprobs_and_entropy_from_logits(logits, ids, 0.9, with_entropy=False, chunk_size=2)[0]
    (g_lp,) = torch.autograd.grad((lp_only * w).sum(), logits)
    assert torch.equal(g_both, g_lp)
    (g_ent,) = torch.autograd.grad(ent.sum(), logits)  # entropy alone: log-probs' gradient is None, not zeros
    naive = -(torch.softmax(logits / 0.9, -1) * torch.log_softmax(logits / 0.9, -1)).sum(-1)
    (g_naive,) = torch.autograd.grad(naive.sum(), logits)
    torch.testing.assert_close(g_ent, g_naive, atol=1e-12, rtol=0)
