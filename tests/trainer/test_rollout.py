import torch

from tether.rollout import HFRolloutEngine, SamplingParams, response_mask_from_ids
from tether.tasks.sft import load_reference


def test_response_mask_counts_up_to_and_including_the_first_eos():
    ids = torch.tensor([[5, 6, 2, 0, 0], [2, 0, 0, 0, 0], [5, 6, 7, 8, 9], [5, 9, 6, 2, 2]])
    assert response_mask_from_ids(ids, 2).tolist() == [
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0],
    ]
    # several EOS ids (Qwen2.5 lists two in generation_config)
    assert response_mask_from_ids(ids, [2, 9]).tolist()[2:] == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_generation_stops_at_every_eos_id_of_the_model():
    torch.manual_seed(0)
    model, tok = load_reference()
    five = tok.convert_tokens_to_ids("5")
    engine = HFRolloutEngine(model, tok, eos_token_ids=[five])
    prompt = tok(["3,13="] * 256, return_tensors="pt")
    out, _ = engine.generate_padded(prompt["input_ids"], prompt["attention_mask"], SamplingParams(max_new_tokens=4))
    rows_with_five = 0
    for row in out.tolist():
        if five in row:
            rows_with_five += 1
            after = row[row.index(five) + 1 :]
            assert all(t == tok.pad_token_id for t in after), row
    assert rows_with_five > 20  # '5' is a common digit: the secondary EOS really was sampled and stopped generation


def test_full_kl_takes_ref_logprobs_from_the_same_reference_pass(tmp_path):
    from tether.algos import kl_full
    from tether.config import load_config
    from tether.models import response_logprobs
    from tether.trainer import Trainer

    cfg = load_config(
        None,
        [
            "kl.estimator=full",
            "trainer.progress=false",
            "trainer.val_freq=0",
            "data.batch_size=4",
            "rollout.n=4",
            f"trainer.output_dir={tmp_path / 'run'}",
            "data.embedded_train_size=8",
            "trainer.total_steps=1",
        ],
    )
    t = Trainer(cfg)
    batch = t.rollout()
    t.compute_logprobs(batch)
    separate = t.roles.ref.compute_logprobs(batch)  # the reference's own pass
    m = batch.response_mask.bool()
    assert torch.allclose(batch.ref_logprobs[m], separate[m], atol=1e-6)
    # and the exact KL matches one computed from the two models' logits directly
    ids, mask = batch.input_ids, batch.attention_mask
    T = batch.response_ids.shape[1]
    with torch.no_grad():
        la = response_logprobs(t.roles.actor.model, ids, mask, T, return_logits=True)[2]
        lr = response_logprobs(t.roles.ref.model, ids, mask, T, return_logits=True)[2]
    assert torch.allclose(batch.extra["kl_full"][m], kl_full(la, lr)[m], atol=1e-6)
    assert float(batch.extra["kl_full"][m].abs().max()) < 1e-6  # the actor starts as the reference: KL 0


