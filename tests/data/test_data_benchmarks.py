"""tether data aime|gpqa|math500: rows written by hand in the public sets' layouts → verl schema."""

from __future__ import annotations

import csv
import json

import pytest

from tether.cli import main
from tether.data import DataError, load_rows, write_records
from tether.data.benchmarks import TEMPLATES, convert_aime, convert_gpqa, convert_math500, gpqa_options
from tether.rewards import get_reward_function

GPQA_FIELDS = [
    "Record ID",
    "Question",
    "Correct Answer",
    "Incorrect Answer 1",
    "Incorrect Answer 2",
    "Incorrect Answer 3",
    "Subdomain",
]


def _gpqa_csv(path, rows):
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=GPQA_FIELDS)
        w.writeheader()
        w.writerows(rows)
    return path


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_aime_layouts(tmp_path):
    src = tmp_path / "aime.jsonl"
    write_records(
        [
            {"id": 60, "problem": "Find $m+n$.", "answer": "033", "url": "https://x"},  # AI-MO / HuggingFaceH4 layout
            {"ID": "2024-I-2", "Problem": "How many?", "Solution": "...", "Answer": 25},  # Maxwell-Jia layout
            {"question": "Compute N.", "answer": " 204 "},  # opencompass layout
        ],
        src,
    )
    out = tmp_path / "out.jsonl"
    assert convert_aime(src, out) == 3
    rows = _read(out)
    assert rows[0]["prompt"] == [
        {
            "role": "user",
            "content": "Find $m+n$. Let's think step by step and output the final answer within \\boxed{}.",
        }
    ]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["33", "25", "204"]
    assert {r["data_source"] for r in rows} == {"aime"} and rows[0]["extra_info"]["id"] == 60
    fn = get_reward_function(rows[0]["data_source"])
    assert fn("so \\boxed{033}", rows[0]["reward_model"]["ground_truth"]) == 1.0
    assert len(load_rows(out)) == 3  # loads as training / eval data


def test_aime_bad_rows_are_named(tmp_path):
    src = tmp_path / "aime.jsonl"
    write_records(
        [
            {"problem": "ok", "answer": 1},
            {"problem": "x", "answer": "3.5"},
            {"answer": 3},
            {"problem": "y", "answer": 1000},
        ],
        src,
    )
    with pytest.raises(DataError) as e:
        convert_aime(src, tmp_path / "o.jsonl")
    msg = str(e.value)
    assert (
        "3 malformed" in msg
        and "line 2" in msg
        and "3.5" in msg
        and "line 3: no 'problem'" in msg
        and "outside 0..999" in msg
    )


def test_malformed_json_line_is_named_as_invalid_json(tmp_path):
    # Regression: the converters printed the placeholder's class name ("got _BadLine").
    src = tmp_path / "aime.jsonl"
    src.write_text('{"problem": "ok", "answer": 1}\n{"problem": "x", "answer": \n[1, 2]\n')
    with pytest.raises(DataError) as e:
        convert_aime(src, tmp_path / "o.jsonl")
    msg = str(e.value)
    assert f"{src}: line 2: invalid JSON (Expecting value at column 28)" in msg
    assert f"{src}: line 3: expected a JSON object, got list" in msg
    assert "_BadLine" not in msg


def test_math500_layout_and_solution_fallback(tmp_path):
    src = tmp_path / "math500.jsonl"
    write_records(
        [
            {
                "problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?",
                "solution": "... $\\boxed{\\frac34}$",
                "answer": "\\frac{3}{4}",
                "subject": "Algebra",
                "level": 1,
                "unique_id": "test/algebra/1.json",
            },
            {"problem": "Simplify.", "solution": "It is $\\boxed{\\sqrt{2}}$."},
        ],
        src,
    )
    out = tmp_path / "out.parquet"
    assert convert_math500(src, out) == 2
    rows = load_rows(out)
    assert [r.ground_truth for r in rows] == ["\\frac{3}{4}", "\\sqrt{2}"]
    assert rows[0].data_source == "HuggingFaceH4/MATH-500" and rows[0].extra_info["subject"] == "Algebra"
    assert rows[0].prompt[0]["content"].endswith("within \\boxed{}.")
    assert get_reward_function(rows[0].data_source)("$\\boxed{0.75}$", rows[0].ground_truth) == 1.0


