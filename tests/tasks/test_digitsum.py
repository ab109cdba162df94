"""The digit-sum task: reward, prompts, dataset rows."""

import pytest

from tether.tasks import digitsum
from tether.tasks.digitsum import DATA_SOURCE, compute_score, make_dataset


@pytest.mark.parametrize(
    "response, gt, expected",
    [
        ("490", "3,13", 1.0),
        ("085", "3,13", 1.0),  # leading zeros are digits like any other
        ("  490\n", "3,13", 1.0),  # surrounding whitespace is tolerated
        ("4 9 0", "3,13", 0.0),  # inner whitespace is not
        ("491", "3,13", 0.0),  # wrong sum
        ("49", "3,13", 0.0),  # too short
        ("4900", "3,13", 0.0),  # too long, right sum
        ("49a", "3,13", 0.0),
        ("", "3,13", 0.0),
        ("-49", "3,13", 0.0),
        ("٤٩٠", "3,13", 0.0),  # non-ASCII digits do not count
        ("000", "3,0", 1.0),
        ("999", {"k": 3, "s": 27}, 1.0),
        ("13", (2, 4), 1.0),
        ("13", [2, 5], 0.0),
    ],
)
def test_compute_score_cases(response, gt, expected):
    assert compute_score(response, gt) == expected
    assert compute_score(response, gt, {"k": 3}) == expected


def test_compute_score_errors():
    with pytest.raises(TypeError, match="solution_str"):
        compute_score(None, "3,13")
    for bad in ["3", "3;13", "a,b", {"k": 3}, 7, (1, 2, 3)]:
        with pytest.raises(ValueError, match="ground_truth"):
            compute_score("490", bad)


def test_counts_and_valid_answers():
    assert digitsum.count_valid(3, 13) == 75
    assert digitsum.count_valid(3, 4) == digitsum.count_valid(3, 23) == 15
    assert sum(digitsum.count_valid(3, s) for s in range(28)) == 1000
    assert digitsum.count_valid(3, 28) == 0
    ans = digitsum.valid_answers(3, 4)
    assert len(ans) == 15 and ans[0] == "004" and ans[-1] == "400"
    assert all(compute_score(a, "3,4") == 1.0 for a in ans)


def test_prompt_round_trip():
    assert digitsum.make_prompt(3, 13) == "3,13="
    assert digitsum.parse_prompt("3,13=") == (3, 13)
    assert digitsum.parse_prompt(" 3 , 13 = ") == (3, 13)
    with pytest.raises(ValueError, match="prompt"):
        digitsum.parse_prompt("<s>3,13=")
    with pytest.raises(ValueError, match="s must be"):
        digitsum.make_prompt(3, 28)
    with pytest.raises(ValueError, match="k must be"):
        digitsum.make_prompt(0, 0)
    assert digitsum.MAX_NEW_TOKENS == digitsum.max_new_tokens_for(3) == 4


def test_dataset_schema_and_splits():
    train, val, every = make_dataset("train"), make_dataset("val"), make_dataset("all")
    assert len(train) == 16 and len(val) == 4 and len(every) == 20
    s_train = {r["extra_info"]["s"] for r in train}
    s_val = {r["extra_info"]["s"] for r in val}
    assert not s_train & s_val and s_train | s_val == set(range(4, 24))
    for i, row in enumerate(train):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == DATA_SOURCE == "tether/digitsum"
        assert row["ability"] == "arithmetic"
        assert row["reward_model"]["style"] == "rule"
        k, s = row["extra_info"]["k"], row["extra_info"]["s"]
        assert row["prompt"] == f"{k},{s}=" and row["reward_model"]["ground_truth"] == f"{k},{s}"
        assert row["extra_info"]["index"] == i and row["extra_info"]["split"] == "train"
        assert digitsum.parse_ground_truth(row["reward_model"]["ground_truth"]) == (k, s)


def test_dataset_n_is_balanced_and_seeded():
    rows = make_dataset("train", n=40, seed=3)
    assert len(rows) == 40 and [r["extra_info"]["index"] for r in rows] == list(range(40))
    counts = {}
    for r in rows:
        counts[r["extra_info"]["s"]] = counts.get(r["extra_info"]["s"], 0) + 1
    assert len(counts) == 16 and set(counts.values()) <= {2, 3}
    assert rows == make_dataset("train", n=40, seed=3)
    assert rows != make_dataset("train", n=40, seed=4)


def test_dataset_errors_and_other_k():
    with pytest.raises(ValueError, match="split"):
        make_dataset("test")
    with pytest.raises(ValueError, match="n must be"):
        make_dataset("train", n=0)
    rows = make_dataset("all", k=2, s_range=(2, 16))
    assert [r["prompt"] for r in rows][:2] == ["2,2=", "2,3="]
    assert {r["extra_info"]["s"] for r in make_dataset("val", k=2, s_range=(2, 16))} == {4, 9, 14}
    with pytest.raises(ValueError, match="s must be"):
        make_dataset("all", k=2, s_range=(2, 19))
