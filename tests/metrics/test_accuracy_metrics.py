"""pass@k (Chen et al. 2021), maj@k and mean@n: hand-worked values, a brute force over subsets, ties."""

from __future__ import annotations

import itertools

import pytest

from tether.metrics.accuracy import accuracy_metrics, default_ks, maj_at_k, majority_vote, parse_ks, pass_at_k


@pytest.mark.parametrize(("k", "want"), [(1, 2 / 5), (2, 7 / 10), (3, 9 / 10), (4, 1.0), (5, 1.0)])
def test_pass_at_k_n5_c2_by_hand(k, want):
    # 1 - C(3,k)/C(5,k): C(3,1)/C(5,1) = 3/5, C(3,2)/C(5,2) = 3/10, C(3,3)/C(5,3) = 1/10, C(3,4) = 0
    assert pass_at_k(5, 2, k) == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_brute_force_over_subsets(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_majority_vote_ties_go_to_the_first_answer():
    assert majority_vote(["7", "3", "3", "7"]) == 0  # 2-2 tie: "7" appears first
    assert majority_vote(["3", "7", "7", "3"]) == 0
    assert majority_vote([None, "3", "7", "7"]) == 2  # "7" twice beats "3" once; its first occurrence
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


def test_maj_at_k_blocks_and_unanswered_samples():
    answers = ["5", "5", "4", None, None, None, "4", "9"]
    correct = [True, True, False, False, False, False, False, False]
    # k=8: "5" x2 vs "4" x2 tie -> "5" (first), correct
    assert maj_at_k(answers, correct, 8) == 1.0
    # k=4: block 1 ["5","5","4",None] -> "5" correct; block 2 [None,None,"4","9"] -> tie, "4" first: wrong
    assert maj_at_k(answers, correct, 4) == 0.5
    # k=2: blocks ["5","5"] ok, ["4",None] wrong, [None,None] no vote, ["4","9"] -> "4" wrong
    assert maj_at_k(answers, correct, 2) == 0.25
    # k=1 is pass@1 whenever every sample has an answer; a sample without one counts wrong
    assert maj_at_k(answers, correct, 1) == 2 / 8
    # k=3: 2 blocks (the last 2 samples are unused): ["5","5","4"] ok, [None,None,None] no vote
    assert maj_at_k(answers, correct, 3) == 0.5


def test_accuracy_metrics_macro_average():
    scores = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    correct = [[s >= 0.5 for s in row] for row in scores]
    answers = [["1", "2", "2", "1"], ["3", "3", None, "4"]]
    m = accuracy_metrics(scores, correct, answers, [1, 2, 4])
    assert m["mean@4"] == 0.25 and m["pass@1"] == 0.25 and m["prompts"] == 2.0
    assert m["pass@2"] == pytest.approx((1 - 1 / 6) / 2)  # prompt 1: 1 - C(2,2)/C(4,2) = 5/6
    assert m["pass@4"] == 0.5
    assert m["maj@4"] == 0.5  # prompt 1: "1"/"2" tie -> "1" correct; prompt 2: "3" wrong
    assert m["maj@2"] == 0.25  # prompt 1 blocks ["1","2"] -> "1" ok, ["2","1"] -> "2" wrong
    assert "maj@1" not in m  # a vote of one is pass@1 on the answered samples


def test_ks_parsing_and_defaults():
    assert default_ks(16) == [1, 2, 4, 8, 16] and default_ks(5) == [1, 2, 4, 5] and default_ks(1) == [1]
    assert parse_ks("1,4,16", 16) == (16, [1, 4, 16])
    assert parse_ks("4", None) == (4, [4])
    assert parse_ks(None, 3) == (3, [1, 2, 3])
    with pytest.raises(ValueError, match="exceeds n=4"):
        parse_ks("1,8", 4)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_ks("1;4", 4)
    with pytest.raises(ValueError, match=">= 1"):
        parse_ks("0,1", 4)