def test_gpqa_shuffle_is_fixed_by_seed_and_question(tmp_path):
    row = {
        "Record ID": "rec1",
        "Question": "Which energy?",
        "Correct Answer": " 4.2 eV\n",
        "Incorrect Answer 1": "2.1 eV",
        "Incorrect Answer 2": "10^-4 eV",
        "Incorrect Answer 3": "42 eV",
        "Subdomain": "Physics",
    }
    other = dict(row, **{"Record ID": "rec2", "Question": "Which other energy?"})
    src = _gpqa_csv(tmp_path / "gpqa_diamond.csv", [row, other])
    out = tmp_path / "out.jsonl"
    assert convert_gpqa(src, out) == 2
    rows = _read(out)
    for r in rows:
        choices, letter = r["extra_info"]["choices"], r["reward_model"]["ground_truth"]
        assert choices[letter] == "4.2 eV" and sorted(choices.values()) == sorted(
            ["4.2 eV", "2.1 eV", "10^-4 eV", "42 eV"]
        )
        content = r["prompt"][0]["content"]
        assert content.startswith("Answer the following multiple choice question.") and "'Answer: $LETTER'" in content
        assert content.endswith("\n".join(f"{k}) {v}" for k, v in choices.items()))
        assert get_reward_function(r["data_source"])(f"... Answer: {letter}", letter, r["extra_info"]) == 1.0
    # the same seed and question always give the same order, whatever else is in the file
    alone = _gpqa_csv(tmp_path / "one.csv", [other])
    convert_gpqa(alone, tmp_path / "one.jsonl")
    assert _read(tmp_path / "one.jsonl")[0]["extra_info"]["choices"] == rows[1]["extra_info"]["choices"]
    # the order is a permutation that depends on the seed: over 24 questions two seeds disagree somewhere
    letters = {
        seed: [gpqa_options(f"q{i}", "right", ["w1", "w2", "w3"], seed)[1] for i in range(24)] for seed in (0, 1)
    }
    assert letters[0] != letters[1] and set(letters[0]) == set("ABCD")
    assert letters[0] == [gpqa_options(f"q{i}", "right", ["w1", "w2", "w3"], 0)[1] for i in range(24)]


def test_gpqa_missing_fields_and_template_override(tmp_path):
    src = _gpqa_csv(
        tmp_path / "bad.csv",
        [
            {
                "Question": "Q?",
                "Correct Answer": "a",
                "Incorrect Answer 1": "b",
                "Incorrect Answer 2": "",
                "Incorrect Answer 3": "d",
            }
        ],
    )
    with pytest.raises(DataError, match=r"line 2: missing or empty field\(s\) \['Incorrect Answer 2'\]"):
        convert_gpqa(src, tmp_path / "o.jsonl")
    good = _gpqa_csv(
        tmp_path / "good.csv",
        [
            {
                "Question": "Q?",
                "Correct Answer": "a",
                "Incorrect Answer 1": "b",
                "Incorrect Answer 2": "c",
                "Incorrect Answer 3": "d",
            }
        ],
    )
    convert_gpqa(good, tmp_path / "t.jsonl", template="{question} | {A} | {B} | {C} | {D} \\boxed{}")
    content = _read(tmp_path / "t.jsonl")[0]["prompt"][0]["content"]
    parts = content.split(" | ")
    assert (
        parts[0] == "Q?"
        and parts[4].endswith(" \\boxed{}")
        and sorted([*parts[1:4], parts[4].split(" ")[0]]) == ["a", "b", "c", "d"]
    )
    with pytest.raises(DataError, match=r"needs the placeholder\(s\) \{D\}"):
        convert_gpqa(good, tmp_path / "t.jsonl", template="{question} {A} {B} {C}")


