"""Diversity metrics: hand-worked values, edge cases, invariances and properties."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.metrics import (
    collapse_rate,
    distinct_n,
    diversity_metrics,
    prompt_response_similarity,
    self_bleu,
    unique_frac,
)

TOL = dict(rel=1e-12, abs=1e-15)


# ------------------------------------------------------------------------------------------------
# distinct-n
# ------------------------------------------------------------------------------------------------
def test_distinct_n_hand_worked():
    rs = [[1, 2, 3], [1, 2, 4]]
    # unigrams 1 2 3 1 2 4: distinct {1,2,3,4} = 4 of 6
    assert distinct_n(rs, 1) == pytest.approx(4 / 6, **TOL)
    # bigrams (1,2) (2,3) (1,2) (2,4): distinct 3 of 4
    assert distinct_n(rs, 2) == pytest.approx(3 / 4, **TOL)
    # trigrams (1,2,3) (1,2,4): both distinct
    assert distinct_n(rs, 3) == 1.0
    # no response has 4 tokens: no 4-gram at all -> 0.0 by convention
    assert distinct_n(rs, 4) == 0.0


def test_distinct_n_ngrams_do_not_span_responses():
    # joined, [1,2][3] would contain the bigram (2,3) twice if n-grams spanned responses
    rs = [[2, 3], [2], [3]]
    # bigrams: only (2,3) -> 1 of 1
    assert distinct_n(rs, 2) == 1.0
    # unigrams 2 3 2 3: 2 of 4
    assert distinct_n(rs, 1) == 0.5


def test_distinct_n_edge_cases():
    assert distinct_n([], 1) == 0.0
    assert distinct_n([[], []], 1) == 0.0
    assert distinct_n([[], [5]], 1) == 1.0  # one unigram, distinct
    assert distinct_n([[7, 7, 7, 7]], 1) == 0.25
    assert distinct_n([[7, 7, 7, 7]], 2) == pytest.approx(1 / 3, **TOL)  # (7,7) x3
    with pytest.raises(ValueError, match="n must be >= 1"):
        distinct_n([[1]], 0)


def test_accepts_tuples_numpy_and_tensors():
    expect = distinct_n([[1, 2, 3], [1, 2, 4]], 2)
    assert distinct_n([(1, 2, 3), (1, 2, 4)], 2) == expect
    assert distinct_n([np.array([1, 2, 3]), np.array([1, 2, 4])], 2) == expect
    assert distinct_n([torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])], 2) == expect
    # group ids as a tensor must group by value, not by tensor identity
    assert collapse_rate([[1], [1]], torch.tensor([3, 3])) == 1.0
    with pytest.raises(TypeError, match="integers"):
        distinct_n([[1.5, 2.0]], 1)
    with pytest.raises(TypeError):
        distinct_n(["abc"], 1)


# ------------------------------------------------------------------------------------------------
# unique_frac and collapse_rate
# ------------------------------------------------------------------------------------------------
def test_unique_frac_hand_worked():
    rs = [[1], [1], [2], [3], [3]]
    gids = [0, 0, 0, 1, 1]
    # group 0: {[1],[2]} of 3 -> 2/3; group 1: {[3]} of 2 -> 1/2; mean = 7/12
    assert unique_frac(rs, gids) == pytest.approx(7 / 12, **TOL)


def test_unique_frac_edge_cases():
    assert unique_frac([], []) == 0.0
    assert unique_frac([[4, 2]], [9]) == 1.0  # single sample: distinct
    # single-sample prompt counts in the mean: (1/2 + 1) / 2
    assert unique_frac([[1], [1], [5]], [0, 0, 1]) == 0.75
    assert unique_frac([[], []], [0, 0]) == 0.5  # two empty responses are identical
    with pytest.raises(ValueError, match="2 responses but 1 group_ids"):
        unique_frac([[1], [2]], [0])


def test_collapse_rate_hand_worked():
    a, b, c = [1, 2], [1, 3], [4]
    rs = [a, a, a, b, c, [], []]
    gids = [0, 0, 1, 1, 2, 3, 3]
    # g0 [a,a] collapsed; g1 [a,b] not; g2 [c] single -> excluded; g3 [[],[]] collapsed
    # -> 2 of 3 eligible prompts
    assert collapse_rate(rs, gids) == pytest.approx(2 / 3, **TOL)


def test_collapse_rate_edge_cases():
    assert collapse_rate([], []) == 0.0
    assert collapse_rate([[1], [2]], [0, 1]) == 0.0  # only single-sample prompts: nothing eligible
    assert collapse_rate([[1], [1], [1]], [0, 0, 0]) == 1.0
    assert collapse_rate([[1], [1], [2]], [0, 0, 0]) == 0.0  # partial collapse is not collapse
    with pytest.raises(ValueError):
        collapse_rate([[1]], [0, 0])


# ------------------------------------------------------------------------------------------------
# self-BLEU
# ------------------------------------------------------------------------------------------------
def test_self_bleu_two_samples_hand_worked():
    # h1 = 1 2 3 4, h2 = 1 2 3 5; each is the other's only reference (symmetric).
    # p1 = 3/4, p2 = 2/3 ((1,2),(2,3) match), p3 = 1/2 ((1,2,3) matches),
    # p4: no match -> smoothed 0.1 / 1; BP = 1 (equal lengths)
    # BLEU = (3/4 * 2/3 * 1/2 * 0.1) ** (1/4) = 0.025 ** 0.25
    rs = [[1, 2, 3, 4], [1, 2, 3, 5]]
    assert self_bleu(rs, [0, 0]) == pytest.approx(0.025**0.25, **TOL)


def test_self_bleu_effective_order_and_brevity_penalty():
    # hyp [7,8] vs ref [7,8,9]: order 2; p1 = 1, p2 = 1; c = 2 < r = 3 -> BP = exp(1 - 3/2)
    # hyp [7,8,9] vs ref [7,8]: order 3; p1 = 2/3, p2 = 1/2, p3 = 0.1/1 (smoothed); c > r -> BP = 1
    rs = [[7, 8], [7, 8, 9]]
    expect = (math.exp(-0.5) + (2 / 3 * 1 / 2 * 0.1) ** (1 / 3)) / 2
    assert self_bleu(rs, [0, 0]) == pytest.approx(expect, **TOL)


def test_self_bleu_clips_by_the_max_over_references_not_the_sum():
    # max_n = 1. hyp [1,1] vs refs {[1],[1]}: token 1 clipped to max(1,1) = 1 -> p1 = 1/2
    # (summing over references would give 2/2). c = 2, closest ref length 1 -> BP = 1. -> 0.5
    # hyp [1] vs refs {[1,1],[1]}: p1 = 1, closest ref length 1 -> BP = 1. -> 1.0 (twice)
    rs = [[1, 1], [1], [1]]
    assert self_bleu(rs, [0, 0, 0], max_n=1) == pytest.approx((0.5 + 1 + 1) / 3, **TOL)


def test_self_bleu_tied_max_count_excludes_only_the_hypothesis_itself():
    # max_n = 1. [1,1] twice: each sees the other's count 2 -> p1 = 1, ref lengths {2,1},
    # closest 2 -> BP = 1 -> 1.0 each. hyp [1]: refs lengths {2,2} -> BP = exp(1 - 2) -> e^-1.
    rs = [[1, 1], [1, 1], [1]]
    assert self_bleu(rs, [5, 5, 5], max_n=1) == pytest.approx((2 + math.exp(-1)) / 3, **TOL)


def test_self_bleu_brevity_reference_ties_go_to_the_shorter():
    # max_n = 1
    # hyp [1,2,3] (c=3), refs lengths {2,4}: tie -> r = 2 -> BP = 1; p1 = 1 -> 1.0
    #   (a tie going to 4 would give exp(1 - 4/3))
    # hyp [1,2] (c=2), refs lengths {3,4}: r = 3 -> BP = exp(-1/2); p1 = 1
    # hyp [1,2,3,4] (c=4), refs lengths {3,2}: r = 3 -> BP = 1; p1 = 3/4
    rs = [[1, 2, 3], [1, 2], [1, 2, 3, 4]]
    assert self_bleu(rs, [0, 0, 0], max_n=1) == pytest.approx((1 + math.exp(-0.5) + 0.75) / 3, **TOL)


def test_self_bleu_no_shared_token_is_zero():
    assert self_bleu([[1, 2, 3, 4], [5, 6, 7, 8]], [0, 0]) == 0.0


def test_self_bleu_matches_nltk_reference_values():
    # Reference values from nltk 3.10.4:
    #   mean_i sentence_bleu([others], group[i], smoothing_function=SmoothingFunction().method1)
    group = [[3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 5, 8, 2, 6, 5], [2, 7, 1, 8, 2, 8]]
    assert self_bleu(group, [0, 0, 0]) == pytest.approx(0.38290669072357925, rel=1e-12)


def test_self_bleu_empty_and_single_sample_groups():
    # hyp [] with another empty sample -> 1 (twice); hyp [3] vs {[],[]}: no unigram match -> 0
    assert self_bleu([[], [], [3]], [0, 0, 0]) == pytest.approx(2 / 3, **TOL)
    assert self_bleu([[], [3]], [0, 0]) == 0.0
    # single-sample groups are skipped: only group 1 counts (identical -> 1)
    assert self_bleu([[1, 2], [5], [5]], [0, 1, 1]) == 1.0
    assert self_bleu([[1, 2], [5]], [0, 1]) == 0.0  # nothing to compare
    assert self_bleu([], []) == 0.0
    with pytest.raises(ValueError, match="max_n"):
        self_bleu([[1], [1]], [0, 0], max_n=0)


def test_self_bleu_averages_groups_equally():
    # group 0 identical (1.0), group 1 disjoint (0.0), group 1 has more samples
    rs = [[1, 2], [1, 2], [3], [4], [5]]
    assert self_bleu(rs, [0, 0, 1, 1, 1]) == 0.5


# ------------------------------------------------------------------------------------------------
# prompt-response similarity
# ------------------------------------------------------------------------------------------------
def test_prompt_response_similarity_hand_worked():
    # p = 1 2 2 3, r = 2 2 4: overlap = min(2,2) for token 2 = 2; F1 = 2*2 / (4+3) = 4/7
    # p = 5, r = 6: 0.  p = [], r = []: 0 by convention.  mean = 4/21
    prompts = [[1, 2, 2, 3], [5], []]
    responses = [[2, 2, 4], [6], []]
    assert prompt_response_similarity(prompts, responses) == pytest.approx(4 / 21, **TOL)
    assert prompt_response_similarity([[1, 2, 3]], [[3, 2, 1]]) == 1.0
    assert prompt_response_similarity([], []) == 0.0
    with pytest.raises(ValueError, match="1 prompts but 2 responses"):
        prompt_response_similarity([[1]], [[1], [2]])


# ------------------------------------------------------------------------------------------------
# diversity_metrics
# ------------------------------------------------------------------------------------------------
def test_diversity_metrics_keys_and_values():
    rs = [[1, 2, 3, 4], [1, 2, 3, 5], [6], [6]]
    gids = [0, 0, 1, 1]
    m = diversity_metrics(rs, gids)
    assert set(m) == {
        "diversity/distinct_1",
        "diversity/distinct_2",
        "diversity/unique_frac",
        "diversity/collapse_rate",
        "diversity/self_bleu",
    }
    # unigrams: 1 2 3 4 1 2 3 5 6 6 -> {1..6} = 6 of 10
    assert m["diversity/distinct_1"] == pytest.approx(0.6, **TOL)
    # bigrams: (1,2)(2,3)(3,4)(1,2)(2,3)(3,5) -> 4 of 6
    assert m["diversity/distinct_2"] == pytest.approx(4 / 6, **TOL)
    assert m["diversity/unique_frac"] == pytest.approx((1 + 0.5) / 2, **TOL)
    assert m["diversity/collapse_rate"] == 0.5
    assert m["diversity/self_bleu"] == pytest.approx((0.025**0.25 + 1) / 2, **TOL)
    m2 = diversity_metrics(rs, gids, prompts=[[1, 9], [1, 9], [6], [7]])
    # F1: [1,9] vs 1234 -> 2/6; vs 1235 -> 2/6; [6] vs [6] -> 1; [7] vs [6] -> 0; mean = (2/3 + 1)/4
    assert m2["diversity/prompt_response_sim"] == pytest.approx((2 / 3 + 1) / 4, **TOL)
    assert {k: v for k, v in m2.items() if k != "diversity/prompt_response_sim"} == m


# ------------------------------------------------------------------------------------------------
# invariances and properties
# ------------------------------------------------------------------------------------------------
def _random_batch(rng: random.Random, n_groups: int, n: int, vocab: int, max_len: int):
    rs, gids = [], []
    for g in range(n_groups):
        for _ in range(n):
            rs.append([rng.randrange(vocab) for _ in range(rng.randint(0, max_len))])
            gids.append(g)
    return rs, gids


def test_diversity_metrics_equals_each_metric_bit_for_bit():
    """diversity_metrics validates the tokens and builds the groups once for all its metrics (per-step
    overhead, issue 13): every value is exactly that of the metric's own public function."""
    rng = random.Random(3)
    for _ in range(30):
        rs, gids = _random_batch(rng, rng.randint(1, 6), rng.randint(1, 8), rng.choice([3, 50]), 12)
        prompts = [[rng.randrange(50) for _ in range(rng.randint(0, 6))] for _ in rs]
        assert diversity_metrics(rs, gids, prompts=prompts) == {
            "diversity/distinct_1": distinct_n(rs, 1),
            "diversity/distinct_2": distinct_n(rs, 2),
            "diversity/unique_frac": unique_frac(rs, gids),
            "diversity/collapse_rate": collapse_rate(rs, gids),
            "diversity/self_bleu": self_bleu(rs, gids, max_n=4),
            "diversity/prompt_response_sim": prompt_response_similarity(prompts, rs),
        }


