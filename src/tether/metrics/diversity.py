"""Diversity and mode-collapse metrics over sampled responses.

Pure functions, no I/O, no torch: every function takes token-id sequences and returns a Python
float. They are cheap enough to run on every training step (linear in the number of tokens).

Inputs
------
``responses``
    One token-id sequence per sampled response (``list[list[int]]``, tuples, 1-D numpy arrays or
    1-D tensors are all accepted), **already stripped** of padding and EOS: every id in a sequence
    counts as a token of the response.
``group_ids``
    One hashable id per response saying which prompt it answers; the ``rollout.n`` samples of one
    prompt share an id (the batch's ``group_ids`` field). Groups need not be contiguous.
``prompts``
    One prompt token-id sequence per response (aligned with ``responses``, so a prompt sampled n
    times appears n times).

Conventions shared by every function here
-----------------------------------------
* All results lie in [0, 1] and are unitless ratios.
* A quantity with nothing to measure (an empty batch, no n-grams, no prompt with two samples) is
  reported as ``0.0`` rather than NaN, so that the value can always be logged to JSON/TensorBoard.
  The documentation of each function says exactly when this happens.
* Per-prompt values are averaged over prompts with equal weight (a macro average), and every sum
  uses :func:`math.fsum`, so results are exactly invariant to the order of responses and groups.

Errors: ``ValueError`` when aligned inputs differ in length or an order ``n``/``max_n`` is below 1;
``TypeError`` when a token id is not an integer.

Definitions are written out in ``docs/metrics.md``.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

__all__ = [
    "collapse_rate",
    "distinct_n",
    "diversity_metrics",
    "prompt_response_similarity",
    "self_bleu",
    "unique_frac",
]

Tokens = tuple[int, ...]

#: Chen & Cherry (2014) smoothing "method 1": an n-gram order with no match gets precision
#: ``SMOOTH_EPS / (number of hypothesis n-grams of that order)`` instead of 0.
SMOOTH_EPS = 0.1


# --------------------------------------------------------------------------------------------------
# input normalisation
# --------------------------------------------------------------------------------------------------
def _as_list(x: Any) -> list:
    if hasattr(x, "tolist"):  # numpy arrays, torch tensors
        x = x.tolist()
    return list(x)


def _tokens(seq: Any) -> Tokens:
    if hasattr(seq, "tolist"):
        seq = seq.tolist()
    if isinstance(seq, (str, bytes)):
        raise TypeError(f"expected a sequence of token ids, got {type(seq).__name__}")
    try:
        return tuple(operator.index(t) for t in seq)
    except TypeError as e:
        raise TypeError(f"token ids must be integers: {e}") from None


def _responses(responses: Iterable[Any]) -> list[Tokens]:
    return [_tokens(r) for r in _as_list(responses)]


def _groups(responses: list[Tokens], group_ids: Any) -> list[list[Tokens]]:
    gids = _as_list(group_ids)
    if len(gids) != len(responses):
        raise ValueError(f"got {len(responses)} responses but {len(gids)} group_ids")
    groups: dict[Hashable, list[Tokens]] = {}
    for gid, r in zip(gids, responses, strict=True):
        groups.setdefault(gid, []).append(r)
    return list(groups.values())


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def _ngrams(seq: Tokens, n: int) -> Iterable[Tokens]:
    """The n-grams of ``seq`` in order, as tuples (those of ``seq[i : i + n]``; zip builds them in C)."""
    return zip(*(seq[i:] for i in range(n)), strict=False)  # the shifted copies differ in length: stop at the shortest


# --------------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------------
def distinct_n(responses: Sequence[Sequence[int]], n: int) -> float:
    """Distinct-n: distinct n-grams divided by all n-grams in the batch's responses.

    The n-grams of every response are pooled over the whole batch (n-grams never span two
    responses); the result is ``|set of n-grams| / (number of n-gram occurrences)``, in (0, 1],
    where 1 means no n-gram repeats anywhere in the batch.

    Source: Li et al. 2016, "A Diversity-Promoting Objective Function for Neural Conversation
    Models" (NAACL). Li et al. divide by the number of generated *tokens*; we divide by the number
    of n-grams, the common variant (identical for n = 1), so that the value reaches 1 exactly when
    no n-gram repeats.

    Args:
        responses: token-id sequences, padding/EOS stripped.
        n: the n-gram order, ``n >= 1``.

    Returns:
        A float in [0, 1]; ``0.0`` when the batch has no n-gram at all (empty batch or every
        response shorter than ``n`` tokens).

    Raises:
        ValueError: ``n < 1``.  TypeError: a token id is not an integer.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return _distinct_n(_responses(responses), n)


def _distinct_n(responses: list[Tokens], n: int) -> float:
    seen: set[Tokens] = set()
    total = 0
    for r in responses:
        if len(r) >= n:
            total += len(r) - n + 1
            seen.update(_ngrams(r, n))
    return len(seen) / total if total else 0.0


