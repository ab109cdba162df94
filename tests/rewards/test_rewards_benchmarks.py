"""The benchmark verifiers: MATH through math-verify (with its boxed fallback), AIME integers, GPQA
letters; formats, near misses, malformed, empty and very long outputs; answer extraction for maj@k."""

from __future__ import annotations

import time

import pytest

from tether.rewards import (
    REWARD_FUNCTIONS,
    aime_compute_score,
    extract_aime_answer,
    extract_answer,
    extract_choice_letter,
    get_reward_function,
    gpqa_compute_score,
    math_boxed_compute_score,
    math_compute_score,
)
from tether.rewards.math import extract_math_answer, math_verify_score

# ------------------------------------------------------------------------------------------- MATH


# fmt: off
@pytest.mark.parametrize(("solution", "gt", "score"), [
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac12", 1.0),
    ("$\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
    ("$\\boxed{\\dfrac{\\sqrt{2}}{2}}$", "\\frac{\\sqrt2}{2}", 1.0),
    ("$\\boxed{\\sqrt{2}/2}$", "\\frac{\\sqrt{2}}{2}", 1.0),                 # the fallback says no
    ("$\\boxed{(1,2]}$", "(1,2]", 1.0),                                      # intervals
    ("$\\boxed{(1,2)}$", "(1,2]", 0.0),                                      # near miss: open end
    ("$\\boxed{\\{2,1\\}}$", "\\{1,2\\}", 1.0),                              # sets are unordered
    ("$\\boxed{x^2+1}$", "1+x^2", 1.0),                                      # symbolic
    ("$\\boxed{5\\text{ cm}}$", "5", 1.0),                                   # units dropped
    ("The final answer is $3$.", "3", 1.0),                                  # a marked answer, no box
    ("We get 3 and then 4.", "4", 0.0),                                      # no marked answer: 0
    ("$\\boxed{3}$ ... on second thought $\\boxed{4}$", "3", 0.0),           # the last box counts
    ("$\\boxed{1/3}$", "0.3333", 0.0),                                       # near miss beyond rounding
    ("", "3", 0.0),                                                          # empty output
    ("\\boxed{", "3", 0.0),                                                  # malformed
    ("The answer is $\\boxed{\\text{Evelyn}}$", "\\text{Evelyn}", 1.0),      # text answers
])
# fmt: on
def test_math_verify_cases(solution, gt, score):
    assert math_compute_score(solution, gt) == score


def test_math_boxed_fallback_where_math_verify_cannot_parse():
    # math-verify reads neither \fbox{} nor a brace-less \boxed 5: today's boxed match decides
    for solution in ("so \\fbox{5}", "so \\boxed 5 done"):
        assert math_verify_score(solution, "5") is None
        assert math_compute_score(solution, "5") == math_boxed_compute_score(solution, "5") == 1.0
        assert math_compute_score(solution, "6") == 0.0
    with pytest.raises(ValueError, match="empty"):
        math_compute_score("\\boxed{3}", "  ")


def test_math_very_long_output_is_fast():
    text = "Let me think. " * 5000 + "\\boxed{42}"
    t = time.perf_counter()
    assert math_compute_score(text, "42") == 1.0
    assert time.perf_counter() - t < 5.0


def test_math_answer_canonical_form_for_voting():
    assert (
        extract_math_answer("\\boxed{0.5}")
        == extract_math_answer("\\boxed{\\frac12}")
        == extract_math_answer("\\boxed{1/2}")
        == "1/2"
    )
    assert extract_math_answer("no answer here") is None
    assert extract_answer("HuggingFaceH4/MATH-500", "\\boxed{2}") == "2"


# ------------------------------------------------------------------------------------------- AIME


# fmt: off
@pytest.mark.parametrize(("solution", "want"), [
    ("... so $m+n = \\boxed{033}$.", 33),
    ("Thus the answer is 33.", 33),
    ("Answer: 204", 204),
    ("\\boxed{0}", 0),
    ("\\boxed{999}", 999),
    ("\\boxed{33^\\circ}", 33),
    ("The answer is 12. Wait, recheck: \\boxed{13}", 13),   # the last marker
    ("\\boxed{1000}", None),                                  # out of range
    ("\\boxed{-5}", None),
    ("\\boxed{3.5}", None),
    ("\\boxed{x}", None),
    ("We compute 12 * 3 = 36 and 36 + 1 = 37", None),        # no marker: scratch numbers are not answers
    ("", None),
])
# fmt: on
def test_aime_extraction(solution, want):
    assert extract_aime_answer(solution) == want


def test_aime_score_and_ground_truths():
    assert aime_compute_score("\\boxed{033}", "33") == 1.0
    assert aime_compute_score("\\boxed{33}", "033") == 1.0
    assert aime_compute_score("\\boxed{33}", 33) == 1.0
    assert aime_compute_score("\\boxed{330}", 33) == 0.0  # near miss
    assert aime_compute_score("\\boxed{3}", 33) == 0.0
    assert aime_compute_score("7" * 10000, 777) == 0.0  # very long degenerate output
    for bad in ("thirty", -1, 1000, True, None, "3.5"):
        with pytest.raises(ValueError, match="AIME ground truth"):
            aime_compute_score("\\boxed{1}", bad)


# ------------------------------------------------------------------------------------------- GPQA

CHOICES = {"A": "4.2 eV", "B": "2.1 eV", "C": "10^{-4} eV", "D": "42 eV"}


# fmt: off
@pytest.mark.parametrize(("solution", "want"), [
    ("Reasoning...\nAnswer: C", "C"),
    ("**Answer:** B", "B"),
    ("The answer is (D).", "D"),
    ("So the correct answer is $\\boxed{A}$", "A"),
    ("Answer: \\boxed{C}", "C"),
    ("Therefore \\boxed{\\text{B}}", "B"),
    ("\\boxed{(c)}", "C"),                                       # lower case inside a box
    ("\\boxed{D) 42 eV}", "D"),
    ("Option (A) fails, so it must be (B)", "B"),                  # the last bare (X)
    ("Answer: A\nThen I doubt (B).", "A"),                        # a marker beats a later bare (X)
    ("The energy is 4.2 eV", "A"),                                 # the option text itself
    ("The energy is 42 eV", "D"),                                  # longest matching option ("4.2"? no: "42 eV")
    ("Answer: All of the above", None),                            # 'All' is not 'A'
    ("Answer: E", None),                                           # not an option
    ("I am not sure.", None),
    ("", None),
])
# fmt: on
def test_gpqa_extraction(solution, want):
    assert extract_choice_letter(solution, CHOICES) == want


def test_gpqa_score():
    info = {"choices": CHOICES}
    assert gpqa_compute_score("Answer: C", "C", info) == 1.0
    assert gpqa_compute_score("Answer: B", "C", info) == 0.0
    assert gpqa_compute_score("The energy is 10^{-4} eV", "C", info) == 1.0
    assert gpqa_compute_score("The energy is 10^{-4} eV", "C", None) == 0.0  # no options: no text match
    assert gpqa_compute_score("x" * 100000 + " Answer: D", "D", info) == 1.0  # very long output
    with pytest.raises(ValueError, match="letters A, B, C, D"):
        gpqa_compute_score("Answer: A", "4.2 eV", info)
    assert extract_answer("Idavidrein/gpqa", "Answer: B", info) == "B"


def test_registry_selects_the_benchmark_verifiers():
    for ds in ("aime", "AI-MO/aimo-validation-aime", "HuggingFaceH4/aime_2024"):
        assert REWARD_FUNCTIONS[ds].endswith(":aime_compute_score")
        assert get_reward_function(ds)("\\boxed{7}", "7") == 1.0
    assert get_reward_function("Idavidrein/gpqa")("Answer: A", "A") == 1.0
    assert get_reward_function("HuggingFaceH4/MATH-500")("\\boxed{0.5}", "\\frac12") == 1.0
    # maj@k votes: the extracted answer per source, the normalised text elsewhere
    assert extract_answer("openai/gsm8k", "so 1,000 apples. #### 1,000") == "1000"
    assert extract_answer("no/such/source", "  a   b ") == "a b" and extract_answer("no/such/source", " ") is None
