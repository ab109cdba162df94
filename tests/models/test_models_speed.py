"""The LM head on response positions only, the fp32 LM head under bf16 autocast, and the perf counts."""

import copy

import pytest
import torch

from tether.models import autocast, fp32_lm_head, response_logprobs
from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm
from tether.trainer.perf import matmul_params, update_flops


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lm")
    tok = build_gsm8k_tokenizer(root / "tok", vocab_size=300, chat_template=False)
    path = build_tiny_causal_lm(root / "m", tok, arch="qwen2", hidden=32, layers=2, heads=2)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _batch(vocab, b=3, p=5, t=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, p + t), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of the first prompt
    mask[1, -1] = 0  # right padding of the second response
    return ids, mask, t


def _naive(model, ids, mask, t, temperature):
    from tether.models import position_ids_from_mask

    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False
    ).logits
    logits = logits[:, -t - 1 : -1].double() / temperature  # every position's logits, then the response's
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -t:, None]).squeeze(-1)


def test_head_runs_on_response_positions_only_and_logprobs_unchanged(tiny_lm):
    ids, mask, t = _batch(tiny_lm.config.vocab_size)
    seen = []
    hook = tiny_lm.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        lp, ent, logits = response_logprobs(
            tiny_lm, ids, mask, t, temperature=0.7, with_entropy=True, return_logits=True
        )
    finally:
        hook.remove()
    assert seen == [(3, t, 32)]  # (B, T, H): the positions that score a response token, not the P+T positions
    assert logits.shape == (3, t, tiny_lm.config.vocab_size)
    torch.testing.assert_close(lp.double(), _naive(tiny_lm, ids, mask, t, 0.7), atol=1e-5, rtol=0)


def test_peft_wrapped_model_also_keeps_only_response_logits(tiny_lm):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(tiny_lm), LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    ids, mask, t = _batch(tiny_lm.config.vocab_size, seed=1)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    try:
        lp = response_logprobs(model, ids, mask, t)[0]
    finally:
        hook.remove()
    assert seen == [t]
    torch.testing.assert_close(lp.double(), _naive(model, ids, mask, t, 1.0), atol=1e-5, rtol=0)


def test_fp32_lm_head_under_bf16_autocast(tiny_lm):
    model = fp32_lm_head(copy.deepcopy(tiny_lm))
    assert fp32_lm_head(model) is model  # idempotent
    ids, mask, t = _batch(tiny_lm.config.vocab_size, seed=2)
    x = torch.randn(2, 3, 32)
    with autocast("cpu", "bfloat16"):
        plain = tiny_lm.get_output_embeddings()(x)
        kept = model.get_output_embeddings()(x)
    assert plain.dtype == torch.bfloat16 and kept.dtype == torch.float32
    torch.testing.assert_close(kept, x @ tiny_lm.get_output_embeddings().weight.T, atol=1e-6, rtol=0)
    lp32 = response_logprobs(tiny_lm, ids, mask, t)[0]
    lp16 = response_logprobs(model, ids, mask, t, compute_dtype="bfloat16")[0]
    assert lp16.dtype == torch.float32
    # bf16 matmuls in the body: close to fp32, not equal
    assert 0 < (lp16 - lp32).abs().max() < 0.05


def test_autocast_float32_is_a_no_op():
    with autocast("cpu", "float32"):
        assert not torch.is_autocast_enabled("cpu")


def test_matmul_params_and_update_flops(tiny_lm):
    total = sum(p.numel() for p in tiny_lm.parameters())  # tied: the embedding is counted once
    v, h = tiny_lm.config.vocab_size, tiny_lm.config.hidden_size
    body, head = matmul_params(tiny_lm)
    assert (body, head) == (total - v * h, v * h)
    # 6 FLOPs per parameter per token: body on 10 context tokens, head on 4 response tokens
    assert update_flops(100, 20, 10, 4) == 6 * (100 * 10 + 20 * 4)


def test_matmul_ceiling_leaves_the_global_rng_alone():
    """Measuring the ceiling at a run's first step must not change what the run samples afterwards."""
    from tether.trainer.perf import matmul_ceiling_flops

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert matmul_ceiling_flops(torch.device("cpu"), n=64, repeats=1) > 0
    assert torch.equal(torch.rand(3), expected)
