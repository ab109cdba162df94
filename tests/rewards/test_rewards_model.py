"""RewardManager with a reward model: the tiny Qwen2 sequence-classification model (no downloads)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from tether.data import PromptRow
from tether.rewards import RewardManager
from tether.rewards.model import RewardModelScorer
from tether.testing import build_gsm8k_tokenizer, build_tiny_reward_model


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_gsm8k_tokenizer(tmp_path_factory.mktemp("rm_tok"))


@pytest.fixture(scope="module")
def rm_dir(tok_dir, tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"), tok_dir)


def _rows(prompts):
    return [
        PromptRow(prompt=p, data_source="x", ground_truth=None, extra_info={}, index=i) for i, p in enumerate(prompts)
    ]


def _direct_scores(rm_dir, texts):
    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]


def test_reward_model_scores_match_direct_forward(rm_dir):
    prompts = ["Q: 2+3?\nA:", "Natalia sold 48 clips. How many?", "x"]
    responses = [" 5", " She sold 72 clips.\n#### 72", ""]
    m = RewardManager(reward_model=str(rm_dir), clip=(-100.0, 100.0), model_batch_size=2)
    res = m(_rows(prompts), prompts, responses)
    assert res.valid.all() and res.errors == []
    expected = _direct_scores(rm_dir, [p + r for p, r in zip(prompts, responses, strict=True)])
    assert res.raw_scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert res.scores.tolist() == pytest.approx(expected, abs=1e-5)


def test_reward_model_default_clip_is_2(rm_dir, tmp_path):
    m = RewardManager(reward_model=str(rm_dir))
    assert m.clip == (-2.0, 2.0)
    # scale the head so raw scores exceed the clip range
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    with torch.no_grad():
        model.score.weight.mul_(1000.0)
    big = tmp_path / "big_rm"
    model.save_pretrained(big)
    AutoTokenizer.from_pretrained(rm_dir).save_pretrained(big)
    prompts = ["a", "bb", "ccc", "dddd"]
    res = RewardManager(reward_model=str(big))(_rows(prompts), prompts, [" 1", " 2", " 3", " 4"])
    assert res.scores.abs().max().item() <= 2.0
    assert res.raw_scores.abs().max().item() > 2.0
    assert res.metrics["reward/clip_frac"] > 0


def test_reward_model_chat_template_for_message_prompts(rm_dir):
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    rows = [PromptRow(prompt=msgs, data_source="x", ground_truth=None, extra_info={}, index=0)]
    res = RewardManager(reward_model=str(rm_dir), clip=(-100.0, 100.0))(rows, ["ignored"], ["5"])
    text = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    assert res.raw_scores[0].item() == pytest.approx(_direct_scores(rm_dir, [text])[0], abs=1e-5)


def test_reward_model_left_truncation(rm_dir):
    s = RewardModelScorer(rm_dir, max_length=8)
    ids = s._encode(None, "word " * 50, " END")
    assert len(ids) == 8
    assert s.tokenizer.decode(ids).endswith(" END")
    (score,) = s.score([None], ["word " * 50], [" END"])
    assert math.isfinite(score)


def test_reward_model_bad_directories(rm_dir, tok_dir, tmp_path):
    with pytest.raises(ValueError, match="reward model directory not found"):
        RewardManager(reward_model=str(tmp_path / "nope"))
    # no tokenizer in the directory
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir)
    model.save_pretrained(tmp_path / "no_tok")
    with pytest.raises(ValueError, match="cannot load its tokenizer"):
        RewardManager(reward_model=str(tmp_path / "no_tok"))
    # a classifier with two labels is not a scalar reward model
    cfg = AutoConfig.from_pretrained(rm_dir)
    cfg.num_labels = 2
    two = tmp_path / "two"
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(two)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(two)
    with pytest.raises(
        ValueError,
        match=r"is a sequence classifier with num_labels=2 .*a reward model must be a sequence classifier with one "
        r"label",
    ):
        RewardManager(reward_model=str(two))


def test_a_causal_lm_is_named_as_such_not_as_num_labels_2(tok_dir, tmp_path):
    from tether.testing import build_tiny_causal_lm

    lm = build_tiny_causal_lm(tmp_path / "lm", tok_dir)
    with pytest.raises(
        ValueError,
        match=r"is a causal language model \(config.json architectures: Qwen2ForCausalLM\); a reward model must be a "
        r"sequence classifier with one label",
    ) as e:
        RewardManager(reward_model=str(lm))
    assert "num_labels=2" not in str(e.value)
    # a classifier config over weights without the head (a causal LM's weights): the head would be random
    cfg = json.loads((lm / "config.json").read_text())
    cfg["architectures"], cfg["num_labels"], cfg["id2label"] = ["Qwen2ForSequenceClassification"], 1, {"0": "LABEL_0"}
    (lm / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError,
        match=r"its weights hold no classification head \(missing score.weight\): it would score "
        "with a randomly initialised head",
    ):
        RewardManager(reward_model=str(lm))


def test_a_head_size_mismatch_names_both_sizes(rm_dir, tmp_path):
    import shutil

    d = tmp_path / "mismatch"
    shutil.copytree(rm_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["id2label"], cfg["label2id"] = {"0": "bad", "1": "good"}, {"bad": 0, "good": 1}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError,
        match=r"config.json says num_labels=2 \(id2label has 2 entries\) but the weights hold score.weight of shape "
        r"\[1, 32\] \(1 label\(s\)\); a reward model must be",
    ) as e:
        RewardManager(reward_model=str(d))
    assert "look at the above report" not in str(e.value)


def test_reward_model_without_pad_token(tok_dir, tmp_path):
    # llama: its tokenizer class has no default pad token (Qwen2's defaults to <|endoftext|>)
    d = build_tiny_reward_model(tmp_path / "nopad", tok_dir, arch="llama")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    del tc["pad_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    assert AutoTokenizer.from_pretrained(d).pad_token is None
    # the config's pad_token_id is used when the tokenizer has none
    m = RewardManager(reward_model=str(d), clip=(-100.0, 100.0))
    assert m.scorer.tokenizer.pad_token == "<|endoftext|>"
    res = m(_rows(["a", "bbb"]), ["a", "bbb"], [" x", " y"])
    assert res.valid.all()
    cfg = json.loads((d / "config.json").read_text())
    cfg["pad_token_id"] = None
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has no pad token"):
        RewardManager(reward_model=str(d))
