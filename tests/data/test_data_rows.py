"""tether.data.rows: loading verl-schema datasets, line-numbered errors, splits."""

from __future__ import annotations

import json

import pytest

from tether.data import (
    DataError,
    PromptRow,
    load_rows,
    load_rows_report,
    rows_from_records,
    split_rows,
    write_records,
)

VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "What is 2+3?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "5"},
    "extra_info": {"split": "train", "index": 7},
}


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_verl_schema_jsonl(tmp_path):
    p = _write_lines(tmp_path / "d.jsonl", [json.dumps(VERL_ROW), json.dumps({"prompt": "plain text"})])
    rows = load_rows(p)
    assert len(rows) == 2
    r = rows[0]
    assert r == PromptRow(
        prompt=[{"role": "user", "content": "What is 2+3?"}],
        data_source="openai/gsm8k",
        ground_truth="5",
        extra_info={"split": "train", "index": 7, "ability": "math"},
        index=0,
    )
    assert rows[1].prompt == "plain text"
    assert rows[1].data_source == "unknown" and rows[1].ground_truth is None and rows[1].extra_info == {}
    assert rows[1].index == 1


def test_default_data_source_and_top_level_ground_truth(tmp_path):
    p = _write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "x", "ground_truth": 3})])
    (r,) = load_rows(p, default_data_source="tether/digitsum")
    assert r.data_source == "tether/digitsum" and r.ground_truth == 3


def test_json_list_and_parquet_round_trip(tmp_path):
    recs = [VERL_ROW, {**VERL_ROW, "reward_model": {"style": "rule", "ground_truth": "7"}}]
    for ext in ("json", "jsonl", "parquet"):
        p = tmp_path / f"d.{ext}"
        assert write_records(recs, p) == 2
        rows = load_rows(p)
        assert [r.ground_truth for r in rows] == ["5", "7"], ext
        assert rows[0].prompt == VERL_ROW["prompt"], ext
        assert rows[0].extra_info["index"] == 7, ext


def test_blank_lines_skipped_and_unicode_line_separator_in_string(tmp_path):
    rec = {"prompt": "a\u2028b"}  # U+2028 inside a JSON string must not split the line
    p = tmp_path / "d.jsonl"
    p.write_text(
        "\n" + json.dumps(rec, ensure_ascii=False) + "\n\n" + json.dumps({"prompt": "c"}) + "\r\n", encoding="utf-8"
    )
    rows = load_rows(p)
    assert [r.prompt for r in rows] == ["a\u2028b", "c"]
    assert [r.index for r in rows] == [0, 1]


def test_malformed_rows_fatal_with_line_numbers(tmp_path):
    # fmt: off
    lines = [
        json.dumps({"prompt": "ok"}),                                     # 1
        "",                                                                # 2 blank
        json.dumps({"question": "q", "answer": "#### 1"}),               # 3 missing prompt (raw gsm8k)
        json.dumps({"prompt": "   "}),                                    # 4 empty prompt
        json.dumps({"prompt": 5}),                                        # 5 wrong type
        json.dumps({"prompt": [{"role": "robot", "content": "x"}]}),     # 6 bad role
        "{not json",                                                       # 7 invalid JSON
        json.dumps({"prompt": [{"role": "user", "content": ["x"]}]}),    # 8 content not str
        json.dumps({"prompt": []}),                                       # 9 empty list
        json.dumps([1, 2]),                                               # 10 not an object
        json.dumps({"prompt": [{"content": "x"}]}),                      # 11 no role
        json.dumps({"prompt": "x", "extra_info": 3}),                    # 12 extra_info not dict
    ]
    # fmt: on
    p = _write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as ei:
        load_rows(p)
    e = ei.value
    msg = str(e)
    assert e.n_bad == 10
    assert str(p) in msg and "10 malformed row(s) of 11" in msg
    expect = {
        3: "missing prompt",
        4: "empty prompt",
        5: "expected a string or a list",
        6: "bad role 'robot'",
        7: "invalid JSON",
        8: "content is a list",
        9: "empty list",
        10: "expected a JSON object",
        11: "has no 'role'",
        12: "'extra_info' must be an object",
    }
    assert len(e.problems) == len(expect)
    for problem, (line, what) in zip(e.problems, expect.items(), strict=True):
        assert problem.startswith(f"{p}: line {line}: "), problem
        assert what in problem, problem
    assert "tether data gsm8k" in e.problems[0]  # hint for raw GSM8K files


def test_skip_invalid_drops_and_counts(tmp_path, caplog):
    p = _write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "a"}), "{bad", json.dumps({"prompt": "b"})])
    rep = load_rows_report(p, skip_invalid=True)
    assert [r.prompt for r in rep.rows] == ["a", "b"]
    assert [r.index for r in rep.rows] == [0, 2]  # index points back to the source record
    assert rep.n_skipped == 1 and "line 2" in rep.problems[0]
    with caplog.at_level("WARNING", logger="tether"):
        rows = load_rows(p, skip_invalid=True)
    assert len(rows) == 2
    # on the tether logger (printed "WARNING tether: ..."), not a Python warning with a source line
    assert [(r.name, r.levelname) for r in caplog.records] == [("tether", "WARNING")]
    assert (
        "d.jsonl: skipped 1 malformed row(s); first: " in caplog.text and "d.jsonl: line 2: invalid JSON" in caplog.text
    )


def test_error_list_is_capped(tmp_path):
    p = _write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": ""})] * 30 + [json.dumps({"prompt": "x"})])
    with pytest.raises(DataError, match=r"and 10 more") as ei:
        load_rows(p)
    assert ei.value.n_bad == 30 and len(ei.value.problems) == 20


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "empty dataset"),
        ("\n\n", "empty dataset"),
    ],
)
def test_empty_dataset(tmp_path, content, match):
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    with pytest.raises(DataError, match=match):
        load_rows(p)


