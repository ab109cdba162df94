"""Rule-based math rewards: GSM8K final-answer match and MATH answer equivalence (math-verify, with a
``\\boxed{}`` string match as its fallback).

Both follow verl's per-sample signature
``compute_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> float`` and
return 1.0 (correct) or 0.0 (``format_score`` for GSM8K when an answer was found but is wrong).

GSM8K (:func:`gsm8k_compute_score`)
-----------------------------------
The *final answer* of a solution is found as follows.

1. **Marked answers** (both modes). Every occurrence of these markers followed by a number:

   * ``#### N`` (GSM8K's own format; verl's strict mode accepts only this one),
   * ``A: N`` at the start of a line (the format of the GSM8K paper's model solutions),
   * ``The answer is N`` / ``The final answer is N`` / ``Answer: N`` / ``Final answer: N``
     (case-insensitive; an optional ``:`` and markdown ``**`` are allowed before N),
   * ``\\boxed{...}`` whose content holds a number (the first number in it is used).

   The marker that occurs **last in the text** wins (a solution's final statement is its answer).
2. **Flexible mode only**: when no marker is found, the **last number** in the text.

``strict`` mode stops after step 1 (no marker → no answer → 0.0). Differences from verl's
``gsm8k.py``: verl's strict mode accepts only ``#### N``; verl's flexible mode takes the last number
even when a marker is present, and verl clips the solution to its last 300 characters first.
Here markers take precedence over the last number and the whole text is searched.

A *number* (:data:`NUMBER_PATTERN`): optional sign (``-`` or the Unicode minus ``−``), optional
currency ``$`` / ``\\$``, digits with optional thousands commas (``1,000``; commas must group by
three, otherwise ``3,4`` reads as two numbers), optional decimals (``0.5``, ``.5``), an optional
simple fraction ``a/b``, optional ``%``. A trailing sentence period (``1000.``) is not part of the
number. A ``-`` directly after a digit, letter or ``)`` is a minus operator, not a sign (``16-3``
reads 16 and 3).

Comparison is **as numbers, exactly** (Python ``fractions.Fraction``): ``1,000``, ``1000.0``,
``$1000``, ``1000.`` all equal 1000; ``0.5 == 1/2``; ``-3 != 3``. A percent sign is dropped, not
divided by 100 (``25%`` equals 25, since GSM8K states percentage answers as the bare number).
Words (``ten``), scale words (``1.8 billion`` reads 1.8) and scientific notation are not
interpreted. The ground truth may be an int, float, or a string parsed the same way
(``"5,600"``, ``"A: 18"`` style strings are not accepted: pass the number).

MATH (:func:`math_compute_score`)
---------------------------------
Answer equivalence through ``math-verify`` (Hugging Face's answer checker, the one lighteval and
open-r1 use): the solution's answer is the content of its last ``\\boxed{}`` (highest priority), else
an answer marked "the final answer is ..."; the ground truth is parsed as ``\\boxed{ground truth}``;
both become SymPy objects and are compared symbolically and numerically (fractions, decimals,
``\\sqrt``, intervals, sets, tuples, percentages, units dropped). When math-verify cannot parse either
side (an empty list), the answer falls back to :func:`math_boxed_compute_score`, the string-and-number
match below. math-verify's own timeouts (5 s per parse or comparison, ``signal.alarm``) apply in the
main thread; elsewhere they are off (signals work only in the main thread).

:func:`math_boxed_compute_score` (the fallback, and before math-verify the MATH reward itself): the
answer is the content of the **last** ``\\boxed{...}`` (or ``\\fbox{...}``; nested braces are
balanced; ``\\boxed 5`` without braces reads up to the next space or ``$``). No boxed answer → 0.0.
The ground truth is used as is, or, if it contains ``\\boxed``, its last boxed content (so a full
MATH ``solution`` works as ground truth). Both sides are normalised by
:func:`normalize_math_answer` and compared as strings; if both parse as numbers
(:func:`parse_math_number`: integers, decimals, thousands commas, ``a/b``, ``\\frac{a}{b}``, with
sign) they are compared as numbers instead. verl's ``math.py`` (Hendrycks' ``is_equiv``) compares
normalised strings only and strips units more aggressively; this adds numeric equality
(``0.5`` = ``\\frac{1}{2}`` = ``1/2``) and keeps ``\\text{}`` contents.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

__all__ = [
    "NUMBER_PATTERN",
    "extract_gsm8k_answer",
    "extract_last_boxed",
    "gsm8k_compute_score",
    "gsm8k_strict_compute_score",
    "extract_math_answer",
    "math_boxed_compute_score",
    "math_compute_score",
    "math_verify_score",
    "math_is_equiv",
    "normalize_math_answer",
    "parse_math_number",
    "parse_number",
]

# ------------------------------------------------------------------------------------- numbers

_MINUS = "-\u2212"
#: The number grammar used for extraction (see the module docstring).
# fmt: off
NUMBER_PATTERN = (
    r"(?<![0-9A-Za-z_)\]])"                      # a '-' after these is an operator
    r"(?:[" + _MINUS + r"]\s?)?"                  # sign
    r"(?:\\?\$\s?)?"                              # currency: $ or \$
    r"(?:[" + _MINUS + r"])?"                     # sign after the currency: $-5
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)(?!,\d)|\d+)(?:\.\d+)?"     # 1,000 | 1000 | 1000.5
    r"(?:\s?/\s?\d+(?![\d.,]\d))?"                # simple fraction a/b
    r"|(?<![0-9A-Za-z_)\]])(?:[" + _MINUS + r"]\s?)?(?:\\?\$\s?)?\.\d+"   # .5
)
# fmt: on
_NUMBER_RE = re.compile(NUMBER_PATTERN)
#: Longer number strings (e.g. a degenerate run of digits) are not numbers.
_MAX_NUMBER_CHARS = 200


def parse_number(value: Any) -> Fraction | None:
    """Parse one number (a ground truth or an extracted answer) exactly.

    Args:
        value: an int, float (finite), Fraction, or a string such as ``"1,000"``, ``"$1000.00"``,
            ``"-3.5"``, ``"25%"``, ``"3/4"``, ``"1000."``, ``" 72 "``. Surrounding whitespace,
            ``$``/``\\$``, ``%``/``\\%``, LaTeX ``$...$`` delimiters and one trailing period are
            ignored; commas are removed only when they group digits by three.

    Returns:
        The value as a ``Fraction``, or None when ``value`` is not a single number (``bool`` is not
        a number here; NaN and infinities are not either; nor is a string over 200 characters, such
        as a degenerate run of digits).
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, Fraction):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        return Fraction(value).limit_denominator(10**12) if value != int(value) else Fraction(int(value))
    if not isinstance(value, str):
        return None
    if len(value) > _MAX_NUMBER_CHARS:  # degenerate digit runs; also avoids int()'s 4300-digit limit
        return None
    s = value.strip().replace("\u2212", "-")
    s = s.strip("$").strip()
    if s.endswith("\\%"):
        s = s[:-2]
    s = s.rstrip("%").strip()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1]
    neg = False
    if s.startswith("-"):
        neg, s = True, s[1:].strip()
    if s.startswith("\\$"):
        s = s[2:].strip()
    elif s.startswith("$"):
        s = s[1:].strip()
    if s.startswith("-") and not neg:
        neg, s = True, s[1:].strip()
    m = re.fullmatch(r"(\d{1,3}(?:,\d{3})+|\d+)?(\.\d+)?(?:\s*/\s*(\d+))?", s)
    if not m or not (m.group(1) or m.group(2)):
        return None
    num = Fraction((m.group(1) or "0").replace(",", "") + (m.group(2) or ""))
    if m.group(3) is not None:
        den = int(m.group(3))
        if den == 0 or m.group(2):
            return None
        num = num / den
    return -num if neg else num