def unique_frac(responses: Sequence[Sequence[int]], group_ids: Sequence[Hashable]) -> float:
    """Distinct responses among a prompt's samples divided by its number of samples, averaged over prompts.

    For a prompt with n samples of which k are distinct (exact token-sequence equality), the value
    is k / n; the batch value is the mean over prompts. Ranges over [1/n, 1]: 1 when every sample
    differs, 1/n when all n samples are identical. A prompt with a single sample scores 1 (its one
    sample is distinct) and is included in the mean; for a batch where that matters use
    :func:`collapse_rate`, which skips such prompts.

    Returns:
        A float in (0, 1]; ``0.0`` for an empty batch.

    Raises:
        ValueError: ``len(responses) != len(group_ids)``.  TypeError: a non-integer token id.
    """
    return _unique_frac(_groups(_responses(responses), group_ids))


def _unique_frac(groups: list[list[Tokens]]) -> float:
    return _mean([len(set(g)) / len(g) for g in groups])


def collapse_rate(responses: Sequence[Sequence[int]], group_ids: Sequence[Hashable]) -> float:
    """Share of prompts whose samples are all identical (mode collapse).

    Definition: among the prompts with **at least two** samples in the batch, the fraction whose
    samples are all the same token sequence (empty responses count as identical to each other).
    Prompts with a single sample are excluded from numerator and denominator: one sample cannot
    show collapse. This is a strict, all-or-nothing measure per prompt; :func:`unique_frac` and
    :func:`self_bleu` grade partial collapse.

    Returns:
        A float in [0, 1]; ``0.0`` when no prompt has two or more samples (including an empty batch).

    Raises:
        ValueError: ``len(responses) != len(group_ids)``.  TypeError: a non-integer token id.
    """
    return _collapse_rate(_groups(_responses(responses), group_ids))


def _collapse_rate(groups: list[list[Tokens]]) -> float:
    groups = [g for g in groups if len(g) >= 2]
    if not groups:
        return 0.0
    return sum(1 for g in groups if len(set(g)) == 1) / len(groups)


def _sentence_bleu_vs_rest(
    lengths: list[int],
    counts: list[list[Counter]],
    top2: list[dict[Tokens, tuple[int, int, int]]],
    i: int,
    max_n: int,
) -> float:
    """BLEU of sample ``i`` against all other samples of its group as multiple references."""
    c = lengths[i]
    ref_lengths = [L for j, L in enumerate(lengths) if j != i]
    if c == 0:
        return 1.0 if 0 in ref_lengths else 0.0
    order = min(max_n, c)  # effective order: an order with no hypothesis n-gram is left out
    log_p = 0.0
    for k in range(1, order + 1):
        matched = 0
        table = top2[k - 1]
        for g, cnt in counts[i][k - 1].items():
            best, best_owner, second = table[g]
            ref_max = second if best_owner == i else best
            matched += cnt if cnt < ref_max else ref_max  # min(cnt, ref_max), without a call per n-gram
        total = c - k + 1
        if matched == 0:
            if k == 1:  # no token in common with any other sample
                return 0.0
            log_p += math.log(SMOOTH_EPS / total)
        else:
            log_p += math.log(matched / total)
    # brevity penalty against the closest reference length (ties: the shorter one)
    r = min(ref_lengths, key=lambda L: (abs(L - c), L))
    bp = 1.0 if c >= r else math.exp(1.0 - r / c)
    return bp * math.exp(log_p / order)


def _group_self_bleu(group: list[Tokens], max_n: int) -> float:
    lengths = [len(s) for s in group]
    counts = [[Counter(_ngrams(s, k)) for k in range(1, max_n + 1)] for s in group]
    # per order, for each n-gram: (largest count, which sample has it, second largest count),
    # so that "max count over the other samples" costs O(1) per hypothesis n-gram.
    top2: list[dict[Tokens, tuple[int, int, int]]] = []
    for k in range(max_n):
        table: dict[Tokens, tuple[int, int, int]] = {}
        for j, cj in enumerate(counts):
            for g, cnt in cj[k].items():
                best, owner, second = table.get(g, (0, -1, 0))
                if cnt > best:
                    table[g] = (cnt, j, best)
                elif cnt > second:
                    table[g] = (best, owner, cnt)
        top2.append(table)
    return _mean([_sentence_bleu_vs_rest(lengths, counts, top2, i, max_n) for i in range(len(group))])


