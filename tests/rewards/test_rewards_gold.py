"""tether.rewards.GoldReward: the gold reward of validation (reward.val_function / reward.val_model, else
the built-in gold of a row's data_source in GOLD_FUNCTIONS, else none), and its failures counted, never raised."""

from __future__ import annotations

import pytest

from tether.data import PromptRow
from tether.rewards import GOLD_FUNCTIONS, GoldReward, RewardManager


def _rows(n, ds="tether/digitsum", gt="3,6", **kw):
    return [
        PromptRow(prompt=f"q{i}", data_source=ds, ground_truth=gt, extra_info={"i": i}, index=i, **kw) for i in range(n)
    ]


def _fn(tmp_path, body, name="gold"):
    f = tmp_path / f"{name}.py"
    f.write_text(body)
    return f"{f}:{name}"


CONST = "def gold(data_sources, solution_strs, ground_truths, extra_infos):\n    return [0.25] * len(solution_strs)\n"
# 1 for a response that starts with '1', raises on one that starts with '9'
FLAKY = (
    "from tether.rewards import batched\n@batched\ndef gold(data_source, solution_str, ground_truth, extra_info):\n    "
    "if solution_str.startswith('9'):\n        raise RuntimeError('cannot judge a 9')\n    return "
    "float(solution_str.startswith('1'))\n"
)


def test_a_user_gold_scores_every_row(tmp_path):
    gold = GoldReward(_fn(tmp_path, CONST))
    res = gold(_rows(2) + _rows(1, ds="my/other"), ["p"] * 3, ["123", "456", "x"])
    assert (
        res.covered == [True] * 3
        and res.scored == [True] * 3
        and res.scores == [0.25] * 3
        and res.errors == []
        and res.unscored == 0
    )
    assert gold.covers("anything") and gold.name().startswith("reward.val_function ")


def test_a_gold_that_raises_on_some_samples_counts_them_and_does_not_raise(tmp_path):
    gold = GoldReward(_fn(tmp_path, FLAKY))
    res = gold(_rows(4), ["p"] * 4, ["123", "923", "456", "9"])
    assert res.scored == [True, False, True, False] and res.scores == [1.0, 0.0, 0.0, 0.0] and res.unscored == 2
    assert any(e.startswith("sample 1: RuntimeError: cannot judge a 9") for e in res.errors)
    assert any(e.startswith("sample 3: RuntimeError") for e in res.errors)


def test_a_gold_that_breaks_the_manager_itself_marks_the_batch_unscored(tmp_path, monkeypatch):
    gold = GoldReward(_fn(tmp_path, CONST))
    monkeypatch.setattr(RewardManager, "__call__", lambda *a: 1 / 0)
    res = gold(_rows(3), ["p"] * 3, ["1", "2", "3"])
    assert res.scored == [False] * 3 and res.unscored == 3 and "ZeroDivisionError" in res.errors[0]


def test_a_gold_past_reward_timeout_s_counts_its_samples_unscored(tmp_path):
    slow = (
        "import time\ndef gold(data_sources, solution_strs, ground_truths, extra_infos):\n    time.sleep(3)\n    "
        "return [1.0] * len(solution_strs)\n"
    )
    res = GoldReward(_fn(tmp_path, slow), timeout_s=0.05)(_rows(2), ["p"] * 2, ["1", "2"])
    assert res.unscored == 2 and "reward.timeout_s" in res.errors[0]


def test_builtin_gold_covers_only_registered_sources_and_ignores_dataset_scores(monkeypatch):
    gold = GoldReward()
    assert gold(_rows(2), ["p"] * 2, ["1", "2"]) is None  # no source has a gold: nothing to report
    monkeypatch.setitem(GOLD_FUNCTIONS, "test/proxy", "tether.tasks.digitsum:compute_score")
    rows = _rows(2, ds="test/proxy", gt={"k": 3, "s": 6}, response="123", score=0.0) + _rows(1, ds="tether/digitsum")
    res = gold(rows, ["3,6="] * 3, ["123", "124", "123"])
    assert res.covered == [True, True, False] and res.scored == [True, True, False]
    assert res.scores == [1.0, 0.0, 0.0]  # the verifier's 1.0, not the dataset's score 0.0 for the row's own response
    assert (
        gold.check_rows(rows) == ["test/proxy"]
        and gold.name("test/proxy") == "built-in gold tether.tasks.digitsum:compute_score"
    )
    assert gold.name("tether/digitsum") == "none"
    monkeypatch.setitem(GOLD_FUNCTIONS, "test/broken", "no.such.module:fn")
    with pytest.raises(ValueError, match="no.such.module"):
        gold.check_rows(_rows(1, ds="test/broken"))


def test_loading_errors_name_the_gold_keys(tmp_path):
    with pytest.raises(ValueError, match=r"reward.val_function='a.py:f' and reward.val_model='/m' are both set"):
        GoldReward("a.py:f", "/m")
    with pytest.raises(ValueError, match=r"reward function file not found: .*missing.py \(from reward.val_function="):
        GoldReward(f"{tmp_path}/missing.py:gold")
    per_sample = "def gold(data_source, solution_str, ground_truth, judge):\n    return 1.0\n"
    with pytest.raises(ValueError, match=r"^reward.val_function=.*a per-sample function .*'judge'"):
        GoldReward(_fn(tmp_path, per_sample))
    with pytest.raises(ValueError, match=r"^reward.val_function=.*has no 'nope'"):
        GoldReward(_fn(tmp_path, CONST).rsplit(":", 1)[0] + ":nope")
    with pytest.raises(ValueError, match=r"^reward.val_model="):
        GoldReward(reward_model=str(tmp_path))


def test_a_reward_model_gold_scores_raw_logits(tmp_path):
    """reward.val_model: the gold is the reward model's logit on prompt + response, as returned (the gold is not
    clipped: val/gold_mean reads raw scores, as val/score_mean reads the training reward's)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tether.testing import build_gsm8k_tokenizer, build_tiny_reward_model

    rm = build_tiny_reward_model(tmp_path / "rm", build_gsm8k_tokenizer(tmp_path / "tok"))
    model = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    with torch.no_grad():
        model.score.weight.mul_(1000.0)  # logits far outside reward.model's default clip [-2, 2]
    model.save_pretrained(tmp_path / "big")
    AutoTokenizer.from_pretrained(rm).save_pretrained(tmp_path / "big")
    gold = GoldReward(reward_model=str(tmp_path / "big"))
    assert gold.name() == f"reward.val_model {tmp_path / 'big'}" and gold.covers("any/source")
    prompts, responses = ["3,6=", "3,11="], ["123", "911"]
    res = gold(_rows(2), prompts, responses)
    tok = AutoTokenizer.from_pretrained(tmp_path / "big")
    with torch.no_grad():
        want = [
            model(**tok(p + r, return_tensors="pt")).logits[0, 0].item()
            for p, r in zip(prompts, responses, strict=True)
        ]
    assert res.scored == [True, True] and res.scores == pytest.approx(want, rel=1e-5) and max(map(abs, want)) > 2
