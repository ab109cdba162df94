"""tether's own HF decode loop (``rollout.hf_decode=tether``) against ``model.generate``: the same tokens, bit for
bit."""

import pytest
import torch
from error_model import reduction_tol

from tether.rollout import HFRolloutEngine, SamplingParams, hf_decode
from tether.tasks.sft import load_reference

SAMPLING = {
    "T=0.7": dict(temperature=0.7, top_p=1.0, top_k=0),
    "T=1.3,top_p=0.8": dict(temperature=1.3, top_p=0.8, top_k=0),
    "top_k=5": dict(temperature=1.0, top_p=1.0, top_k=5),
    "greedy": dict(temperature=1.0, top_p=1.0, top_k=0, do_sample=False),
}


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "do_sample", "max_new_tokens")


def _run(model, tok, p_ids, p_mask, mode, *, seed=3, return_logprobs=False, monkeypatch=None, **engine_kwargs):
    """One generate call with ``rollout.hf_decode=mode`` and the RNG's next draw after it; under
    ``tether`` ``model.generate`` is made to raise, so the loop really served the call."""
    engine_kwargs.pop("returns_logprobs", None)
    sampling = {k: engine_kwargs.pop(k) for k in SAMPLING_KEYS if k in engine_kwargs}
    params = SamplingParams(**{"max_new_tokens": 12, **sampling}, logprobs=return_logprobs)
    engine = HFRolloutEngine(model, tok, hf_decode=mode, **engine_kwargs)
    if mode == "tether" and monkeypatch is not None:
        monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("tether's loop fell back to model.generate"))
    torch.manual_seed(seed)
    ids, lp = engine.generate_padded(p_ids, p_mask, params)
    out = (ids, lp) if return_logprobs else ids
    after = torch.rand(3)
    if monkeypatch is not None:
        monkeypatch.undo()
    return out, after


def _assert_same(a, b, return_logprobs):
    (out_a, rng_a), (out_b, rng_b) = a, b
    if return_logprobs:
        assert torch.equal(out_a[0], out_b[0])
        assert torch.equal(out_a[1], out_b[1])  # the recorder sees bitwise the same scores
    else:
        assert torch.equal(out_a, out_b)
    assert torch.equal(rng_a, rng_b)  # the same random numbers consumed: the next draw is the same


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("share", [True, False], ids=["share_prefill", "per_row_prefill"])
def test_tether_decode_equals_generate_on_the_digit_sum_llama(sampling, share, monkeypatch):
    """Llama (the embedded reference), left-padded prompts of two lengths, every row ending with EOS
    mid-batch at its own step (pad after it): identical tokens, log-probs and RNG state."""
    model, tok = load_reference()
    prompt = tok(["3,13=", "2,7=", "1,2=", "3,20="] * 16, return_tensors="pt", padding=True)
    p_ids, p_mask = prompt["input_ids"], prompt["attention_mask"]
    assert (p_mask == 0).any()
    for lp in (False, True):
        kw = dict(share_prefill=share, return_logprobs=lp, returns_logprobs=lp, **SAMPLING[sampling])
        a = _run(model, tok, p_ids, p_mask, "generate", **kw)
        b = _run(model, tok, p_ids, p_mask, "tether", monkeypatch=monkeypatch, **kw)
        _assert_same(a, b, lp)
    ids = a[0][0]
    ended = (ids == tok.eos_token_id).any(1)
    assert ended.all() and ids.shape[1] < 12  # every row stopped at EOS before the limit


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("share", [True, False], ids=["share_prefill", "per_row_prefill"])
@pytest.mark.parametrize("padded", [True, False], ids=["left_padded", "no_padding"])
def test_tether_decode_equals_generate_on_a_qwen2_model(qwen2_padded, sampling, share, padded, monkeypatch):
    model, tok, p_ids, p_mask = qwen2_padded
    if not padded:  # the last 3 positions: every row full, generate drops the all-ones mask
        p_ids, p_mask = p_ids[:, -3:], p_mask[:, -3:]
        assert bool(p_mask.all())
    kw = dict(share_prefill=share, return_logprobs=True, returns_logprobs=True, **SAMPLING[sampling])
    a = _run(model, tok, p_ids, p_mask, "generate", **kw)
    b = _run(model, tok, p_ids, p_mask, "tether", monkeypatch=monkeypatch, **kw)
    _assert_same(a, b, True)
    assert a[0][0].shape[1] == 12