def test_cli_converters(tmp_path, capsys):
    src = tmp_path / "aime.jsonl"
    write_records([{"problem": "P", "answer": 7}], src)
    assert main(["data", "aime", str(src), str(tmp_path / "a.jsonl"), "--template", "Q: {problem}\nA:"]) == 0
    assert _read(tmp_path / "a.jsonl")[0]["prompt"][0]["content"] == "Q: P\nA:"
    m = tmp_path / "m.jsonl"
    write_records([{"problem": "P", "answer": "\\frac12"}], m)
    assert main(["data", "math500", str(m), str(tmp_path / "m_out.jsonl"), "--data-source", "math"]) == 0
    assert _read(tmp_path / "m_out.jsonl")[0]["data_source"] == "math"
    assert main(["data", "math500", str(tmp_path / "missing.jsonl"), str(tmp_path / "m.jsonl")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    g = _gpqa_csv(
        tmp_path / "g.csv",
        [
            {
                "Question": "Q?",
                "Correct Answer": "a",
                "Incorrect Answer 1": "b",
                "Incorrect Answer 2": "c",
                "Incorrect Answer 3": "d",
            }
        ],
    )
    assert main(["data", "gpqa", str(g), str(tmp_path / "g0.jsonl"), "--seed", "0"]) == 0
    assert main(["data", "gpqa", str(g), str(tmp_path / "g0b.jsonl")]) == 0
    assert _read(tmp_path / "g0.jsonl") == _read(tmp_path / "g0b.jsonl")
    assert TEMPLATES["gpqa"].count("{") == 5


def test_a_source_that_is_not_utf8_is_one_line_naming_the_file_and_byte_offset(tmp_path, capsys):
    """Regression: a GPQA csv saved as Latin-1 (a spreadsheet export) raised a UnicodeDecodeError
    traceback. Now a DataError worded as the training loader words a non-UTF-8 file, with the
    byte offset of the first bad byte, and through the CLI one line and exit 2."""
    row = {
        "Question": "Which café?",
        "Correct Answer": "a",
        "Incorrect Answer 1": "b",
        "Incorrect Answer 2": "c",
        "Incorrect Answer 3": "d",
    }
    src = tmp_path / "gpqa_latin1.csv"
    with src.open("w", newline="", encoding="latin-1") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        w.writeheader()
        w.writerow(row)
    offset = src.read_bytes().index(b"\xe9")  # é in Latin-1: one byte, not a valid UTF-8 sequence before "?"
    assert offset == 91  # the header line (80 characters + CRLF) and "Which caf"
    with pytest.raises(DataError) as e:
        convert_gpqa(src, tmp_path / "o.jsonl")
    assert str(e.value) == (
        f"{src}: not a UTF-8 text file, so not .csv: 'utf-8' codec can't decode byte 0xe9 in position 91: invalid "
        "continuation byte; re-save it as UTF-8"
    )
    assert "\n" not in str(e.value)
    # the same file as jsonl: the converters and the training loader say the same thing
    bad_jsonl = tmp_path / "aime_latin1.jsonl"
    bad_jsonl.write_bytes('{"problem": "Caf\u00e9 problem", "answer": 7}\n'.encode("latin-1"))
    with pytest.raises(DataError) as conv:
        convert_aime(bad_jsonl, tmp_path / "a.jsonl")
    with pytest.raises(DataError) as train:
        load_rows(bad_jsonl)
    assert (
        str(conv.value)
        == str(train.value)
        == (
            f"{bad_jsonl}: not a UTF-8 text file, so not .jsonl: 'utf-8' codec can't decode byte 0xe9 in position 16: "
            "invalid continuation byte"
        )
    )
    capsys.readouterr()
    out = tmp_path / "g.jsonl"
    assert main(["data", "gpqa", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"tether data: {src}: not a UTF-8 text file, so not .csv: 'utf-8' codec can't decode byte 0xe9 in position 91: "
        "invalid continuation byte; re-save it as UTF-8"
    ]
    assert not out.exists()


def test_gpqa_csv_with_a_byte_order_mark(tmp_path):
    """A csv saved as "UTF-8 with BOM" (Excel's UTF-8 export): the mark is not part of the first header."""
    src = tmp_path / "bom.csv"
    with src.open("w", newline="", encoding="utf-8-sig") as f:
        w = csv.DictWriter(
            f,
            fieldnames=["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"],
        )
        w.writeheader()
        w.writerow(
            {
                "Question": "Q?",
                "Correct Answer": "a",
                "Incorrect Answer 1": "b",
                "Incorrect Answer 2": "c",
                "Incorrect Answer 3": "d",
            }
        )
    assert src.read_bytes()[:3] == b"\xef\xbb\xbf"
    assert convert_gpqa(src, tmp_path / "o.jsonl") == 1
    assert _read(tmp_path / "o.jsonl")[0]["extra_info"]["question"] == "Q?"