def _numbers(text: str) -> list[tuple[int, int, Fraction]]:
    """All numbers in ``text`` as ``(start, end, value)``."""
    out = []
    for m in _NUMBER_RE.finditer(text):
        v = parse_number(m.group(0))
        if v is not None:
            out.append((m.start(), m.end(), v))
    return out


# ------------------------------------------------------------------------------------- GSM8K

_MARKERS = re.compile(r"####|(?m:^[ \t]*A:)|(?i:\b(?:the\s+)?(?:final\s+)?answer\s*(?:is\s*:?|:))")
_MARKER_GAP = re.compile(r"\s*(?:\*\*|\\\(|\\\[)?\s*")


def _boxed_spans(text: str) -> list[tuple[int, str]]:
    """``(start, content)`` of every ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces)."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        if depth == 0:
            out.append((m.start(), text[m.end() : i - 1]))
    return out


def _latex_to_plain_number_text(s: str) -> str:
    s = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"\1/\2", s)
    s = re.sub(r"\\(?:text|mbox|mathrm)\s*\{([^{}]*)\}", r" \1 ", s)
    return s.replace("\\!", "").replace("\\,", "").replace("{,}", ",")


def extract_gsm8k_answer(text: str, method: str = "flexible") -> Fraction | None:
    """Extract the final numeric answer of a solution (rules in the module docstring).

    Args:
        text: the model's response.
        method: ``"strict"`` (markers only) or ``"flexible"`` (markers, else the last number).

    Returns:
        The answer as a ``Fraction``, or None when there is none.

    Raises:
        ValueError: unknown ``method``.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    best_pos, best = -1, None
    for m in _MARKERS.finditer(text):
        gap = _MARKER_GAP.match(text, m.end())
        nm = _NUMBER_RE.match(text, gap.end())
        if nm is None:
            continue
        v = parse_number(nm.group(0))
        if v is not None and m.start() > best_pos:
            best_pos, best = m.start(), v
    for pos, content in _boxed_spans(text):
        if pos <= best_pos:
            continue
        nums = _numbers(_latex_to_plain_number_text(content))
        if nums:
            best_pos, best = pos, nums[0][2]
    if best is not None or method == "strict":
        return best
    nums = _numbers(text)
    return nums[-1][2] if nums else None