def test_tether_decode_equals_generate_under_bf16_autocast_and_several_eos_ids(monkeypatch):
    """actor.compute_dtype=bfloat16 (generation under autocast) and a second EOS id ('5', a common digit)."""
    model, tok = load_reference()
    five = tok.convert_tokens_to_ids("5")
    prompt = tok(["3,13=", "2,7="] * 16, return_tensors="pt", padding=True)
    kw = dict(
        compute_dtype="bfloat16",
        eos_token_ids=[five],
        temperature=0.9,
        top_p=1.0,
        top_k=0,
        return_logprobs=True,
        returns_logprobs=True,
    )
    a = _run(model, tok, prompt["input_ids"], prompt["attention_mask"], "generate", **kw)
    b = _run(model, tok, prompt["input_ids"], prompt["attention_mask"], "tether", monkeypatch=monkeypatch, **kw)
    _assert_same(a, b, True)
    assert int((a[0][0] == five).any(1).sum()) >= 3  # the second EOS id really ended some rows


def test_under_bf16_autocast_the_cache_holds_bf16_and_tether_attention_decodes_as_generate(monkeypatch):
    """Under autocast the loop's cache stores bf16 keys and values (attention casts them to bf16 anyway:
    bitwise the same values); with ``tether`` attention (its matmul path in bf16) too, the loop's tokens
    and log-probs are generate's, whose DynamicCache keeps the float32 keys rotary leaves."""
    import copy

    from tether.models import attention

    model, tok = load_reference()
    model = attention.set_attn_implementation(copy.deepcopy(model), "tether")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert hf_decode.cache_dtype(model, torch.device("cpu")) == torch.bfloat16
    assert hf_decode.cache_dtype(model, torch.device("cpu")) is None  # no autocast: the states' own dtype
    calls = []
    monkeypatch.setattr(
        attention, "matmul_attention", lambda *a, _f=attention.matmul_attention: calls.append(1) or _f(*a)
    )
    prompt = tok(["3,13=", "2,7=", "1,2="] * 8, return_tensors="pt", padding=True)
    kw = dict(
        compute_dtype="bfloat16", temperature=0.9, top_p=1.0, top_k=0, return_logprobs=True, returns_logprobs=True
    )
    a = _run(model, tok, prompt["input_ids"], prompt["attention_mask"], "generate", **kw)
    b = _run(model, tok, prompt["input_ids"], prompt["attention_mask"], "tether", **kw)
    _assert_same(a, b, True)
    assert calls  # the matmul path served the calls


def test_the_models_generation_config_applies_as_in_generate(qwen2_padded, monkeypatch):
    """Processors come from generate's own builder: a repetition penalty in the model's generation
    config (as Qwen2.5-Instruct ships) changes the tokens in both paths, identically."""
    model, tok, p_ids, p_mask = qwen2_padded
    kw = dict(temperature=1.0, top_p=1.0, top_k=0, do_sample=False)
    plain = _run(model, tok, p_ids, p_mask, "tether", monkeypatch=monkeypatch, **kw)[0]
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 3.0)
    a = _run(model, tok, p_ids, p_mask, "generate", **kw)
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 3.0)
    b = _run(model, tok, p_ids, p_mask, "tether", monkeypatch=monkeypatch, **kw)
    _assert_same(a, b, False)
    assert not torch.equal(a[0], plain)  # the penalty did something