def test_ngrams_are_the_slices():
    from tether.metrics.diversity import _ngrams

    seq = (5, 1, 5, 1, 2, 9, 9)
    for n in range(1, 9):
        assert list(_ngrams(seq, n)) == [seq[i : i + n] for i in range(len(seq) - n + 1)]


def test_invariant_to_response_order_and_group_labels():
    rng = random.Random(0)
    rs, gids = _random_batch(rng, n_groups=6, n=4, vocab=3, max_len=6)
    prompts = [[rng.randrange(3) for _ in range(3)] for _ in rs]
    base = diversity_metrics(rs, gids, prompts)
    order = list(range(len(rs)))
    for _ in range(5):
        rng.shuffle(order)
        relabel = {g: f"prompt-{(7 * g) % 11}" for g in set(gids)}
        m = diversity_metrics([rs[i] for i in order], [relabel[gids[i]] for i in order], [prompts[i] for i in order])
        assert m == base  # exact: sets and math.fsum make the order irrelevant


token_seqs = st.lists(st.integers(0, 4), max_size=7)


@st.composite
def batches(draw):
    n_groups = draw(st.integers(0, 5))
    rs, gids = [], []
    for g in range(n_groups):
        k = draw(st.integers(1, 5))
        rs += draw(st.lists(token_seqs, min_size=k, max_size=k))
        gids += [g] * k
    return rs, gids


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(1, 4))
def test_all_metrics_in_unit_interval(batch, max_n):
    rs, gids = batch
    values = [
        distinct_n(rs, 1),
        distinct_n(rs, 2),
        unique_frac(rs, gids),
        collapse_rate(rs, gids),
        self_bleu(rs, gids, max_n=max_n),
        prompt_response_similarity(rs[::-1], rs),
    ]
    for v in values:
        assert 0.0 <= v <= 1.0


