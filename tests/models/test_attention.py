"""``actor.attn_implementation``: tether's attention (``tether.models.attention``) against sdpa and a float64
reference."""

import math

import pytest
import torch

import tether.models.attention as attention
from tether.config import ConfigError


def reference_attention(q, k, v, allowed):
    """Float64 softmax(q kᵀ / √D) v, one head at a time, key/value head h // G for query head h;
    ``allowed`` (B, L, S) bool. Returns (B, L, H, D)."""
    B, H, L, D = q.shape
    G = H // k.shape[1]
    out = torch.empty(B, L, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = q[b, h].double() @ k[b, h // G].double().T / math.sqrt(D)  # (L, S)
            s = s.masked_fill(~allowed[b], -math.inf)
            w = torch.softmax(s, -1)
            out[b, :, h] = torch.nan_to_num(w, nan=0.0) @ v[b, h // G].double()
    return out


def qkv(B=3, H=4, H_kv=2, L=5, S=5, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(*shape, generator=g, dtype=dtype) for shape in ((B, H, L, D), (B, H_kv, S, D), (B, H_kv, S, D))
    )


def test_matmul_attention_causal_without_a_mask_equals_the_float64_reference():
    q, k, v = qkv()
    got = attention.matmul_attention(q, k, v, None, None, is_causal=True)
    want = reference_attention(q, k, v, torch.ones(5, 5, dtype=torch.bool).tril().expand(3, 5, 5))
    assert got.shape == (3, 5, 4, 8) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_matmul_attention_with_a_padding_mask_gqa_and_a_scale():
    """Left padding (row 1 starts at key 2) as sdpa_mask builds it, (B, 1, L, S) bool; GQA 4/2; an explicit scale."""
    q, k, v = qkv()
    allowed = torch.ones(5, 5, dtype=torch.bool).tril().expand(3, 5, 5).clone()
    allowed[1, :, :2] = False
    allowed[1, :2] = torch.eye(5, dtype=torch.bool)[:2]  # padding queries: some key each, as they are never read
    got = attention.matmul_attention(q, k, v, allowed[:, None], 0.5, is_causal=True)
    want = reference_attention(q * 0.5 * math.sqrt(8), k, v, allowed)  # scale 0.5 instead of 1/√D
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_query_row_with_no_key_to_attend_gets_the_mean_of_the_values_not_nan():
    """A fully masked row (a left-padding query in some masks): uniform weights, so the mean of v, finite."""
    q, k, v = qkv(B=1, L=3, S=3)
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    allowed[0, 0, 0] = False
    got = attention.matmul_attention(q, k, v, allowed, None, is_causal=True)
    # (H, D): head h reads v head h // 2
    torch.testing.assert_close(got[0, 0], v[0].mean(1).repeat_interleave(2, 0), rtol=0, atol=1e-12)


def test_matmul_attention_decode_query_over_a_longer_cache():
    """One query token over S = 9 cached keys, no mask (every key) and with a (B, 1, 1, S) mask."""
    q, k, v = qkv(L=1, S=9)
    torch.testing.assert_close(
        attention.matmul_attention(q, k, v, None, None, is_causal=True),
        reference_attention(q, k, v, torch.ones(3, 1, 9, dtype=torch.bool)),
        rtol=0,
        atol=1e-12,
    )
    allowed = torch.ones(3, 1, 9, dtype=torch.bool)
    allowed[0, :, :4] = False
    torch.testing.assert_close(
        attention.matmul_attention(q, k, v, allowed[:, None], None, is_causal=True),
        reference_attention(q, k, v, allowed),
        rtol=0,
        atol=1e-12,
    )


def test_matmul_attention_causal_drops_keys_past_the_query_length_as_sdpa_does():
    """No mask, causal, S > L (a prefill into an empty static cache): only the first L keys, as sdpa_attention_forward
    crops."""
    q, k, v = qkv(L=4, S=7)
    want = reference_attention(q, k[:, :, :4], v[:, :, :4], torch.ones(4, 4, dtype=torch.bool).tril().expand(3, 4, 4))
    torch.testing.assert_close(
        attention.matmul_attention(q, k, v, None, None, is_causal=True), want, rtol=0, atol=1e-12
    )


def test_matmul_attention_in_bf16_under_autocast_is_within_bf16_rounding():
    """float32 q, k (as rotary leaves them under autocast) and bf16 v: matmuls in bf16, softmax in
    float32; the output is bf16 and within 2^-6 of the float64 reference for unit-normal inputs."""
    q, k, v = qkv(B=2, L=16, S=16, D=32, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attention.matmul_attention(q, k, v.bfloat16(), None, None, is_causal=True)
    assert got.dtype == torch.bfloat16
    want = reference_attention(
        q, k, v.bfloat16().float(), torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 16, 16)
    )
    assert (got.double() - want).abs().max() < 2**-6


@pytest.mark.parametrize(
    "dtype, autocast, L, S, extra, expected",
    [
        (torch.bfloat16, False, 48, 48, {}, True),
        (torch.float16, False, 1, 48, {}, True),
        (torch.float32, True, 48, 48, {}, True),  # float32 tensors under bf16 autocast: bf16 work
        (torch.float32, False, 48, 48, {}, False),  # float32: sdpa, bit for bit
        (torch.float64, False, 48, 48, {}, False),
        (torch.bfloat16, False, 48, 128, {}, True),
        (torch.bfloat16, False, 48, 129, {}, False),  # keys past MAX_MATMUL_KEYS: flash
        (torch.bfloat16, False, 1, 4096, {}, True),  # a decode query over any cache
        (torch.bfloat16, False, 48, 48, {"dropout": 0.1}, False),
        (torch.bfloat16, False, 48, 48, {"softcap": 30.0}, False),
        (torch.bfloat16, False, 48, 48, {"float_mask": True}, False),
    ],
)
def test_use_matmul_policy(dtype, autocast, L, S, extra, expected):
    q = torch.zeros(2, 4, L, 8, dtype=dtype)
    k = torch.zeros(2, 2, S, 8, dtype=dtype)
    mask = torch.zeros(2, 1, L, S) if extra.get("float_mask") else None
    kwargs = {"softcap": extra["softcap"]} if "softcap" in extra else {}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert attention.use_matmul(None, q, k, mask, extra.get("dropout", 0.0), kwargs) is expected


def test_use_matmul_refuses_more_scores_than_the_budget(monkeypatch):
    q, k = torch.zeros(2, 4, 16, 8, dtype=torch.bfloat16), torch.zeros(2, 2, 16, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(attention, "MAX_MATMUL_SCORES", 2 * 4 * 16 * 16)
    assert attention.use_matmul(None, q, k, None, 0.0, {})
    monkeypatch.setattr(attention, "MAX_MATMUL_SCORES", 2 * 4 * 16 * 16 - 1)
    assert not attention.use_matmul(None, q, k, None, 0.0, {})


@pytest.mark.parametrize(
    "setting, device, dtypes, expected",
    [
        ("auto", "cpu", ("float32", "bfloat16", None), "tether"),
        ("auto", "cpu", ("bfloat16", "float32", None), "tether"),
        ("auto", "cpu", ("float32", "float32", "bfloat16"), "tether"),  # fsdp.param_dtype
        ("auto", "cpu", ("float32", "float32", None), None),
        ("auto", "cuda", ("float32", "bfloat16", None), None),
        ("model", "cpu", ("float32", "bfloat16", None), None),
        ("eager", "cpu", ("float32", "float32", None), "eager"),
        ("tether", "cpu", ("float32", "float32", None), "tether"),
    ],
)
def test_resolve(setting, device, dtypes, expected):
    assert attention.resolve(setting, device=device, dtypes=dtypes) == expected


@pytest.fixture(scope="module")
def qwen2_f64(tmp_path_factory):
    from tether.models import load_causal_lm
    from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts

    tmp = tmp_path_factory.mktemp("attn")
    tok_dir = build_gsm8k_tokenizer(tmp / "tok", texts=synthetic_math_texts(50))
    path = build_tiny_causal_lm(tmp / "m", tok_dir, arch="qwen2", hidden=64, layers=2, heads=4, seed=0)
    return path, load_causal_lm(path, dtype="float32").double().eval()


@pytest.fixture
def forced(monkeypatch):
    """The matmul path taken on every call (float64 here), counting its calls."""
    calls = []
    monkeypatch.setattr(attention, "use_matmul", lambda *a, **k: calls.append(1) or True)
    return calls


def _pair(model):
    import copy

    other = copy.deepcopy(model)
    attention.set_attn_implementation(other, "tether")
    assert other.config._attn_implementation == "tether" and model.config._attn_implementation == "sdpa"
    return other


def test_tether_attention_in_a_qwen2_model_equals_sdpa_in_every_layout(qwen2_f64, forced):
    """Float64 with the matmul path forced: padded, unpadded, packed (restarting positions), shared-prompt
    cache and decode-loop tokens equal sdpa's; gradients too."""
    from tether.models import response_logprobs
    from tether.models.prefix import prompt_groups, shared_prefix_logprobs
    from tether.rollout import hf_decode

    _, model = qwen2_f64
    other = _pair(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[3, :1] = 0
    for m in (mask, torch.ones_like(ids)):
        a = response_logprobs(model, ids, m, 5)[0]
        b = response_logprobs(other, ids, m, 5)[0]
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]  # two sequences packed in one row
    a = model(input_ids=ids[:1], position_ids=pos, use_cache=False).logits
    b = other(input_ids=ids[:1], position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    p_ids, p_mask = ids[[0, 0, 1, 1], :8], mask[[0, 0, 1, 1], :8]  # two prompts, two responses each
    r_ids, r_mask = ids[:, 8:], torch.ones(4, 4, dtype=torch.long)
    groups = prompt_groups(p_ids, p_mask)
    a = shared_prefix_logprobs(model, p_ids, p_mask, r_ids, r_mask, groups)[0]
    b = shared_prefix_logprobs(other, p_ids, p_mask, r_ids, r_mask, groups)[0]
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    gen = dict(do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=1, use_cache=True)
    with torch.no_grad():
        a = hf_decode.decode(model, ids, mask, hf_decode.plan(model, gen))
        b = hf_decode.decode(other, ids, mask, hf_decode.plan(other, gen))
    assert torch.equal(a, b)
    for m in (model, other):
        m.zero_grad()
        response_logprobs(m, ids, mask, 5)[0].sum().backward()
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-10, msg=name)
    assert len(forced) > 0


def test_float32_work_is_sdpa_bit_for_bit(qwen2_f64):
    """Not forced: float32 tensors go to sdpa_attention_forward itself, so the logits are bitwise sdpa's."""
    from tether.models import load_causal_lm

    path, _ = qwen2_f64
    model = load_causal_lm(path).eval()
    other = _pair(model)
    ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, other(input_ids=ids).logits)


def test_an_unknown_attn_implementation_is_a_config_error_naming_the_key(qwen2_f64):
    _, model = qwen2_f64
    import copy

    with pytest.raises(ConfigError, match=r"actor.attn_implementation='no_such_kernel'"):
        attention.set_attn_implementation(copy.deepcopy(model), "no_such_kernel")


def _cfg(setting, dtype="float32", compute="float32", fsdp=None):
    from types import SimpleNamespace

    return SimpleNamespace(
        actor=SimpleNamespace(attn_implementation=setting, dtype=dtype, compute_dtype=compute),
        trainer=SimpleNamespace(fsdp=SimpleNamespace(param_dtype=fsdp)),
    )


def test_for_config_checks_the_name_before_any_model_loads():
    assert attention.for_config(_cfg("auto", compute="bfloat16"), "cpu") == "tether"
    assert attention.for_config(_cfg("auto", fsdp="bfloat16"), "cpu") == "tether"
    # known; installed or not is transformers' to say
    assert attention.for_config(_cfg("flash_attention_2"), "cpu") == "flash_attention_2"
    # a Hub kernel
    assert attention.for_config(_cfg("kernels-community/flash-attn"), "cpu") == "kernels-community/flash-attn"
    with pytest.raises(ConfigError, match=r"actor.attn_implementation='flash_nope' is not .* one of \[.*'sdpa'"):
        attention.for_config(_cfg("flash_nope"), "cpu")