@pytest.mark.kernels
def test_drop_finished_rows_keeps_every_token_bitwise(monkeypatch):
    """rollout.hf_drop_finished: rows that ended (EOS ids '5' and '1' make the ends ragged) stop being stepped;
    the tokens and the counted log-probs are still generate's, and the batch really shrank. Error model: the
    shrunk batch is another matmul shape, which MKL's AVX-512 kernels round row by row as the whole batch (bitwise
    here) and its SSE4.2 ones do not (issue 35): the log-probs are float32 reductions over n = 256 (the MLP's width)
    terms, compared at n·u = 1.5e-5 relative and absolute; the tokens stay bitwise (a draw would have to land within
    that of a boundary of the sampling distribution to move)."""
    from tether.rollout import response_mask_from_ids

    model, tok = load_reference()
    eos = [tok.convert_tokens_to_ids("5"), tok.convert_tokens_to_ids("1")]
    prompt = tok(["3,13=", "2,7=", "1,2=", "3,20="] * 16, return_tensors="pt", padding=True)
    shrunk = []
    real = hf_decode._compact

    def spy(cache, rows, unfinished, min_rows):
        out = real(cache, rows, unfinished, min_rows)
        shrunk.append(None if out is None else len(out))
        return out

    kw = dict(
        eos_token_ids=eos,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        return_logprobs=True,
        returns_logprobs=True,
        max_new_tokens=6,
    )
    a = _run(model, tok, prompt["input_ids"], prompt["attention_mask"], "generate", **kw)
    monkeypatch.setattr(hf_decode, "_compact", spy)
    b = _run(model, tok, prompt["input_ids"], prompt["attention_mask"], "tether", drop_finished=True, **kw)
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[1], b[1])
    m = response_mask_from_ids(a[0][0], [tok.eos_token_id, *eos]).bool()
    tol = reduction_tol(model.config.intermediate_size)
    # after EOS the log-probs are meaningless (zero logits when dropped)
    torch.testing.assert_close(b[0][1][m], a[0][1][m], rtol=tol, atol=tol)
    sizes = [s for s in shrunk if s is not None]
    assert sizes and min(sizes) >= 8 and sizes[0] < 64  # compacted, never below the floor


def test_compact_drops_finished_rows_from_the_cache_and_keeps_the_floor():
    cache = hf_decode.PreallocatedLayer(capacity=4)
    k = torch.arange(10 * 2, dtype=torch.float32).reshape(10, 1, 2, 1)  # (B=10, H=1, n=2, D=1)
    cache.update(k, -k)

    class Holder:  # the Cache interface _compact uses
        def batch_select_indices(self, idx):
            cache.batch_select_indices(idx)

    unfinished = torch.tensor([1, 0, 1, 0, 0, 0, 0, 0, 0, 0])
    assert hf_decode._compact(Holder(), None, torch.ones(10, dtype=torch.long), 3) is None  # nobody finished
    rows = hf_decode._compact(Holder(), None, unfinished, 3)
    assert rows.tolist() == [0, 1, 2]  # rows 0 and 2 alive, row 1 fills up to the floor of 3
    assert torch.equal(cache.keys, k[[0, 1, 2]]) and torch.equal(cache.values, -k[[0, 1, 2]])
    assert hf_decode._compact(Holder(), rows, unfinished, 3) is rows  # at the floor: nothing more to drop


def test_preallocated_layer_writes_in_place_and_returns_views():
    layer = hf_decode.PreallocatedLayer(capacity=5)
    a, b = torch.randn(2, 3, 3, 4), torch.randn(2, 3, 1, 4)  # (B, H, n, D)
    k1, _ = layer.update(a, a + 1)
    k2, v2 = layer.update(b, b + 1)
    assert torch.equal(k2, torch.cat([a, b], -2)) and torch.equal(v2, torch.cat([a + 1, b + 1], -2))
    assert k2.data_ptr() == k1.data_ptr() == layer.key_buf.data_ptr()  # one buffer, no copy per step
    assert layer.get_seq_length() == 4 and layer.get_mask_sizes(1) == (5, 0)
    layer.batch_select_indices(torch.tensor([1, 1, 0]))
    assert torch.equal(layer.keys, torch.cat([a, b], -2)[[1, 1, 0]]) and layer.key_buf.shape[2] == 5
    with pytest.raises(ValueError, match="capacity of 5"):
        layer.update(torch.randn(3, 3, 2, 4), torch.randn(3, 3, 2, 4))