def test_all_rows_invalid_with_skip_is_empty_dataset(tmp_path):
    p = _write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": ""}), json.dumps({"x": 1})])
    with pytest.raises(DataError, match="empty dataset: all 2 row"):
        load_rows(p, skip_invalid=True)


def test_file_problems(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="is a directory"):
        load_rows(tmp_path)
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(DataError, match="unsupported extension '.csv'"):
        load_rows(tmp_path / "d.csv")
    # a parquet file named .jsonl
    write_records([{"prompt": "x"}], tmp_path / "real.parquet")
    (tmp_path / "fake.jsonl").write_bytes((tmp_path / "real.parquet").read_bytes())
    with pytest.raises(DataError, match="not a UTF-8 text file.*looks like a parquet file"):
        load_rows(tmp_path / "fake.jsonl")
    # a text file named .parquet
    (tmp_path / "fake.parquet").write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_rows(tmp_path / "fake.parquet")
    # JSON Lines named .json
    _write_lines(tmp_path / "lines.json", [json.dumps({"prompt": "a"}), json.dumps({"prompt": "b"})])
    with pytest.raises(DataError, match="line 2 .*looks like JSON Lines"):
        load_rows(tmp_path / "lines.json")
    # a JSON list named .jsonl (pretty-printed over several lines)
    (tmp_path / "list.jsonl").write_text(json.dumps([{"prompt": "a"}], indent=2))
    with pytest.raises(DataError, match="looks like a JSON list"):
        load_rows(tmp_path / "list.jsonl")
    # .json holding an object
    (tmp_path / "obj.json").write_text(json.dumps({"prompt": "a"}))
    with pytest.raises(DataError, match="must be a JSON list"):
        load_rows(tmp_path / "obj.json")


def test_json_record_numbers(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([{"prompt": "a"}, {"prompt": ""}]))
    with pytest.raises(DataError, match=r"d\.json: record 2: empty prompt"):
        load_rows(p)


def test_offline_response_and_score_columns(tmp_path):
    recs = [
        {"prompt": "q1", "response": "r1", "score": 1},
        {"prompt": "q2", "response": "", "score": None},
    ]
    p = tmp_path / "off.jsonl"
    write_records(recs, p)
    rows = load_rows(p, response_key="response", score_key="score")
    assert [(r.response, r.score) for r in rows] == [("r1", 1.0), ("", None)]
    assert "response" not in rows[0].extra_info and "score" not in rows[0].extra_info
    write_records(
        [
            {"prompt": "q", "response": "r", "score": "high"},
            {"prompt": "q"},
            {"prompt": "q", "response": 3, "score": 1.0},
            {"prompt": "q", "response": "r"},
        ],
        p,
    )
    with pytest.raises(DataError) as ei:
        load_rows(p, response_key="response", score_key="score")
    probs = ei.value.problems
    assert "line 1: 'score' is 'high'" in probs[0]
    assert "line 2: missing response" in probs[1]
    assert "line 3: 'response' is a int" in probs[2]
    assert "line 4: missing score" in probs[3]


def test_nan_score_rejected():
    with pytest.raises(DataError, match="expected a finite number"):
        rows_from_records(
            [{"prompt": "q", "response": "r", "score": float("nan")}], "mem", response_key="response", score_key="score"
        )


def test_rows_from_records_names_source():
    rows = rows_from_records([VERL_ROW], "tether/digitsum")
    assert rows[0].ground_truth == "5"
    with pytest.raises(DataError, match=r"tether/digitsum: record 2: missing prompt"):
        rows_from_records([VERL_ROW, {"nope": 1}], "tether/digitsum")
    with pytest.raises(DataError, match="empty dataset"):
        rows_from_records([], "tether/digitsum")


def test_custom_prompt_key():
    rows = rows_from_records([{"messages": [{"role": "user", "content": "hi"}]}], "m", prompt_key="messages")
    assert rows[0].prompt == [{"role": "user", "content": "hi"}]


def test_rows_do_not_alias_input_messages():
    rec = {"prompt": [{"role": "user", "content": "hi"}]}
    (row,) = rows_from_records([rec], "m")
    rec["prompt"][0]["content"] = "changed"
    assert row.prompt[0]["content"] == "hi"


def test_split_rows_deterministic():
    rows = rows_from_records([{"prompt": f"p{i}"} for i in range(50)], "m")
    tr1, va1 = split_rows(rows, 0.2, seed=3)
    tr2, va2 = split_rows(rows, 0.2, seed=3)
    assert [r.index for r in va1] == [r.index for r in va2]
    assert len(va1) == 10 and len(tr1) == 40
    assert sorted(r.index for r in tr1 + va1) == list(range(50))
    assert [r.index for r in va1] == sorted(r.index for r in va1)  # input order kept
    _, va3 = split_rows(rows, 0.2, seed=4)
    assert [r.index for r in va3] != [r.index for r in va1]
    assert split_rows(rows, 0.0) == (rows, [])
    assert len(split_rows(rows[:3], 0.01)[1]) == 1  # at least one validation row
    assert len(split_rows(rows[:2], 0.9)[0]) == 1  # at least one training row
    with pytest.raises(ValueError):
        split_rows(rows, 1.0)
    with pytest.raises(ValueError):
        split_rows(rows[:1], 0.5)


def test_no_warning_when_nothing_skipped(tmp_path, caplog):
    p = _write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "a"})])
    with caplog.at_level("WARNING", logger="tether"):
        load_rows(p, skip_invalid=True)
    assert caplog.records == []
