"""tether.rewards.math: GSM8K final-answer and MATH boxed-answer rewards on hand-written cases."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tether.rewards.math import (
    extract_gsm8k_answer,
    extract_last_boxed,
    gsm8k_compute_score,
    gsm8k_strict_compute_score,
    math_compute_score,
    math_is_equiv,
    normalize_math_answer,
    parse_number,
)
from tether.testing import find_gsm8k_dir

F = Fraction


# fmt: off
@pytest.mark.parametrize("text, expected", [
    ("#### 72", 72),
    ("so she makes 18\n#### 18", 18),
    ("####18", 18),
    ("A: 26", 26),
    ("work\nA: $1,000.00", 1000),
    ("The answer is 1000.", 1000),
    ("the answer is: 42", 42),
    ("The final answer is **-5**", -5),
    ("Final answer: 3.75", F(15, 4)),
    ("Answer: $5,600", 5600),
    ("The answer is $\\boxed{72}$.", 72),
    ("so \\boxed{1,000} dollars", 1000),
    ("\\boxed{\\$18}", 18),
    ("\\boxed{\\frac{3}{4}}", F(3, 4)),
    ("#### -3", -3),
    ("#### \u22123", -3),          # Unicode minus
    ("#### $-3", -3),
    ("#### 0.5", F(1, 2)),
    ("#### .5", F(1, 2)),
    ("#### 25%", 25),              # percent sign dropped, not divided by 100
    ("#### 3/4", F(3, 4)),
    ("#### 5\nA: 6", 6),           # the last marker wins
    ("A: 6\n#### 5", 5),
    ("The answer is 7.\nA: 8", 8),
    ("#### 5\nI hope this helps, 2 times", 5),  # a marker beats the last number
])
# fmt: on
def test_marked_answers(text, expected):
    assert extract_gsm8k_answer(text, "strict") == expected
    assert extract_gsm8k_answer(text, "flexible") == expected


# fmt: off
@pytest.mark.parametrize("text, flexible", [
    ("She has 3 + 4 = 7 apples", 7),
    ("<<48/2=24>>24 clips", 24),
    ("costs $5.50 each", F(11, 2)),
    ("in 16-3 days", 3),                 # '-' after a digit is an operator
    ("x=\u22127", -7),
    ("blah 3,4", 4),                      # commas not grouping by three separate numbers
    ("1,2345", 2345),
    ("It is 1,000,000.", 1000000),
    ("No answer at all.", None),
    ("", None),
    ("A: ten", None),                     # words are not numbers
    ("COVID19 cases", None),              # digits glued to letters are not numbers
    ("The answer is", None),
])
# fmt: on
def test_unmarked_text(text, flexible):
    assert extract_gsm8k_answer(text, "strict") is None
    assert extract_gsm8k_answer(text, "flexible") == flexible


@pytest.mark.parametrize(
    "solution, gt, score",
    [
        ("#### 1,000", "1000", 1.0),
        ("#### 1000", "1,000", 1.0),
        ("#### 1000.0", 1000, 1.0),
        ("#### $1000", 1000.0, 1.0),
        ("The answer is 1000.", "1000", 1.0),
        ("#### 1000.5", "1000", 0.0),
        ("#### -7", "-7", 1.0),
        ("#### 7", "-7", 0.0),
        ("#### 0.25", "0.250", 1.0),
        ("#### 18", " 18 ", 1.0),
        ("no answer here", "18", 0.0),
        ("", "18", 0.0),  # an empty response is scored (0.0), not an error
        ("I got 18", "18", 1.0),  # flexible: last number
    ],
)
def test_gsm8k_compute_score(solution, gt, score):
    assert gsm8k_compute_score(solution, gt) == score


def test_strict_vs_flexible_and_extra_info_override():
    assert gsm8k_strict_compute_score("I got 18", "18") == 0.0
    assert gsm8k_compute_score("I got 18", "18", method="strict") == 0.0
    assert gsm8k_compute_score("I got 18", "18", {"gsm8k_method": "strict"}) == 0.0
    assert gsm8k_strict_compute_score("#### 18", "18") == 1.0


def test_format_score_and_score():
    assert gsm8k_compute_score("#### 17", "18", format_score=0.1) == 0.1
    assert gsm8k_compute_score("nothing", "18", format_score=0.1) == 0.0
    assert gsm8k_compute_score("#### 18", "18", score=2.0) == 2.0


def test_bad_ground_truth_and_method():
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_compute_score("#### 1", "eighteen")
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_compute_score("#### 1", None)
    with pytest.raises(ValueError, match="method"):
        extract_gsm8k_answer("#### 1", "loose")


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1,000", 1000),
        ("$1000", 1000),
        ("1000.", 1000),
        ("1000.0", 1000),
        ("-3.5", F(-7, 2)),
        ("25%", 25),
        ("3/4", F(3, 4)),
        ("\\$5", 5),
        ("$-5", -5),
        ("-$5", -5),
        (7, 7),
        (0.1, F(1, 10)),
        (F(2, 3), F(2, 3)),
        ("1,00", None),
        ("abc", None),
        ("", None),
        ("1/0", None),
        (True, None),
        (None, None),
        (float("nan"), None),
        (float("inf"), None),
        ("1.5/2", None),
        ([1], None),
    ],
)
def test_parse_number(value, expected):
    assert parse_number(value) == expected


@given(st.integers(min_value=-(10**9), max_value=10**9))
def test_integer_formats_all_match(n):
    gt = str(n)
    commas = f"{n:,}"
    for sol in (
        f"#### {commas}",
        f"#### {n}.0",
        f"#### {n}.",
        f"A: {commas}",
        f"The answer is {n}.",
        f"\\boxed{{{n}}}",
        f"so {n}",
    ):
        assert gsm8k_compute_score(sol, gt) == 1.0, sol
    if n >= 0:
        assert gsm8k_compute_score(f"#### ${commas}", gt) == 1.0
    assert gsm8k_compute_score(f"#### {n + 1}", gt) == 0.0


def test_long_degenerate_response_is_fast():
    import time

    text = "1" * 20000 + " 1," * 5000 + "-" * 10000
    t = time.perf_counter()
    extract_gsm8k_answer(text)
    assert time.perf_counter() - t < 1.0


def test_gsm8k_reference_answers_score_one():
    """Every GSM8K test reference solution scores 1.0 against its own answer, in both modes."""
    d = find_gsm8k_dir(Path(__file__))
    if d is None:
        pytest.skip("GSM8K data not found at ../shared/data/gsm8k")
    from tether.data import gsm8k_final_answer

    for line in (d / "test.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        gt = gsm8k_final_answer(rec["answer"])
        assert gsm8k_strict_compute_score(rec["answer"], gt) == 1.0, rec["answer"][-80:]
        assert gsm8k_compute_score(rec["answer"], gt) == 1.0


# ------------------------------------------------------------------------------- MATH


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{5}", "5"),
        ("\\boxed{\\frac{a}{b^{2}}} then \\boxed{x^{\\{1\\}}}", "x^{\\{1\\}}"),  # last, nested braces
        ("\\boxed{\\sqrt{\\frac{1}{2}}}", "\\sqrt{\\frac{1}{2}}"),
        ("$\\boxed 7$", "7"),
        ("\\fbox{3}", "3"),
        ("\\boxed{3", None),  # unbalanced
        ("no box", None),
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


@pytest.mark.parametrize(
    "a, b, eq",
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
        ("\\tfrac12", "\\frac{1}{2}", True),
        ("\\frac{1}{2}", "0.5", True),
        ("1/2", "0.5", True),
        ("-\\frac{3}{4}", "-0.75", True),
        ("\\left( 3, 4 \\right)", "(3,4)", True),
        ("10.", "10", True),
        ("x = 5", "5", True),
        ("1,000", "1000", True),
        ("90^\\circ", "90", True),
        ("50\\%", "50", True),
        ("\\$5", "5", True),
        ("\\text{(B)}", "(B)", True),
        ("2\\sqrt{3}", "2 \\sqrt 3", True),
        ("\\!10", "10", True),
        ("(3,4)", "(4,3)", False),
        ("1,2", "12", False),
        ("\\frac{1}{3}", "0.33", False),
        ("x+1", "x+2", False),
    ],
)
def test_math_is_equiv(a, b, eq):
    assert math_is_equiv(a, b) is eq
    assert math_is_equiv(b, a) is eq


def test_normalize_math_answer():
    assert normalize_math_answer(" \\left[ 1 , 2 \\right) . ") == "[1,2)"
    assert normalize_math_answer(".5") == "0.5"


def test_math_compute_score():
    assert math_compute_score("Thus $\\boxed{\\dfrac{1}{2}}$.", "\\frac12") == 1.0
    assert math_compute_score("Thus $\\boxed{0.5}$.", "The answer is $\\boxed{\\frac{1}{2}}$.") == 1.0
    assert math_compute_score("Thus 1/2.", "\\frac12") == 0.0  # no boxed answer
    assert math_compute_score("\\boxed{2}", 2) == 1.0
    assert math_compute_score("\\boxed{3}", "2") == 0.0
    with pytest.raises(ValueError):
        math_compute_score("\\boxed{3}", "")