def test_calls_the_loop_cannot_serve_exactly_fall_back_to_generate():
    model, tok = load_reference()
    base = dict(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=4,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id],
        use_cache=True,
    )
    assert hf_decode.plan(model, base) is not None
    for extra in (
        {"num_beams": 2},
        {"num_return_sequences": 2},
        {"stop_strings": ["7"]},
        {"max_time": 5.0},
        {"cache_implementation": "static"},
        {"output_scores": True},
    ):
        assert hf_decode.plan(model, {**base, **extra}) is None, extra
    # (share_prefill off: generate's beam search does not expand a cache passed in)
    engine = HFRolloutEngine(model, tok, share_prefill=False)
    prompt = tok(["3,13="] * 4, return_tensors="pt")
    calls = []
    real = model.generate
    model.generate = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        torch.manual_seed(0)
        greedy = SamplingParams(max_new_tokens=4, do_sample=False)
        out, _ = engine.generate_padded(prompt["input_ids"], prompt["attention_mask"], greedy, num_beams=2)
    finally:
        del model.generate
    assert calls and out.shape[0] == 4


def test_hf_decode_config_reaches_the_engine_and_bad_values_are_refused():
    from pydantic import ValidationError

    from tether.config import load_config
    from tether.workers import build as setup

    model, tok = load_reference()
    assert (
        load_config(None, []).rollout.hf_decode == "tether" and load_config(None, []).rollout.hf_drop_finished is True
    )
    for value in ("tether", "generate"):
        engine = setup.build_engine(
            load_config(None, ["rollout.engine=hf", f"rollout.hf_decode={value}", "rollout.hf_drop_finished=false"]),
            model,
            tok,
            None,
        )
        assert engine.hf_decode == value and engine.drop_finished is False
    with pytest.raises((ValidationError, ValueError), match="hf_decode"):
        load_config(None, ["rollout.hf_decode=fast"])
    with pytest.raises(ValueError, match="hf_decode must be 'tether' or 'generate', got 'fast'"):
        HFRolloutEngine(model, tok, hf_decode="fast")


@pytest.mark.parametrize("share", [True, False], ids=["share_prefill", "per_row_prefill"])
def test_tether_decode_equals_generate_on_a_gpt2_model(qwen2_padded, share, monkeypatch):
    """GPT-2 (learned absolute positions, its own attention code), built here from a config (the testing
    helpers build Qwen2 and Llama), left-padded prompts, T = 0.8, top_p = 0.9."""
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

    _, tok, p_ids, p_mask = qwen2_padded
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=len(tok),
            n_embd=64,
            n_layer=2,
            n_head=2,
            n_positions=256,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=None,
        )
        model = GPT2LMHeadModel(config).eval()
    model.generation_config = GenerationConfig(
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None
    )
    kw = dict(share_prefill=share, return_logprobs=True, returns_logprobs=True, temperature=0.8, top_p=0.9, top_k=0)
    a = _run(model, tok, p_ids, p_mask, "generate", **kw)
    b = _run(model, tok, p_ids, p_mask, "tether", monkeypatch=monkeypatch, **kw)
    _assert_same(a, b, True)


