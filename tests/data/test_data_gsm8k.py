"""tether.data.gsm8k: GSM8K → verl schema conversion, on hand-written rows and on the real files."""

from __future__ import annotations

import json

import pytest

from tether.data import (
    DEFAULT_INSTRUCTION_SUFFIX,
    DataError,
    convert_gsm8k,
    convert_gsm8k_solutions,
    gsm8k_final_answer,
    load_rows,
    read_records,
)


def _gsm(tmp_path, recs, name="train.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return p


def test_default_suffix_is_verls():
    assert DEFAULT_INSTRUCTION_SUFFIX == ' Let\'s think step by step and output the final answer after "####".'


def test_final_answer():
    assert gsm8k_final_answer("a\n#### 1,234") == "1234"
    assert gsm8k_final_answer("#### -5") == "-5"
    assert gsm8k_final_answer("x\nA: 18") == "18"
    assert gsm8k_final_answer("x\nA: 18", allow_a_colon=False) is None
    assert gsm8k_final_answer("#### 3\n#### 4") == "4"
    assert gsm8k_final_answer("no answer") is None


@pytest.mark.parametrize("ext", ["jsonl", "parquet", "json"])
def test_convert_small(tmp_path, ext):
    src = _gsm(
        tmp_path,
        [
            {"question": "Q1?", "answer": "1+1=<<1+1=2>>2\n#### 2"},
            {"question": "Q2?", "answer": "big\n#### 1,000"},
        ],
    )
    out = tmp_path / f"out.{ext}"
    assert convert_gsm8k(src, out) == 2
    recs = [r for _, r in read_records(out)]
    assert recs[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Q1?" + DEFAULT_INSTRUCTION_SUFFIX}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"split": "train", "index": 0, "answer": "1+1=<<1+1=2>>2\n#### 2", "question": "Q1?"},
    }
    rows = load_rows(out)
    assert [r.ground_truth for r in rows] == ["2", "1000"]
    assert rows[1].data_source == "openai/gsm8k"


def test_convert_custom_suffix_and_split(tmp_path):
    src = _gsm(tmp_path, [{"question": "Q?", "answer": "#### 3"}])
    convert_gsm8k(src, tmp_path / "o.jsonl", instruction_suffix="", split="test")
    (row,) = load_rows(tmp_path / "o.jsonl")
    assert row.prompt == [{"role": "user", "content": "Q?"}]
    assert row.extra_info["split"] == "test"


def test_convert_errors_name_lines(tmp_path):
    src = _gsm(
        tmp_path,
        [{"question": "Q?", "answer": "#### 3"}, {"question": "Q?"}, {"question": "Q?", "answer": "no final line"}],
    )
    with pytest.raises(DataError, match=r"line 2: missing or non-text field\(s\) \['answer'\]"):
        convert_gsm8k(src, tmp_path / "o.jsonl")
    src = _gsm(tmp_path, [{"question": "Q?", "answer": "#### 3"}, {"question": "Q?", "answer": "A: 4"}])
    with pytest.raises(DataError, match=r"line 2: 'answer' has no '#### <number>'"):
        convert_gsm8k(src, tmp_path / "o.jsonl")
    with pytest.raises(DataError, match="no such file"):
        convert_gsm8k(tmp_path / "missing.jsonl", tmp_path / "o.jsonl")
    ok = _gsm(tmp_path, [{"question": "Q", "answer": "#### 1"}], "ok.jsonl")
    with pytest.raises(DataError, match="unsupported extension"):
        convert_gsm8k(ok, tmp_path / "o.csv")


def test_convert_real_test_split(gsm8k_dir, tmp_path):
    out = tmp_path / "test.parquet"
    assert convert_gsm8k(gsm8k_dir / "test.jsonl", out) == 1319
    rows = load_rows(out)
    assert len(rows) == 1319
    assert all(r.data_source == "openai/gsm8k" for r in rows)
    assert rows[0].ground_truth == "18"  # Janet's ducks
    assert all(r.ground_truth.lstrip("-").isdigit() for r in rows)  # commas removed, integers


def test_convert_real_model_solutions(gsm8k_dir, tmp_path):
    out = tmp_path / "solutions.jsonl"
    assert convert_gsm8k_solutions(gsm8k_dir / "example_model_solutions.jsonl", out) == 5276
    rows = load_rows(out, response_key="response", score_key="score")
    assert len(rows) == 5276
    assert sum(r.score for r in rows) == 2001  # solutions labelled correct
    assert rows[0].extra_info["model"] == "6b_finetuning" and rows[0].ground_truth == "18"
    assert rows[0].response.endswith("A: 26") and rows[0].score == 0.0
