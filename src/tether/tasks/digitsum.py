"""The embedded default task: "write k digits whose sum is s".

A prompt states ``k`` and ``s`` as ``"{k},{s}="`` (for example ``"3,13="``: three digits summing to
13); the tokenizer puts a BOS token in front. A response is a string of digits followed by the EOS
token, for example ``"490"`` + EOS. The reward is rule-based (:func:`compute_score`): 1.0 when the
response is exactly ``k`` decimal digits whose sum is ``s``, otherwise 0.0.

Many answers are valid for most prompts (75 of the 1000 three-digit strings sum to 13), so a policy
can be correct and diverse, or correct and collapsed onto a single answer: the task makes mode
collapse visible. In the default setting (``k = 3``, ``s`` in 4..23) the response space over the
15-token vocabulary with ``MAX_NEW_TOKENS = 4`` has 41,371 members and is enumerated exactly by
:mod:`tether.tasks.exact`.

Rows follow verl's dataset schema (``data_source``, ``prompt``, ``ability``, ``reward_model``,
``extra_info``); the reward function follows verl's signature
``compute_score(solution_str, ground_truth, extra_info=None) -> float``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

DATA_SOURCE = "tether/digitsum"
ABILITY = "arithmetic"

#: The default number of digits per answer.
DEFAULT_K = 3
#: The default range of target sums (inclusive); every s here has at least 15 valid answers for k=3.
DEFAULT_S_RANGE = (4, 23)
#: Target sums held out of the training split for ``k = DEFAULT_K`` (the validation split).
VAL_S = (6, 11, 16, 21)
#: Generation budget for the default k: k digits + EOS.
MAX_NEW_TOKENS = DEFAULT_K + 1

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
#: Ordinary (non-special) characters of the vocabulary, in id order after the three special tokens.
CHARS = "0123456789,="
SEPARATOR, TERMINATOR = ",", "="

_PROMPT_RE = re.compile(r"^\s*(\d+)\s*,\s*(\d+)\s*=\s*$")
_SPLITS = ("train", "val", "all")


def max_new_tokens_for(k: int) -> int:
    """Generation budget for ``k`` digits: ``k + 1`` tokens (the digits and EOS)."""
    _check_k(k)
    return k + 1


def make_prompt(k: int, s: int) -> str:
    """The prompt text for ``k`` digits summing to ``s``, e.g. ``make_prompt(3, 13) == "3,13="``.

    Raises ValueError if ``k < 1`` or ``s`` is outside ``0..9k`` (no answer would exist).
    """
    _check_k(k)
    _check_s(k, s)
    return f"{k}{SEPARATOR}{s}{TERMINATOR}"


def parse_prompt(prompt: str) -> tuple[int, int]:
    """Inverse of :func:`make_prompt`: ``"3,13="`` -> ``(3, 13)``.

    Whitespace around the numbers is tolerated; special tokens must already be stripped.
    Raises ValueError if the text is not of the form ``"{k},{s}="``.
    """
    m = _PROMPT_RE.match(prompt)
    if m is None:
        raise ValueError(f"prompt {prompt!r} is not a digit-sum prompt of the form 'k,s=' (e.g. '3,13=')")
    return int(m.group(1)), int(m.group(2))


def parse_ground_truth(ground_truth: Any) -> tuple[int, int]:
    """Normalise a ground truth to ``(k, s)``.

    Accepts the string ``"k,s"`` (as stored in the dataset rows), a mapping with keys ``"k"`` and
    ``"s"``, or a 2-sequence ``(k, s)``. Raises ValueError for anything else.
    """
    if isinstance(ground_truth, str):
        parts = ground_truth.split(",")
        if len(parts) != 2:
            raise ValueError(f"ground_truth {ground_truth!r} must look like 'k,s' (e.g. '3,13')")
        try:
            k, s = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"ground_truth {ground_truth!r} must look like 'k,s' with integers") from None
    elif isinstance(ground_truth, Mapping):
        if "k" not in ground_truth or "s" not in ground_truth:
            raise ValueError(f"ground_truth mapping {dict(ground_truth)!r} needs keys 'k' and 's'")
        k, s = int(ground_truth["k"]), int(ground_truth["s"])
    elif isinstance(ground_truth, Sequence) and len(ground_truth) == 2:
        k, s = int(ground_truth[0]), int(ground_truth[1])
    else:
        raise ValueError(f"ground_truth {ground_truth!r} must be 'k,s', {{'k': k, 's': s}} or (k, s)")
    if k < 1:
        raise ValueError(f"ground_truth {ground_truth!r}: k must be >= 1")
    return k, s


def is_correct(answer: str, k: int, s: int) -> bool:
    """True when ``answer`` is exactly ``k`` ASCII digits summing to ``s`` (no whitespace allowed)."""
    return len(answer) == k and all("0" <= c <= "9" for c in answer) and sum(map(int, answer)) == s


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """Rule-based reward of one response (verl's reward-function signature).

    Args:
        solution_str: the decoded response *without* special tokens (``skip_special_tokens=True``).
            Leading and trailing whitespace is tolerated (stripped); whitespace between digits is not
            (``"4 9 0"`` scores 0).
        ground_truth: ``"k,s"``, ``{"k": k, "s": s}`` or ``(k, s)``; see :func:`parse_ground_truth`.
        extra_info: unused; accepted for verl compatibility.

    Returns:
        1.0 if the stripped response is exactly ``k`` digits whose sum is ``s``, else 0.0.

    Raises:
        TypeError: if ``solution_str`` is not a string.
        ValueError: if ``ground_truth`` is malformed.
    """
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be str, got {type(solution_str).__name__}")
    k, s = parse_ground_truth(ground_truth)
    return 1.0 if is_correct(solution_str.strip(), k, s) else 0.0


def count_valid(k: int, s: int) -> int:
    """Number of k-digit strings (leading zeros allowed) whose digits sum to ``s``."""
    _check_k(k)
    counts = [1] + [0] * (9 * k)  # counts[t]: strings of the current length with digit sum t
    for _ in range(k):
        new = [0] * (9 * k + 1)
        for t, c in enumerate(counts):
            if c:
                for d in range(10):
                    if t + d <= 9 * k:
                        new[t + d] += c
        counts = new
    return counts[s] if 0 <= s <= 9 * k else 0


def valid_answers(k: int, s: int) -> list[str]:
    """All k-digit strings summing to ``s``, in lexicographic order (10**k candidates are scanned)."""
    _check_k(k)
    if k > 6:
        raise ValueError(f"k={k} is too large to list valid answers (10**k strings); use count_valid")
    return [a for a in (str(i).zfill(k) for i in range(10**k)) if is_correct(a, k, s)]


def split_sums(split: str, k: int = DEFAULT_K, s_range: tuple[int, int] | None = None) -> list[int]:
    """The target sums of a split.

    For ``k = DEFAULT_K`` with the default ``s_range``: ``"val"`` is :data:`VAL_S`, ``"train"`` the
    other sums of 4..23 (disjoint), ``"all"`` both. For other settings, every fifth sum of the range
    (starting at its third) is held out for validation in the same way.
    Raises ValueError for an unknown split or a range outside ``0..9k``.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    lo, hi = s_range if s_range is not None else (DEFAULT_S_RANGE if k == DEFAULT_K else (k, 8 * k))
    _check_s(k, lo)
    _check_s(k, hi)
    if lo > hi:
        raise ValueError(f"s_range {s_range!r} is empty")
    sums = list(range(lo, hi + 1))
    if k == DEFAULT_K and (lo, hi) == DEFAULT_S_RANGE:
        val = list(VAL_S)
    else:
        val = sums[2::5]
    if split == "all":
        return sums
    if split == "val":
        return val
    return [s for s in sums if s not in val]


def make_row(k: int, s: int, index: int, split: str) -> dict:
    """One dataset row in verl's schema for the prompt ``(k, s)``."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": make_prompt(k, s),
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": f"{k},{s}"},
        "extra_info": {"k": k, "s": s, "index": index, "split": split},
    }


def make_dataset(
    split: str,
    n: int | None = None,
    seed: int = 0,
    *,
    k: int = DEFAULT_K,
    s_range: tuple[int, int] | None = None,
) -> list[dict]:
    """Rows of the digit-sum task in verl's schema.

    A prompt is determined by ``(k, s)``, so a split has few distinct prompts (16 for ``"train"``, 4
    for ``"val"`` in the default setting; the sums of the two are disjoint, see :func:`split_sums`).

    Args:
        split: ``"train"``, ``"val"`` or ``"all"``.
        n: number of rows. ``None`` gives one row per distinct prompt, in order of ``s``. Otherwise
            the distinct prompts are repeated in shuffled rounds (each round a fresh permutation from
            ``seed``), so every prompt appears ``n // P`` or ``n // P + 1`` times.
        seed: seed of the shuffling (``random.Random``); same arguments give the same rows.
        k: digits per answer (default 3). The shipped reference model was trained on k = 3 only.
        s_range: inclusive range of target sums; default 4..23 for k = 3.

    Returns:
        A list of dicts ``{"data_source", "prompt", "ability", "reward_model": {"style": "rule",
        "ground_truth": "k,s"}, "extra_info": {"k", "s", "index", "split"}}``; ``index`` is the row
        position.

    Raises:
        ValueError: for an unknown split, ``n < 1``, or an invalid ``k``/``s_range``.
    """
    sums = split_sums(split, k, s_range)
    if n is None:
        order = sums
    else:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int or None, got {n!r}")
        rng = random.Random(seed)
        order = []
        while len(order) < n:
            perm = list(sums)
            rng.shuffle(perm)
            order.extend(perm)
        order = order[:n]
    return [make_row(k, s, i, split) for i, s in enumerate(order)]


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")


def _check_s(k: int, s: int) -> None:
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= 9 * k:
        raise ValueError(f"s must be an int in 0..{9 * k} for k={k}, got {s!r}")
