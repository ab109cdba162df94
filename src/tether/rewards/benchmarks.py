"""Verifiers of the reasoning benchmarks: AIME (integer answers 0-999) and GPQA (four options, A-D).

Both follow verl's per-sample signature
``compute_score(solution_str, ground_truth, extra_info=None) -> float`` (1.0 correct, else 0.0) and
come with an ``extract_*`` function that gives the answer a response commits to (the vote of maj@k).

AIME (:func:`aime_compute_score`)
---------------------------------
The answer is the number of the marker that occurs last in the response, among ``\\boxed{...}``,
``The (final) answer is N``, ``Answer: N``, ``#### N`` and ``A: N`` at a line start (the marked
answers of :func:`tether.rewards.math.extract_gsm8k_answer`, strict mode: no marker, no answer; the
last number of a response is not taken, since AIME scratch work is full of integers). It counts
only as an integer in 0..999: leading zeros are fine (``\\boxed{033}`` is 33, as AIME answers are
written on the answer sheet), ``33.`` and ``\\boxed{33^\\circ}`` read 33; ``3.5``, ``-5``,
``1000`` and ``\\boxed{x}`` are no answer. The ground truth is an integer or a string of digits
(``"033"``), else a ``ValueError``.

GPQA (:func:`gpqa_compute_score`)
---------------------------------
The ground truth is the correct option's letter (``"C"``, written by ``tether data gpqa``). The
response's letter is found by the first rule that gives one, each taking its last occurrence:

1. an answer marker: ``Answer: C``, ``The answer is (C)``, ``**Answer:** C``, ``Answer: \\boxed{C}``
   (``answer`` in any case; the letter upper-case, alone: ``Answer: All`` is not ``A``);
2. ``\\boxed{C}`` (also ``\\boxed{\\text{C}}``, ``\\boxed{(C)}``, ``\\boxed{C) text}``);
3. a bare ``(C)``;
4. the option text itself, when ``extra_info["choices"]`` (``{"A": text, ...}``) is given: the
   options whose text (case, spaces and ``$`` ignored) occurs in the response's last non-empty
   line; the longest wins, and a tie between different options is no answer.

Lower-case letters count only inside ``\\boxed{}`` and parentheses after a marker are optional.
"""

from __future__ import annotations

import re
from typing import Any

from .math import _boxed_spans, extract_gsm8k_answer

__all__ = [
    "GPQA_LETTERS",
    "aime_compute_score",
    "extract_aime_answer",
    "extract_choice_letter",
    "gpqa_compute_score",
    "parse_aime_ground_truth",
]

#: The option letters of GPQA's four choices.
GPQA_LETTERS = "ABCD"

# ------------------------------------------------------------------------------------------ AIME


def extract_aime_answer(solution_str: str) -> int | None:
    """The AIME answer of a response, an integer in 0..999, or None (rules in the module docstring)."""
    v = extract_gsm8k_answer(solution_str, "strict")
    if v is None or v.denominator != 1 or not 0 <= v <= 999:
        return None
    return int(v)


def parse_aime_ground_truth(ground_truth: Any) -> int:
    """An AIME ground truth as an int: an int or a string of digits (``"033"``, ``" 204 "``).

    Raises:
        ValueError: anything else (a bool, a negative or non-integer number, other text), or a value
            outside 0..999.
    """
    if isinstance(ground_truth, bool):
        raise ValueError(f"AIME ground truth is not an integer: {ground_truth!r}")
    if isinstance(ground_truth, int):
        v = ground_truth
    elif isinstance(ground_truth, float) and ground_truth.is_integer():
        v = int(ground_truth)
    elif isinstance(ground_truth, str) and re.fullmatch(r"\s*\d+\s*", ground_truth):
        v = int(ground_truth)
    else:
        raise ValueError(f"AIME ground truth is not an integer: {ground_truth!r}")
    if not 0 <= v <= 999:
        raise ValueError(f"AIME ground truth {ground_truth!r} is outside 0..999")
    return v


def aime_compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """AIME reward (verl signature): 1.0 when the response's answer (:func:`extract_aime_answer`)
    equals the ground truth, else 0.0 (also when there is no answer).

    Raises:
        ValueError: the ground truth is not an integer in 0..999 (:func:`parse_aime_ground_truth`).
    """
    gt = parse_aime_ground_truth(ground_truth)
    return 1.0 if extract_aime_answer(solution_str) == gt else 0.0


# ------------------------------------------------------------------------------------------ GPQA

_MARKER = re.compile(
    r"(?i:answer)(?:\s*(?i:is))?\s*[:：]?\s*(?:\*\*)?\s*(?::\s*)?(?:\$\s*)?"
    r"(?:\\(?:boxed|text|textbf|mathrm)\s*\{\s*)?\(?\s*([A-Z])(?![A-Za-z0-9])"
)
_PAREN = re.compile(r"\(([A-Z])\)")
_BOXED_LETTER = re.compile(r"\s*(?:\\(?:text|textbf|mathrm)\s*\{\s*)?\(?\s*([A-Za-z])\s*\)?\s*\}?\s*(?:\)|$|[\s.:])")


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.replace("$", "").replace("\\", "")).strip().strip(".").lower()


def _letter_from_choices(text: str, choices: dict[str, str], letters: str) -> str | None:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    last = _norm(lines[-1])
    found = [
        (len(_norm(t)), letter)
        for letter, t in choices.items()
        if letter in letters and _norm(str(t)) and _norm(str(t)) in last
    ]
    if not found:
        return None
    found.sort(reverse=True)
    if len(found) > 1 and found[0][0] == found[1][0]:
        return None
    return found[0][1]


def extract_choice_letter(
    solution_str: str, choices: dict[str, str] | None = None, letters: str = GPQA_LETTERS
) -> str | None:
    """The option letter a response commits to, or None (rules in the module docstring).

    Args:
        solution_str: the response.
        choices: ``{"A": option text, ...}``, for rule 4 (the option text itself).
        letters: the valid letters (default ``"ABCD"``); a letter outside them is no answer.
    """
    hits = [m.group(1) for m in _MARKER.finditer(solution_str) if m.group(1) in letters]
    if hits:
        return hits[-1]
    for _, content in reversed(_boxed_spans(solution_str)):
        m = _BOXED_LETTER.match(content)
        if m and m.group(1).upper() in letters:
            return m.group(1).upper()
    hits = [m.group(1) for m in _PAREN.finditer(solution_str) if m.group(1) in letters]
    if hits:
        return hits[-1]
    if choices:
        return _letter_from_choices(solution_str, choices, letters)
    return None


def gpqa_compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """GPQA reward (verl signature): 1.0 when the response's letter (:func:`extract_choice_letter`,
    with ``extra_info["choices"]`` when present) is the ground truth's, else 0.0.

    Raises:
        ValueError: the ground truth is not one of the letters A-D.
    """
    gt = str(ground_truth).strip().upper() if isinstance(ground_truth, str) else None
    if gt is None or len(gt) != 1 or gt not in GPQA_LETTERS:
        raise ValueError(
            f"GPQA ground truth must be one of the letters {', '.join(GPQA_LETTERS)}, got {ground_truth!r}"
        )
    choices = (extra_info or {}).get("choices") if isinstance(extra_info, dict) else None
    return 1.0 if extract_choice_letter(solution_str, choices if isinstance(choices, dict) else None) == gt else 0.0