@settings(max_examples=100, deadline=None)
@given(st.lists(token_seqs, min_size=1, max_size=5), st.integers(2, 6), st.integers(1, 4))
def test_identical_samples(distinct_prompts, n, max_n):
    # every prompt's n samples are the same sequence (which may be empty or shorter than max_n)
    rs = [seq for seq in distinct_prompts for _ in range(n)]
    gids = [g for g in range(len(distinct_prompts)) for _ in range(n)]
    assert unique_frac(rs, gids) == pytest.approx(1 / n, **TOL)
    assert collapse_rate(rs, gids) == 1.0
    assert self_bleu(rs, gids, max_n=max_n) == 1.0


@settings(max_examples=100, deadline=None)
@given(st.lists(token_seqs, min_size=2, max_size=6, unique_by=tuple))
def test_all_distinct_samples(group):
    gids = [0] * len(group)
    assert unique_frac(group, gids) == 1.0
    assert collapse_rate(group, gids) == 0.0


def test_self_bleu_of_one_does_not_imply_identical_samples():
    # A documented limitation of BLEU: every n-gram (n <= 4) of each sample occurs in another
    # sample and a reference length <= the hypothesis length exists, so each scores 1
    # (nltk 3.10.4 method1 also gives [1.0, 1.0, 1.0]); unique_frac tells them apart.
    rs = [[1, 2, 3, 4, 5], [1, 2, 3, 4], [2, 3, 4, 5]]
    assert self_bleu(rs, [0, 0, 0]) == 1.0
    assert unique_frac(rs, [0, 0, 0]) == 1.0