def test_inverse_cdf_sampler_draws_the_categorical_distribution():
    """rollout.hf_sampler=inverse_cdf: 200,000 draws from p = (0.5, 0, 0.2, 0.3, 0) (unnormalised ×4,
    so the total is not 1): frequencies within 5 standard errors (≤ 0.0056), zero-probability tokens
    (one of them last) never drawn, also with u pushed to just below 1."""
    p = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0]) * 4
    torch.manual_seed(0)
    draws = hf_decode.sample_inverse_cdf(p.expand(200_000, 5).contiguous())
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    want = (p / p.sum()).double()
    assert (freq - want).abs().max() < 5 * (want * (1 - want) / draws.numel()).sqrt().max()
    assert freq[1] == 0 and freq[4] == 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "rand_like", lambda t: torch.full_like(t, 1 - 2**-24))  # the largest u < 1
        assert hf_decode.sample_inverse_cdf(p[None]).tolist() == [3]  # the last token of positive probability


def test_inverse_cdf_sampler_refuses_rows_that_are_not_distributions():
    """As torch.multinomial does: a NaN or inf anywhere in a row (a diverged model), or a row of zeros,
    is an error naming the rows, never an index past the vocabulary (which an empty search returns)."""
    p = torch.tensor([[0.2, 0.8, 0.0], [0.0, 0.0, 0.0], [0.5, float("nan"), 0.5], [float("inf"), 0.0, 1.0]])
    with pytest.raises(RuntimeError, match=r"inf, nan or a row that sums to <= 0 \(rows \[1, 2, 3\]\)"):
        hf_decode.sample_inverse_cdf(p)
    assert hf_decode.sample_inverse_cdf(p[:1]).item() in (0, 1)


def test_inverse_cdf_sampler_needs_the_tether_loop():
    from tether.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout.hf_sampler=inverse_cdf needs rollout.hf_decode=tether"):
        load_config(None, ["rollout.hf_decode=generate", "rollout.hf_sampler=inverse_cdf"])
    assert load_config(None, ["rollout.hf_sampler=inverse_cdf"]).rollout.hf_sampler == "inverse_cdf"


def test_inverse_cdf_sampler_in_the_engine(qwen2_padded, monkeypatch):
    """The engine's inverse-CDF path samples valid tokens, respects suppress_tokens and top_k, is
    reproducible for a seed, and differs from generate's stream (another sampler)."""
    model, tok, p_ids, p_mask = qwen2_padded
    kw = dict(temperature=1.0, top_p=1.0, top_k=3)
    a = _run(model, tok, p_ids, p_mask, "tether", monkeypatch=monkeypatch, sampler="inverse_cdf", **kw)[0]
    b = _run(model, tok, p_ids, p_mask, "tether", monkeypatch=monkeypatch, sampler="inverse_cdf", **kw)[0]
    ref = _run(model, tok, p_ids, p_mask, "generate", **kw)[0]
    assert torch.equal(a, b) and not torch.equal(a, ref) and a.shape == ref.shape
    with torch.no_grad():  # the first token is among the top 3 of the prompt's next-token logits
        logits = model(input_ids=p_ids, attention_mask=p_mask).logits[:, -1]
    assert (logits.topk(3, -1).indices == a[:, :1]).any(-1).all()
    engine = HFRolloutEngine(model, tok, sampler="inverse_cdf")
    common = tok(["3 + 4 ="] * 8, return_tensors="pt")["input_ids"][0, :1].item()
    ids, _ = engine.generate_padded(p_ids, p_mask, SamplingParams(max_new_tokens=6), suppress_tokens=[common])
    assert (ids != common).all()
    from tether.config import load_config
    from tether.workers import build as setup

    assert load_config(None, []).rollout.hf_sampler == "multinomial"
    cfg = load_config(None, ["rollout.engine=hf", "rollout.hf_sampler=inverse_cdf"])
    assert setup.build_engine(cfg, model, tok, None).sampler == "inverse_cdf"
    with pytest.raises(ValueError, match="sampler must be 'multinomial' or 'inverse_cdf', got 'gumbel'"):
        HFRolloutEngine(model, tok, sampler="gumbel")
