"""Offline rollout (rollout.mode=offline): whole prompt groups, the dataset's responses as token ids,
EOS and truncation, and generation on demand (validation, tether eval) in an offline run."""

from __future__ import annotations

import random

import pytest
import torch

from tether.config import DataConfig
from tether.data import rows_from_records
from tether.data.loading import prepare_prompts
from tether.models import load_causal_lm, load_tokenizer
from tether.rollout import HFRolloutEngine, SamplingParams
from tether.rollout.runner import RolloutRunner
from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts
from tether.workers.build import generation_eos_ids

# prompt -> responses; the rows are interleaved so that no group is contiguous in the file
GROUPS = {
    "Ann has 3 apples and buys 4 more. How many?": ["3 + 4 = 7\n#### 7", "#### 8", "It is 7."],
    "Ben has 10 eggs and eats 2. How many are left?": ["10 - 2 = 8\n#### 8"],
    "Cara reads 5 books a week. How many in 3 weeks?": ["5 * 3 = 15\n#### 15", ""],
    "Dev has 6 coins. He finds 6 more. How many now?": ["#### 12", "6 + 6 = 12 #### 12", "#### 13", "12"],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline")
    tok = build_gsm8k_tokenizer(root / "tok", texts=synthetic_math_texts(200))
    return build_tiny_causal_lm(root / "model", tok, arch="qwen2", seed=1)


@pytest.fixture(scope="module")
def setup(model_dir):
    records = [
        {
            "prompt": [{"role": "user", "content": p}],
            "data_source": "openai/gsm8k",
            "response": r,
            "score": float(i == 0),
        }
        for p, rs in GROUPS.items()
        for i, r in enumerate(rs)
    ]
    random.Random(0).shuffle(records)
    rows = rows_from_records(records, "test", response_key="response", score_key="score")
    tok = load_tokenizer(model_dir)
    prompts = prepare_prompts(rows, tok, DataConfig(train_files="x.jsonl"), "data.train_files")
    return tok, prompts


def _runner(tok, model=None, max_new_tokens=64, eos_ids=None):
    engine = None
    if model is not None:
        engine = HFRolloutEngine(model, tok)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return RolloutRunner(engine, tok, torch.device("cpu"), params=params, mode="offline", eos_token_ids=eos_ids)


def test_offline_batch_takes_whole_groups(setup):
    tok, prompts = setup
    runner = _runner(tok)
    rng = random.Random(1)
    for _ in range(20):
        idx = rng.sample(range(len(prompts)), 3)
        batch = runner.rollout(prompts, idx, n=8)
        sampled = list(dict.fromkeys(prompts.texts[i] for i in idx))  # distinct prompts, first-seen order
        expected_sizes = [sum(t == s for t in prompts.texts) for s in sampled]
        assert batch.group_ids.tolist() == [g for g, size in enumerate(expected_sizes) for _ in range(size)]
        assert [batch.prompts[j] for j in range(len(batch))] == [
            s for s, size in zip(sampled, expected_sizes, strict=True) for _ in range(size)
        ]
        # every response of every sampled prompt, once
        for s in sampled:
            got = sorted(batch.rows[j].response for j in range(len(batch)) if batch.prompts[j] == s)
            want = sorted(prompts.rows[i].response for i in range(len(prompts)) if prompts.texts[i] == s)
            assert got == want


def test_offline_tokens_eos_and_truncation(setup):
    tok, prompts = setup
    eos, pad = tok.eos_token_id, tok.pad_token_id
    lengths = {r.response: len(tok(r.response, add_special_tokens=False)["input_ids"]) for r in prompts.rows}
    limit = 5
    assert any(n >= limit for n in lengths.values()) and any(n < limit for n in lengths.values())
    batch = _runner(tok, max_new_tokens=limit).rollout(prompts, list(range(len(prompts))), n=1)
    for j, row in enumerate(batch.rows):
        ids, m = batch.response_ids[j].tolist(), batch.response_mask[j].tolist()
        want = tok(row.response, add_special_tokens=False)["input_ids"]
        if len(want) < limit:  # ended: the text's tokens then EOS, counted; padding after it
            assert ids[: len(want) + 1] == [*want, eos] and sum(m) == len(want) + 1
            assert all(t == pad for t in ids[len(want) + 1 :])
        else:  # cut at the limit like a generation that hit max_new_tokens: no EOS
            assert ids[:limit] == want[:limit] and sum(m) == limit and eos not in ids
    assert "" in [r.response for r in batch.rows]  # an empty response is a lone EOS
    j = [r.response for r in batch.rows].index("")
    assert batch.response_mask[j].sum() == 1 and batch.response_ids[j, 0] == eos and batch.responses[j] == ""


def test_extra_eos_ids_end_the_response(setup):
    tok, prompts = setup
    # a model whose generation_config has two EOS ids (as Qwen2.5-Instruct: <|im_end|>, <|endoftext|>)
    model = type("M", (), {"generation_config": type("G", (), {"eos_token_id": [2, 0]})()})()
    assert generation_eos_ids(model) == [2, 0]
    runner = _runner(tok, eos_ids=generation_eos_ids(model))
    ids = torch.tensor([[5, 6, 0, 7, 8, 2], [5, 2, 0, 0, 0, 0], [5, 6, 7, 8, 9, 10]])
    batch = runner.restore(prompts, [0, 1, 2], *_prompt(prompts, tok, 3), ids, torch.arange(3))
    assert batch.response_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert batch.finish_reasons == ["eos", "eos", "length"] and batch.truncated.tolist() == [False, False, True]
    assert _runner(tok).eos_token_ids == [tok.eos_token_id]


def _prompt(prompts, tok, n):
    from tether.data.loading import collate_prompts

    return collate_prompts([prompts.ids[i] for i in range(n)], tok.pad_token_id, "cpu")


def test_online_mode_override_generates_in_an_offline_run(setup, model_dir):
    tok, prompts = setup
    torch.manual_seed(0)
    runner = _runner(tok, model=load_causal_lm(model_dir))
    batch = runner.rollout(prompts, [0, 1], n=3, mode="online", max_new_tokens=6)
    assert len(batch) == 6 and batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.prompts == [prompts.texts[0]] * 3 + [prompts.texts[1]] * 3  # no group expansion
    assert batch.response_ids.shape[1] <= 6  # the call's max_new_tokens, not the dataset's responses
    assert int(batch.response_mask.sum(-1).min()) >= 1


# ---------------------------------------------------------------- data.filter, data.overlong_responses


def _offline_rows(pairs):
    records = [{"prompt": p, "data_source": "openai/gsm8k", "response": r, "score": s} for p, r, s in pairs]
    return rows_from_records(records, "test", response_key="response", score_key="score")


def test_filter_by_score_range_empty_and_duplicates_counts_each_reason():
    from tether.data.offline import filter_offline_rows

    rows = _offline_rows(
        [
            ("q1", "a", 1.0),
            ("q1", "a", 1.0),
            ("q1", "  ", 1.0),
            ("q2", "b", -3.0),
            ("q2", "c", None),
            ("q2", "b", 0.5),
            ("q3", "a", 2.5),
        ]
    )
    kept, c = filter_offline_rows(rows, score_min=0.0, score_max=2.0, drop_duplicates=True)
    assert [(r.prompt, r.response) for r in kept] == [("q1", "a"), ("q2", "b")]
    # scores -3, None, 2.5; "  "; q1/a again
    assert (c.total, c.score, c.empty, c.duplicate, c.dropped) == (7, 3, 1, 1, 5)
    assert c.first == {"duplicate": 1, "empty": 2, "score": 3}
    assert (
        c.describe((0.0, 2.0))
        == "3 with a score missing or outside [0, 2], 1 empty response(s), 1 duplicate (prompt, response) pair(s)"
    )
    kept, c = filter_offline_rows(rows)  # defaults: only empty responses go
    assert len(kept) == 6 and (c.score, c.empty, c.duplicate) == (0, 1, 0)
    kept, c = filter_offline_rows(rows, drop_empty=False)
    assert len(kept) == 7 and c.describe((None, None)) == "nothing"


@pytest.mark.parametrize("mode", ["drop", "truncate"])
def test_overlong_responses_drop_or_truncate_with_a_count(model_dir, caplog, mode):
    from tether.data.loading import prepare_offline_rows
    from tether.data.offline import overlong_responses

    tok = load_tokenizer(model_dir)
    long = " ".join(["7 + 7 = 14"] * 20)
    n_long = len(tok(long, add_special_tokens=False)["input_ids"])
    limit = len(tok("12 #### 12", add_special_tokens=False)["input_ids"]) + 1  # the longest short one fits with its EOS
    assert n_long >= limit
    rows = _offline_rows([("q1", "#### 7", 1.0), ("q1", long, 1.0), ("q2", "12 #### 12", 1.0)])
    assert overlong_responses(rows, tok, limit) == [(1, n_long)]
    assert overlong_responses(rows, tok, limit - 1) == [(1, n_long), (2, limit - 1)]  # no room left for the EOS
    out = prepare_offline_rows(rows, tok, DataConfig(train_files="x.jsonl", overlong_responses=mode), limit)
    msg = (
        f"1 of 3 offline response(s) do not fit rollout.max_new_tokens={limit} with their EOS: record 2 ({n_long} "
        "tokens)"
    )
    assert msg in caplog.text
    if mode == "drop":
        assert [r.response for r in out] == ["#### 7", "12 #### 12"] and "data.overlong_responses=drop" in caplog.text
    else:
        assert [r.response for r in out] == ["#### 7", long, "12 #### 12"] and "cut there without an EOS" in caplog.text


def test_overlong_responses_error_and_nothing_left(model_dir):
    from tether.config import ConfigError
    from tether.data.loading import prepare_offline_rows

    tok = load_tokenizer(model_dir)
    rows = _offline_rows([("q1", "#### 7 and more words here", 1.0), ("q1", "", 0.0)])
    with pytest.raises(
        ConfigError,
        match=r"1 of 1 offline response\(s\) do not fit rollout.max_new_tokens=2 .*record 1 "
        r".*data.overlong_responses=drop",
    ):
        prepare_offline_rows(rows, tok, DataConfig(train_files="x.jsonl", overlong_responses="error"), 2)
    with pytest.raises(
        ConfigError, match=r"would leave 0 of 1 rows, more than data.max_dropped_frac=0.5 of the data gone"
    ):
        prepare_offline_rows(rows, tok, DataConfig(train_files="x.jsonl"), 2)
    with pytest.raises(ConfigError, match="no offline row left of 2 after data.filter and data.overlong_responses"):
        prepare_offline_rows(rows, tok, DataConfig(train_files="x.jsonl", max_dropped_frac=1.0), 2)


def test_a_length_limit_that_drops_most_of_the_data_is_refused(model_dir, caplog):
    """Issue 24, item 12: a rollout.max_new_tokens shorter than the responses dropped 99.96% of the rows with one
    warning."""
    from tether.config import ConfigError
    from tether.data.loading import prepare_offline_rows

    tok = load_tokenizer(model_dir)
    long = " ".join(["7 + 7 = 14"] * 5)
    rows = _offline_rows([("q1", long, 1.0), ("q1", long, 0.0), ("q2", long, 1.0), ("q2", "#### 7", 1.0)])
    with pytest.raises(
        ConfigError,
        match=r"3 of 4 offline response\(s\) do not fit rollout.max_new_tokens=5 .*would leave 1 of 4 rows, more than "
        r"data.max_dropped_frac=0.5 of the data gone; raise rollout.max_new_tokens",
    ):
        prepare_offline_rows(rows, tok, DataConfig(train_files="x.jsonl"), 5)
    out = prepare_offline_rows(rows, tok, DataConfig(train_files="x.jsonl", max_dropped_frac=0.75), 5)
    assert [r.response for r in out] == ["#### 7"] and "dropped: a whole response's label" in caplog.text


def test_filter_config_is_checked_before_anything_loads():
    from tether.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"data.filter.score_min \(1.0\) must not exceed data.filter.score_max \(0.0\)"
    ):
        load_config(None, ["data.filter.score_min=1", "data.filter.score_max=0"])
    with pytest.raises(
        ConfigError, match="data.filter.score_min/score_max filter on the dataset's scores: set data.score_key"
    ):
        load_config(None, ["rollout.mode=offline", "data.response_key=response", "data.filter.score_min=0.5"])
    with pytest.raises(ConfigError, match="overlong_responses"):
        load_config(None, ["data.overlong_responses=cut"])
