"""tether.testing: the tiny tokenizer and models load through the standard Auto* classes."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
)

from tether.testing import (
    build_gsm8k_tokenizer,
    build_tiny_causal_lm,
    build_tiny_reward_model,
    synthetic_math_texts,
)


def test_tokenizer_chat_template_and_specials(chat_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    assert len(tok) == 512
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert (tok.pad_token_id, tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id) == (0, 1, 2)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Natalia sold 48 clips."}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nNatalia sold 48 clips.<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE round trip
    assert tok.decode(tok("ünïcode €5")["input_ids"]) == "ünïcode €5"


def test_tokenizer_from_texts_without_shared_data(tmp_path):
    d = build_gsm8k_tokenizer(tmp_path / "t", vocab_size=300, texts=synthetic_math_texts(50))
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == 300 and tok.chat_template


def _check_lm(d, tok):
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.config.pad_token_id == tok.pad_token_id and model.config.eos_token_id == tok.eos_token_id
    gen = GenerationConfig.from_pretrained(d)
    assert gen.pad_token_id == tok.pad_token_id and gen.eos_token_id == tok.eos_token_id
    assert (d / "model.safetensors").is_file()
    enc = tok(["<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= enc["input_ids"].shape[1] + 4
    return model


def test_tiny_causal_lms(chat_tokenizer_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    q = _check_lm(build_tiny_causal_lm(tmp_path / "q", chat_tokenizer_dir, arch="qwen2"), tok)
    assert type(q).__name__ == "Qwen2ForCausalLM"
    ll = _check_lm(build_tiny_causal_lm(tmp_path / "l", chat_tokenizer_dir, arch="llama"), tok)
    assert type(ll).__name__ == "LlamaForCausalLM"
    # same seed, same weights; another seed, other weights
    q2 = AutoModelForCausalLM.from_pretrained(build_tiny_causal_lm(tmp_path / "q2", chat_tokenizer_dir))
    q3 = AutoModelForCausalLM.from_pretrained(build_tiny_causal_lm(tmp_path / "q3", chat_tokenizer_dir, seed=1))
    w = "model.embed_tokens.weight"
    assert torch.equal(q.state_dict()[w], q2.state_dict()[w])
    assert not torch.equal(q.state_dict()[w], q3.state_dict()[w])
    # the tokenizer travels with the model
    assert AutoTokenizer.from_pretrained(tmp_path / "q").chat_template == tok.chat_template


def test_tiny_reward_model(chat_tokenizer_dir, tmp_path):
    d = build_tiny_reward_model(tmp_path / "rm", chat_tokenizer_dir)
    rm = AutoModelForSequenceClassification.from_pretrained(d)
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == 0
    tok = AutoTokenizer.from_pretrained(d)
    enc = tok(["a b c", "a"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = rm(**enc).logits
    assert logits.shape == (2, 1)
    single = rm(**tok(["a"], return_tensors="pt")).logits
    assert torch.allclose(logits[1], single[0], atol=1e-5)  # padding does not change the score