def self_bleu(responses: Sequence[Sequence[int]], group_ids: Sequence[Hashable], max_n: int = 4) -> float:
    """Self-BLEU between the samples of each prompt, averaged over prompts; 1.0 = identical samples.

    Within a prompt's group of n >= 2 samples, each sample in turn is the hypothesis and the other
    n - 1 samples are its references (Zhu et al. 2018, "Texygen: A Benchmarking Platform for Text
    Generation Models", SIGIR); the group's value is the mean of these n sentence-BLEU scores, and
    the batch value is the mean over groups. Sentence BLEU (Papineni et al. 2002) is computed on
    token ids as

        BLEU = BP * exp(mean_{k=1..N} log p_k),   N = min(max_n, len(hypothesis))

    * p_k: clipped (modified) k-gram precision, each hypothesis k-gram count clipped by its largest
      count in any single reference;
    * smoothing (Chen & Cherry 2014, method 1, as Texygen uses through NLTK): an order k >= 2 with
      no match gets p_k = 0.1 / (number of hypothesis k-grams); no unigram match at all gives 0;
    * effective order N: orders longer than the hypothesis are left out (as sacreBLEU's
      ``effective_order``), so two identical short responses score exactly 1;
    * BP = exp(1 - r/c) when the hypothesis length c is below r, the reference length closest to c
      (ties to the shorter), else 1;
    * an empty hypothesis scores 1 if another sample of its group is also empty, else 0.

    Identical samples always score exactly 1; the converse does not hold: distinct samples whose
    every n-gram occurs in another sample (e.g. ``[1,2,3,4,5]``, ``[1,2,3,4]``, ``[2,3,4,5]``) also
    score 1, as with any BLEU. :func:`unique_frac` tells such groups apart.

    Own implementation (no NLTK/sacreBLEU dependency). Whenever the hypothesis has at least
    ``max_n`` tokens the values agree to 1e-15 with NLTK 3.10's ``sentence_bleu(references,
    hypothesis, smoothing_function=SmoothingFunction().method1)`` (checked on 3000 random groups).

    Args:
        responses, group_ids: see the module docstring.
        max_n: the largest n-gram order, ``>= 1`` (4 is standard BLEU).

    Returns:
        A float in [0, 1]; ``0.0`` when no prompt has two or more samples. Prompts with a single
        sample are skipped.

    Raises:
        ValueError: ``max_n < 1`` or ``len(responses) != len(group_ids)``.  TypeError: a
        non-integer token id.
    """
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}")
    return _self_bleu(_groups(_responses(responses), group_ids), max_n)


def _self_bleu(groups: list[list[Tokens]], max_n: int) -> float:
    return _mean([_group_self_bleu(g, max_n) for g in groups if len(g) >= 2])


def prompt_response_similarity(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> float:
    """Mean unigram F1 overlap between each prompt and its response (how much a response echoes its prompt).

    For a prompt p and response r seen as multisets of token ids, with
    ``overlap = sum_t min(count_p(t), count_r(t))``, precision = overlap/|r|, recall = overlap/|p|
    and F1 = 2 * overlap / (|p| + |r|) (the SQuAD-style token F1 of Rajpurkar et al. 2016, on ids).
    The batch value is the mean over (prompt, response) pairs. 1 means the response is a
    permutation of the prompt's tokens, 0 that they share no token. Chat-template tokens left in
    the prompt ids count like any other token.

    Args:
        prompts: one prompt token-id sequence per response (aligned), padding stripped.
        responses: token-id sequences, padding/EOS stripped.

    Returns:
        A float in [0, 1]; a pair where both sides are empty scores 0; ``0.0`` for an empty batch.

    Raises:
        ValueError: ``len(prompts) != len(responses)``.  TypeError: a non-integer token id.
    """
    return _prompt_response_similarity(_responses(prompts), _responses(responses))


def _prompt_response_similarity(ps: list[Tokens], rs: list[Tokens]) -> float:
    if len(ps) != len(rs):
        raise ValueError(f"got {len(ps)} prompts but {len(rs)} responses")
    scores = []
    for p, r in zip(ps, rs, strict=True):
        denom = len(p) + len(r)
        overlap = sum((Counter(p) & Counter(r)).values())
        scores.append(2.0 * overlap / denom if denom else 0.0)
    return _mean(scores)


def diversity_metrics(
    responses: Sequence[Sequence[int]],
    group_ids: Sequence[Hashable],
    prompts: Sequence[Sequence[int]] | None = None,
) -> dict[str, float]:
    """All diversity metrics of one batch, under their logged names.

    Returns a dict with exactly the keys ``diversity/distinct_1``, ``diversity/distinct_2``,
    ``diversity/unique_frac``, ``diversity/collapse_rate``, ``diversity/self_bleu`` (max_n = 4),
    and ``diversity/prompt_response_sim`` when ``prompts`` is given (one prompt per response).
    Raises as the individual functions do.
    """
    rs = _responses(responses)  # validated once; the metrics below share it and the groups
    groups = _groups(rs, group_ids)
    out = {
        "diversity/distinct_1": _distinct_n(rs, 1),
        "diversity/distinct_2": _distinct_n(rs, 2),
        "diversity/unique_frac": _unique_frac(groups),
        "diversity/collapse_rate": _collapse_rate(groups),
        "diversity/self_bleu": _self_bleu(groups, 4),
    }
    if prompts is not None:
        out["diversity/prompt_response_sim"] = _prompt_response_similarity(_responses(prompts), rs)
    return out
