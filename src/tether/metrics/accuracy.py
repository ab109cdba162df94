"""Accuracy of n sampled responses per prompt: unbiased pass@k, mean@n, maj@k.

Pure functions over per-prompt lists, no I/O, no torch. A prompt contributes its n samples' scores,
their correctness (score >= a threshold chosen by the caller) and their extracted answers (a
hashable per sample, None when no answer was found); every metric is a macro average over prompts.

* **pass@k** (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with c
  of n samples correct, the probability that at least one of k samples drawn without replacement
  is correct, ``1 − C(n−c, k) / C(n, k)``, an unbiased estimate of pass@k for every k ≤ n (the
  "any of the n correct" rate is pass@n, and is biased upward as an estimate of pass@k for k < n).
  Computed exactly with integer binomials.
* **mean@n**: the mean score over all n samples (for 0/1 rewards, equal to pass@1).
* **maj@k** (majority voting, "self-consistency", Wang et al. 2023): the n samples are cut into
  ⌊n/k⌋ consecutive blocks of k; in each block the most frequent extracted answer wins (samples
  without an answer do not vote; ties go to the answer that appears first in the block), and the
  block scores 1 when the winning answer's first sample is correct, 0 when it is wrong or no sample
  voted. maj@k is the mean over blocks and prompts: every block is k i.i.d. samples, so this is an
  unbiased estimate of maj@k that uses all n samples (with n = k it is the usual single vote).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

__all__ = ["accuracy_metrics", "default_ks", "majority_vote", "maj_at_k", "pass_at_k", "parse_ks"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 − C(n−c, k) / C(n, k)`` (Chen et al. 2021, eq. 1).

    Args:
        n: samples drawn (>= 1); c: how many were correct (0 <= c <= n); k: 1 <= k <= n.

    Returns:
        The probability that a k-subset of the n samples holds a correct one, in [0, 1].

    Raises:
        ValueError: k outside 1..n or c outside 0..n.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(answers: Sequence[Hashable | None]) -> int | None:
    """Index of the sample whose answer wins a majority vote, or None when no sample has an answer.

    The most frequent non-None answer wins; among equally frequent answers the one that occurs first
    wins, and its first occurrence is returned (deterministic, independent of hashing order).
    """
    counts: dict[Hashable, int] = {}
    first: dict[Hashable, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, i)
    if not counts:
        return None
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[best]


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """maj@k of one prompt from its n samples: the mean over ⌊n/k⌋ consecutive blocks of k samples
    of the correctness of each block's majority answer (module docstring).

    Raises:
        ValueError: lengths differ, or k outside 1..n.
    """
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"answers and correct differ in length: {n} vs {len(correct)}")
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n, got k={k}, n={n}")
    blocks = n // k
    wins = 0
    for b in range(blocks):
        j = majority_vote(answers[b * k : (b + 1) * k])
        wins += j is not None and bool(correct[b * k + j])
    return wins / blocks


def default_ks(n: int) -> list[int]:
    """The k reported when none are asked for: 1, the powers of two below n, and n."""
    return sorted({1, n, *(2**i for i in range(1, max(n, 1).bit_length()) if 2**i <= n)})


def parse_ks(text: str | Sequence[int] | None, n: int | None) -> tuple[int, list[int]]:
    """``(n, ks)`` from ``--k 1,4,16`` and ``--n``: n defaults to the largest k; ks default to
    :func:`default_ks` of n.

    Raises:
        ValueError: a k that is not a positive integer, or larger than n (naming it).
    """
    if text is None or text == "":
        ks: list[int] = []
    elif isinstance(text, str):
        try:
            ks = [int(t) for t in text.replace(" ", "").split(",") if t]
        except ValueError:
            raise ValueError(
                f"--k must be a comma-separated list of positive integers (e.g. 1,4,16), got {text!r}"
            ) from None
    else:
        ks = [int(t) for t in text]
    if any(k < 1 for k in ks):
        raise ValueError(f"every k must be >= 1, got {ks}")
    if n is None:
        n = max(ks) if ks else None
    if n is None:
        raise ValueError("give --n (samples per prompt) or --k")
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    too_big = [k for k in ks if k > n]
    if too_big:
        raise ValueError(f"k={too_big} exceeds n={n} samples per prompt: pass@k and maj@k need k <= n (raise --n)")
    return n, sorted(set(ks)) if ks else default_ks(n)


def accuracy_metrics(
    scores: Sequence[Sequence[float]],
    correct: Sequence[Sequence[bool]],
    answers: Sequence[Sequence[Hashable | None]],
    ks: Sequence[int],
) -> dict[str, float]:
    """Accuracy over P prompts with n samples each.

    Args:
        scores, correct, answers: P lists of n values (every prompt the same n).
        ks: the k to report (each 1 <= k <= n).

    Returns:
        ``mean@{n}`` (mean score), ``pass@{k}`` for every k in ``ks`` (``pass@1`` always), ``maj@{k}``
        for every k > 1 in ``ks``, and ``prompts`` (P). Macro averages over prompts, summed with :func:`math.fsum`.

    Raises:
        ValueError: no prompt, prompts with different n, or a k outside 1..n.
    """
    P = len(scores)
    if P == 0 or len(correct) != P or len(answers) != P:
        raise ValueError(
            f"need the same P >= 1 prompts in scores, correct and answers, got {P}, {len(correct)}, {len(answers)}"
        )
    n = len(scores[0])
    if any(len(s) != n or len(c) != n or len(a) != n for s, c, a in zip(scores, correct, answers, strict=True)):
        raise ValueError("every prompt needs the same number of samples n")
    ks = sorted({1, *ks})
    out = {f"mean@{n}": math.fsum(math.fsum(s) / n for s in scores) / P}
    for k in ks:
        out[f"pass@{k}"] = math.fsum(pass_at_k(n, sum(map(bool, c)), k) for c in correct) / P
    for k in ks[1:]:
        out[f"maj@{k}"] = math.fsum(maj_at_k(a, c, k) for a, c in zip(answers, correct, strict=True)) / P
    out["prompts"] = float(P)
    return out