def gsm8k_compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    method: str = "flexible",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """GSM8K final-answer reward (verl signature).

    Args:
        solution_str: the model's response.
        ground_truth: the reference answer: a number or a numeric string (``"72"``, ``"5,600"``).
        extra_info: ignored, except that ``extra_info["gsm8k_method"]`` (``"strict"`` /
            ``"flexible"``), when present, overrides ``method``.
        method: ``"flexible"`` (the default, and what the ``openai/gsm8k`` registry entry uses) or
            ``"strict"``; see the module docstring.
        format_score: returned when an answer was found but is wrong (verl's ``format_score``).
        score: returned when the answer equals the ground truth.

    Returns:
        ``score``, ``format_score``, or 0.0 when no answer was found.

    Raises:
        ValueError: the ground truth is not a number (a data problem; the reward manager counts the
            sample as invalid), or an unknown ``method``.
    """
    gt = parse_number(ground_truth)
    if gt is None:
        raise ValueError(f"GSM8K ground truth is not a number: {ground_truth!r}")
    if extra_info and extra_info.get("gsm8k_method") in ("strict", "flexible"):
        method = extra_info["gsm8k_method"]
    ans = extract_gsm8k_answer(solution_str, method)
    if ans is None:
        return 0.0
    return float(score) if ans == gt else float(format_score)


def gsm8k_strict_compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """:func:`gsm8k_compute_score` with ``method="strict"``."""
    return gsm8k_compute_score(solution_str, ground_truth, extra_info, method="strict")