def _digitsum_prompts(tok, n: int):
    prompt = tok(["3,13=", "2,7=", "1,2=", "3,20="] * (n // 4), return_tensors="pt", padding=True)
    return prompt["input_ids"], prompt["attention_mask"]


def test_hf_sampled_logprobs_equal_the_trainers_forward():
    """rollout logprobs (actor.old_logprobs_source=rollout) from generate's own KV-cache passes equal
    log_softmax(logits / T) of a full forward over prompt + response, at T = 0.7, within 1e-5 nats;
    and asking for them leaves the sampled tokens unchanged."""
    from tether.models import response_logprobs

    model, tok = load_reference()
    engine = HFRolloutEngine(model, tok)
    params = SamplingParams(temperature=0.7, max_new_tokens=4)
    p_ids, p_mask = _digitsum_prompts(tok, 64)
    torch.manual_seed(0)
    ids, lp = engine.generate_padded(p_ids, p_mask, params.override(logprobs=True))
    torch.manual_seed(0)
    assert torch.equal(engine.generate_padded(p_ids, p_mask, params)[0], ids)  # the recorder does not touch sampling
    mask = response_mask_from_ids(ids, tok.eos_token_id)
    full = torch.cat([p_mask, mask], 1)
    with torch.no_grad():
        want, _, _ = response_logprobs(model, torch.cat([p_ids, ids], 1), full, ids.shape[1], temperature=0.7)
    m = mask.bool()
    assert lp.shape == ids.shape and lp.dtype == torch.float32
    diff = (lp - want)[m].abs()
    print(
        f"HF generate vs the trainer's forward, sampled-token log-probs (T=0.7, fp32): mean {diff.mean():.1e}, max "
        f"{diff.max():.1e} nats"
    )
    assert float(diff.max()) < 5e-5  # measured 9.5e-6: incremental KV-cache passes against one full forward
    assert float(lp[m].min()) < -0.5  # sampled tokens of real uncertainty: the comparison means something


def test_hf_sampled_logprobs_of_a_greedy_or_suppressed_step():
    """Greedy decoding reports log_softmax at temperature 1; a token suppressed by a processor
    before the recorder (suppress_tokens) is never sampled, and the others' log-probs renormalise."""
    model, tok = load_reference()
    engine = HFRolloutEngine(model, tok)
    params = SamplingParams(temperature=0.5, max_new_tokens=3, do_sample=False, logprobs=True)
    p_ids, p_mask = _digitsum_prompts(tok, 4)
    ids, lp = engine.generate_padded(p_ids, p_mask, params)
    with torch.no_grad():
        logits = model(input_ids=p_ids, attention_mask=p_mask).logits[:, -1].float()  # (B, V) the first step
    first = torch.log_softmax(logits, -1).gather(-1, ids[:, :1]).squeeze(-1)
    assert torch.allclose(lp[:, 0], first, atol=1e-5)
    assert torch.equal(ids[:, 0], logits.argmax(-1))
    eos = tok.eos_token_id
    ids, lp = engine.generate_padded(p_ids, p_mask, params, suppress_tokens=[eos])
    assert (ids != eos).all() and ids.shape[1] == 3
    assert (lp <= 0).all() and torch.isfinite(lp).all()


def test_hf_generate_runs_in_inference_mode_but_returns_a_normal_tensor():
    """generate runs under torch.inference_mode; its output is cloned out of it, so the trainer's
    update can embed it in an autograd graph (an inference tensor would raise there)."""
    from tether.models import response_logprobs

    model, tok = load_reference()
    engine = HFRolloutEngine(model, tok)
    p_ids, p_mask = _digitsum_prompts(tok, 8)
    ids, _ = engine.generate_padded(p_ids, p_mask, SamplingParams(max_new_tokens=4))
    assert not ids.is_inference()
    lp, _, _ = response_logprobs(
        model, torch.cat([p_ids, ids], 1), torch.cat([p_mask, torch.ones_like(ids)], 1), ids.shape[1]
    )
    lp.sum().backward()
    assert model.get_input_embeddings().weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_inference_mode_and_no_grad_sample_the_same_tokens():
    model, tok = load_reference()
    engine = HFRolloutEngine(model, tok)
    params = SamplingParams(max_new_tokens=4)
    p_ids, p_mask = _digitsum_prompts(tok, 64)
    torch.manual_seed(3)
    a, _ = engine.generate_padded(p_ids, p_mask, params)
    engine.grad_mode = "no_grad"
    torch.manual_seed(3)
    assert torch.equal(engine.generate_padded(p_ids, p_mask, params)[0], a)


def test_shared_prefill_samples_the_same_tokens_as_one_prefill_per_row():
    """A GRPO batch repeats each prompt G times: the engine prefills each distinct prompt once and
    copies its KV cache to the group (runs of unequal length and a lone row included); for a fixed
    seed the sampled tokens and their log-probs are those of the plain per-row prefill."""
    model, tok = load_reference()
    texts = ["3,13="] * 5 + ["2,7="] + ["1,2="] * 3 + ["3,20="] * 7
    prompt = tok(texts, return_tensors="pt", padding=True)
    engine = HFRolloutEngine(model, tok)
    shared = engine._shared_prefill(prompt["input_ids"], prompt["attention_mask"])
    assert shared is not None and shared[1].get_seq_length() == prompt["input_ids"].shape[1] - 1
    out = {}
    for share in (True, False):
        engine.share_prefill = share
        torch.manual_seed(5)
        params = SamplingParams(temperature=0.9, max_new_tokens=4, logprobs=True)
        out[share] = engine.generate_padded(prompt["input_ids"], prompt["attention_mask"], params)
    assert torch.equal(out[True][0], out[False][0])
    # the cache of a smaller batch: last bits (4e-6 measured)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-5, rtol=0)
    # no two equal rows: plain
    assert engine._shared_prefill(prompt["input_ids"][4:7], prompt["attention_mask"][4:7]) is None


def test_shared_prefill_with_left_padding_on_a_qwen2_model(qwen2_padded):
    """Prompts of different lengths (left padding inside the shared prefill), a Qwen2 model with
    sharper logits than the digit-sum reference, 12 new tokens: identical tokens either way."""
    model, tok, p_ids, p_mask = qwen2_padded
    engine = HFRolloutEngine(model, tok)
    out = {}
    for share in (True, False):
        engine.share_prefill = share
        torch.manual_seed(1)
        out[share], _ = engine.generate_padded(p_ids, p_mask, SamplingParams(max_new_tokens=12))
    assert torch.equal(out[True], out[False]) and out[True].shape[1] >= 6


def test_share_prefill_config_reaches_the_engine(tmp_path):
    from tether.config import load_config
    from tether.workers import build as setup

    model, tok = load_reference()
    for value in (True, False):
        cfg = load_config(None, [f"rollout.share_prefill={str(value).lower()}"])
        assert setup.build_engine(cfg, model, tok, None).share_prefill is value
    assert load_config(None, []).rollout.share_prefill is True