# ------------------------------------------------------------------------------------- MATH


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (nested braces balanced),
    or of ``\\boxed X`` (brace-less, up to the next whitespace or ``$``); None when there is none or
    its braces are unbalanced."""
    spans = _boxed_spans(text)
    last_pos, last = spans[-1] if spans else (-1, None)
    for m in re.finditer(r"\\boxed ([^\s${}]+)", text):
        if m.start() > last_pos:
            last_pos, last = m.start(), m.group(1)
    return last


def normalize_math_answer(s: str) -> str:
    """Light normalisation of a MATH answer string for comparison.

    Removes: whitespace, ``\\left`` / ``\\right``, thin spaces ``\\!`` ``\\,`` ``\\;`` ``\\:``,
    ``$`` and ``\\$``, ``^\\circ`` / ``^{\\circ}``, ``\\%`` and ``%``, a trailing ``.``, an outer
    ``\\text{...}`` / ``\\mbox{...}`` wrapper (the content is kept), and a short left-hand side
    ``x =``. Rewrites ``\\dfrac`` / ``\\tfrac`` → ``\\frac``, ``\\frac12`` → ``\\frac{1}{2}``,
    ``\\sqrt3`` → ``\\sqrt{3}``, and a
    leading ``.5`` → ``0.5``.
    """
    s = str(s).strip()
    s = s.replace("\\left", "").replace("\\right", "")
    for t in ("\\!", "\\,", "\\;", "\\:", "\\$", "$", "\\%", "%"):
        s = s.replace(t, "")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\(?:text|mbox|textbf|mathrm)\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"^[A-Za-z]=", "", s)
    s = s.rstrip(".")
    if s.startswith("."):
        s = "0" + s
    if s.startswith("-."):
        s = "-0" + s[1:]
    return s


def parse_math_number(s: str) -> Fraction | None:
    """A normalised MATH answer as an exact number, or None.

    Accepts integers, decimals, thousands commas (``1,000``; ``1,2`` is not a number), ``a/b``,
    ``\\frac{a}{b}`` with integer or decimal ``a`` and ``b``, each with an optional leading ``-``.
    """
    s = normalize_math_answer(s)
    neg = s.startswith("-")
    if neg:
        s = s[1:]
    m = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if m:
        a, b = parse_number(m.group(1)), parse_number(m.group(2))
        if a is None or b is None or b == 0:
            return None
        v = a / b
    else:
        v = parse_number(s) if re.fullmatch(r"[\d.,/]+", s or "x") else None
        if v is None:
            return None
    return -v if neg else v


def math_is_equiv(answer: str, ground_truth: str) -> bool:
    """True when two MATH answers are equal after :func:`normalize_math_answer`, or both parse as
    numbers (:func:`parse_math_number`) with the same value."""
    a, b = normalize_math_answer(answer), normalize_math_answer(ground_truth)
    if a == b:
        return True
    na, nb = parse_math_number(a), parse_math_number(b)
    return na is not None and nb is not None and na == nb


def _math_ground_truth(ground_truth: Any) -> str:
    if ground_truth is None or (isinstance(ground_truth, str) and not ground_truth.strip()):
        raise ValueError(f"MATH ground truth is empty: {ground_truth!r}")
    gt = str(ground_truth)
    if "\\boxed" in gt or "\\fbox" in gt:
        boxed = extract_last_boxed(gt)
        if boxed is not None:
            gt = boxed
    return gt


def math_boxed_compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """MATH-style boxed-answer match without math-verify (verl signature): 1.0 when the last
    ``\\boxed{}`` of the solution matches the ground truth (:func:`math_is_equiv`), else 0.0 (also
    when there is no boxed answer). The fallback of :func:`math_compute_score`.

    Args:
        solution_str: the model's response.
        ground_truth: the reference answer (string or number), or a full solution containing
            ``\\boxed{}`` (its last boxed content is used).
        extra_info: ignored.

    Raises:
        ValueError: ``ground_truth`` is None or empty (a data problem).
    """
    gt = _math_ground_truth(ground_truth)
    ans = extract_last_boxed(solution_str)
    if ans is None:
        return 0.0
    return 1.0 if math_is_equiv(ans, gt) else 0.0


def _mv_timeout() -> int | None:
    """math-verify's timeouts use ``signal.alarm``, which only the main thread may set."""
    import threading

    return 5 if threading.current_thread() is threading.main_thread() else None


def _mv_parse_solution(solution_str: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [
        LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False),
        ExprExtractionConfig(try_extract_without_anchor=False),
    ]
    return parse(solution_str, extraction_config=configs, parsing_timeout=_mv_timeout())


def math_verify_score(solution_str: str, ground_truth: Any) -> float | None:
    """1.0 / 0.0 from math-verify, or None when it cannot parse the solution's answer or the ground
    truth (then :func:`math_compute_score` falls back to :func:`math_boxed_compute_score`).

    Raises:
        ValueError: ``ground_truth`` is None or empty.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gt = _math_ground_truth(ground_truth)
    t = _mv_timeout()
    gold = parse(
        "\\boxed{" + gt + "}", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=t
    )
    pred = _mv_parse_solution(solution_str)
    if not gold or not pred:
        return None
    return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0


def math_compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """MATH / MATH-500 reward (verl signature): 1.0 when the solution's final answer (last
    ``\\boxed{}``, else a marked final answer) equals the ground truth by math-verify
    (:func:`math_verify_score`); when math-verify cannot parse either side, the boxed match
    :func:`math_boxed_compute_score`. Else 0.0.

    Args:
        solution_str: the model's response.
        ground_truth: the reference answer (string or number), or a full solution containing
            ``\\boxed{}`` (its last boxed content is used).
        extra_info: ignored.

    Raises:
        ValueError: ``ground_truth`` is None or empty (a data problem).
    """
    v = math_verify_score(solution_str, ground_truth)
    return v if v is not None else math_boxed_compute_score(solution_str, ground_truth)


def extract_math_answer(solution_str: str) -> str | None:
    """The solution's final answer as a canonical string, for majority voting (maj@k): math-verify's
    parsed form (``str`` of the SymPy object, so ``0.5``, ``\\frac12`` and ``1/2`` all give ``"1/2"``),
    else the normalised last ``\\boxed{}`` content (:func:`normalize_math_answer`), else None."""
    pred = _mv_parse_solution(solution_str)
    if pred:
        return str(pred[0])
    boxed = extract_last_boxed(solution_str)
    return normalize_math_answer(boxed) if boxed is not None else None
