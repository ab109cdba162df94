"""The gold reward of validation (issue 23 item 1): reward.val_function / reward.val_model, else a data source's
built-in gold (GOLD_FUNCTIONS), scoring the same sampled validation responses: val/gold_mean, val/gold_gap,
val/gold_sem, val/gold_unscored_frac, val/gold_pass@k (and per data source); guard.rollback_metric=gold."""

from __future__ import annotations

import json
import logging

import pytest

from tether.config import ConfigError, load_config
from tether.rewards import GOLD_FUNCTIONS

CONST = "def gold(data_sources, solution_strs, ground_truths, extra_infos):\n    return [0.25] * len(solution_strs)\n"
# the gold of the brief: 1 for a response that starts with '1', else 0
STARTS_WITH_1 = (
    "def gold(data_sources, solution_strs, ground_truths, extra_infos):\n    return [float(s.startswith('1')) for s in "
    "solution_strs]\n"
)
# raises on every response that starts with an even digit (retried sample by sample by the manager, those counted)
FLAKY = (
    "from tether.rewards import batched\n@batched\ndef gold(data_source, solution_str, ground_truth, extra_info):\n    "
    "if solution_str[:1] in '02468':\n        raise RuntimeError('cannot judge this one')\n    return 1.0\n"
)
ALWAYS_ONE = (
    "def reward(data_sources, solution_strs, ground_truths, extra_infos):\n    return [1.0] * len(solution_strs)\n"
)


def _fn(tmp_path, body, name="gold"):
    f = tmp_path / f"{name}.py"
    f.write_text(body)
    return f"{f}:{name}"


def _trainer(small_cfg, *overrides, out=None):
    from tether.trainer import Trainer

    return Trainer(small_cfg("trainer.report=false", *overrides, out=out))


def _samples(t, n=2):
    """The validation prompts' greedy samples with their records (score, gold, ...), and the metrics."""
    from tether.evaluation.sampled import evaluate_prompts

    samples: list[dict] = []
    m = evaluate_prompts(
        t.roles.engine,
        t.roles.reward,
        t.val_set,
        n=n,
        batch_size=8,
        samples=samples,
        gold=t.roles.gold,
        do_sample=False,
    )
    return m, samples


def test_a_constant_gold_gives_exact_metrics_on_the_embedded_task(small_cfg, tmp_path):
    t = _trainer(small_cfg, f"reward.val_function={_fn(tmp_path, CONST)}")
    m = t.maybe_validate(force=True)
    assert m["val/gold_mean"] == 0.25 and m["val/gold_gap"] == m["val/score_mean"] - 0.25
    assert m["val/gold_sem"] == 0.0 and m["val/gold_unscored_frac"] == 0.0
    assert m["val/gold_pass@1"] == m["val/gold_pass@2"] == 0.0  # 0.25 < CORRECT_THRESHOLD = 0.5
    assert "exact/score_mean" in m  # the embedded task's exact metrics are still there


def test_a_gold_that_scores_responses_starting_with_1_is_hand_checkable(small_cfg, tmp_path):
    t = _trainer(small_cfg, f"reward.val_function={_fn(tmp_path, STARTS_WITH_1)}", "data.embedded_val_size=8")
    m, samples = _samples(t, n=2)
    ones = [s["response"].startswith("1") for s in samples]
    assert 0 < sum(ones) < len(ones)  # both kinds: the test means something
    assert [s["gold"] for s in samples] == [float(x) for x in ones] and all(s["gold_scored"] for s in samples)
    assert m["gold_mean"] == pytest.approx(sum(ones) / len(ones), abs=1e-15) and m["gold_pass@1"] == pytest.approx(
        m["gold_mean"], abs=1e-15
    )
    assert m["gold_gap"] == pytest.approx(sum(s["score"] for s in samples) / len(samples) - m["gold_mean"], abs=1e-15)
    # pass@2: a prompt passes when either of its 2 samples starts with '1'
    by_prompt = [ones[i : i + 2] for i in range(0, len(ones), 2)]
    assert m["gold_pass@2"] == pytest.approx(sum(any(p) for p in by_prompt) / len(by_prompt), abs=1e-15)


def test_a_gold_that_raises_on_some_samples_leaves_them_out_warns_and_does_not_crash(small_cfg, tmp_path, caplog):
    t = _trainer(small_cfg, f"reward.val_function={_fn(tmp_path, FLAKY)}", "data.embedded_val_size=8")
    with caplog.at_level(logging.WARNING, logger="tether"):
        m, samples = _samples(t)
        v = t.maybe_validate(force=True)
    bad = sum(s["response"][:1] in "02468" for s in samples)
    assert 0 < bad < len(samples)  # some scored, some not: the test means something
    assert [s["gold_scored"] for s in samples] == [s["response"][:1] not in "02468" for s in samples]
    # the mean is over the scored samples (each 1.0), not over all with the failures counted 0
    assert m["gold_unscored_frac"] == bad / len(samples) and m["gold_mean"] == 1.0
    scored = [s["score"] for s in samples if s["gold_scored"]]
    assert m["gold_gap"] == pytest.approx(sum(scored) / len(scored) - 1.0, abs=1e-15)
    assert m["unscored_frac"] == 0.0  # the training reward is not affected
    assert (
        "val/gold_unscored_frac" in v
        and "could not be scored by the gold reward" in caplog.text
        and "cannot judge this one" in caplog.text
    )


FAILING = (
    "from tether.rewards import batched\n@batched\ndef gold(data_source, solution_str, ground_truth, extra_info):\n    "
    "raise RuntimeError('no judge today')\n"
)


def test_a_gold_that_fails_on_every_sample_logs_no_gold_measurement(small_cfg, tmp_path, caplog):
    # issue 33: val/gold_mean 0.0 and val/gold_gap 0.5-0.6 were logged for a gold that scored nothing
    t = _trainer(small_cfg, f"reward.val_function={_fn(tmp_path, FAILING)}")
    with caplog.at_level(logging.WARNING, logger="tether"):
        v = t.maybe_validate(force=True)
    assert v["val/gold_unscored_frac"] == 1.0 and "val/score_mean" in v
    assert not any(k.startswith("val/gold") and k != "val/gold_unscored_frac" for k in v), sorted(v)
    assert "none at all when no sample was scored" in caplog.text


def test_gold_metrics_over_the_scored_samples_by_hand():
    from tether.evaluation.sampled import gold_metrics

    def rec(gold, score, scored=True):
        return {"gold": gold if scored else 0.0, "gold_scored": scored, "score": score}

    # 2 prompts × 3 samples; prompt 0: golds 1, 0, (failed); prompt 1: golds 1, 1, 0
    records = [rec(1.0, 1.0), rec(0.0, 1.0), rec(0.0, 1.0, False), rec(1.0, 0.0), rec(1.0, 1.0), rec(0.0, 0.0)]
    m = gold_metrics(records, 3, [1, 2, 3])
    assert m["gold_mean"] == 3 / 5 and m["gold_unscored_frac"] == 1 / 6
    assert m["gold_gap"] == pytest.approx(3 / 5 - 3 / 5, abs=1e-15)  # training scores of the 5 scored: 1,1,0,1,0
    # sem² = (k_0·s²_0 + k_1·s²_1) / N² = (2·0.5 + 3·(1/3)) / 25 = 2 / 25
    assert m["gold_sem"] == pytest.approx((2 / 25) ** 0.5, rel=1e-15)
    # pass@1: the mean of each prompt's scored share (1/2, 2/3); pass@2: 1 - C(n-c, 2)/C(n, 2) = 1 and 1; pass@3
    # only prompt 1 has 3 scored samples: 1
    assert m["gold_pass@1"] == pytest.approx((1 / 2 + 2 / 3) / 2, rel=1e-15)
    assert m["gold_pass@2"] == 1.0 and m["gold_pass@3"] == 1.0
    assert gold_metrics([rec(0.0, 1.0, False)] * 4, 2, [1, 2]) == {"gold_unscored_frac": 1.0}


def test_the_user_function_path_trains_on_one_reward_and_validates_on_another(small_cfg, tmp_path):
    t = _trainer(
        small_cfg,
        f"reward.function={_fn(tmp_path, ALWAYS_ONE, 'reward')}",
        f"reward.val_function={_fn(tmp_path, CONST)}",
    )
    m = t.maybe_validate(force=True)
    assert m["val/score_mean"] == 1.0 and m["val/gold_mean"] == 0.25 and m["val/gold_gap"] == 0.75


def test_without_a_gold_no_gold_metric_is_logged(small_cfg):
    m = _trainer(small_cfg).maybe_validate(force=True)
    assert not [k for k in m if "gold" in k]  # the training reward is its own gold: no duplicate


def test_a_built_in_gold_of_the_data_source_is_used_and_per_source_metrics_are_logged(small_cfg, tmp_path, monkeypatch):
    from tether.data import write_records
    from tether.rewards import register_reward_function
    from tether.tasks.digitsum import make_dataset

    register_reward_function("test/digitsum-proxy", "tether.tasks.digitsum:compute_score", overwrite=True)
    # gold = the proxy: gap 0
    monkeypatch.setitem(GOLD_FUNCTIONS, "test/digitsum-proxy", "tether.tasks.digitsum:compute_score")
    rows = make_dataset("val")
    rows[2]["data_source"] = rows[3]["data_source"] = "test/digitsum-proxy"
    val = tmp_path / "val.jsonl"
    write_records(rows, val)
    m = _trainer(small_cfg, f"data.val_files={val}").maybe_validate(force=True)
    ds = "test/digitsum-proxy"
    assert m[f"val/{ds}/gold_mean"] == m[f"val/{ds}/score_mean"] and m[f"val/{ds}/gold_gap"] == 0.0
    assert "val/tether/digitsum/gold_mean" not in m  # that source has no gold
    # over the covered samples only: the gold's source's mean, and the proxy minus the gold over the same samples
    assert m["val/gold_mean"] == m[f"val/{ds}/gold_mean"] and m["val/gold_gap"] == 0.0
    # reward.val_function covers every source
    m2 = _trainer(
        small_cfg, f"data.val_files={val}", f"reward.val_function={_fn(tmp_path, CONST)}", out=tmp_path / "run2"
    ).maybe_validate(force=True)
    assert m2["val/tether/digitsum/gold_mean"] == m2[f"val/{ds}/gold_mean"] == m2["val/gold_mean"] == 0.25


def test_config_refusals_name_the_keys(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"reward.val_function='a.py:f' and reward.val_model='/m' are both set"):
        load_config(None, ["reward.val_function=a.py:f", "reward.val_model=/m"])
    with pytest.raises(ConfigError, match="must be auto, gold or a validation metric"):
        load_config(None, ["guard.rollback_metric=golden"])
    # the embedded task's data source has no built-in gold: refused at config time, naming what is missing
    with pytest.raises(
        ConfigError,
        match=r"guard.rollback_metric=gold watches val/gold_mean.*reward.val_function and reward.val_model are "
        r"unset.*'tether/digitsum' have no built-in gold",
    ):
        load_config(None, ["guard.rollback_metric=gold"])
    assert (
        load_config(None, ["guard.rollback_metric=gold", "reward.val_function=a.py:f"]).guard.rollback_metric == "gold"
    )
    assert load_config(None, ["guard.rollback_metric=gold", "reward.val_model=/m"]).guard.rollback_metric == "gold"
    monkeypatch.setitem(GOLD_FUNCTIONS, "tether/digitsum", "tether.tasks.digitsum:compute_score")
    # a built-in gold exists now
    assert load_config(None, ["guard.rollback_metric=gold"]).guard.rollback_metric == "gold"
    # data files: the sources are unknown until read; accepted here, refused at start-up (test below)
    assert (
        load_config(
            None, ["guard.rollback_metric=gold", "data.train_files=x.jsonl", "data.val_files=y.jsonl"]
        ).guard.rollback_metric
        == "gold"
    )


def test_rollback_on_gold_with_data_files_and_no_gold_fails_at_start_up_before_models_load(
    small_cfg, tmp_path, monkeypatch
):
    from tether.data import write_records
    from tether.tasks.digitsum import make_dataset
    from tether.trainer import Trainer

    write_records(make_dataset("train", 8), tmp_path / "train.jsonl")
    write_records(make_dataset("val"), tmp_path / "val.jsonl")
    monkeypatch.setattr(
        "tether.trainer.trainer.build_roles", lambda cfg: pytest.fail("models loaded before the gold check")
    )
    cfg = small_cfg(
        f"data.train_files={tmp_path / 'train.jsonl'}",
        f"data.val_files={tmp_path / 'val.jsonl'}",
        "guard.rollback_metric=gold",
    )
    with pytest.raises(
        ConfigError, match=r"guard.rollback_metric=gold watches val/gold_mean.*'tether/digitsum' have no built-in gold"
    ):
        Trainer(cfg)


def test_the_rollback_guard_reads_the_gold_score():
    from tether.config import GuardConfig
    from tether.trainer.guards import GuardMonitor

    g = GuardMonitor(GuardConfig(rollback_metric="gold"))
    assert g.validation_score(
        {"val/score_mean": 0.9, "val/gold_mean": 0.5, "val/gold_sem": 0.1, "exact/score_mean": 0.8}
    ) == (0.5, 0.1)
    # a gold that failed on every sample gives no score (a failing gold never rolls back), nor does a validation
    # without gold
    assert g.validation_score({"val/gold_mean": 0.0, "val/gold_sem": 0.0, "val/gold_unscored_frac": 1.0}) == (None, 0.0)
    assert g.validation_score({"val/score_mean": 0.9})[0] is None


def test_a_short_run_logs_the_gold_and_its_report_draws_it(small_cfg, tmp_path):
    """3 steps with guard.rollback_metric=gold and a gold: val/gold_* at every validation (steps 0, 2, 3), and the
    report's reward panel draws val/gold_mean beside val/score_mean."""
    from tether.report import report_figures
    from tether.trainer import Trainer

    t = Trainer(small_cfg(f"reward.val_function={_fn(tmp_path, STARTS_WITH_1)}", "guard.rollback_metric=gold"))
    t.fit()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "val/gold_mean" in r] == [0, 2, 3]
    assert all(
        r["val/gold_gap"] == pytest.approx(r["val/score_mean"] - r["val/gold_mean"], abs=1e-12)
        for r in lines
        if "val/gold_mean" in r
    )
    figs = report_figures(lines)
    labels = [ln.get_label() for ln in figs["reward"].axes[0].get_lines()]
    assert (
        any(lb.startswith("val/gold_mean") for lb in labels) and (tmp_path / "run" / "report" / "reward.png").is_file()
    )
    import matplotlib.pyplot as plt

    for f in figs.values():
        plt.close(f)


def test_a_reward_model_gold_on_the_embedded_task(small_cfg, tmp_path):
    """reward.val_model: each sample's gold is the reward model's logit on its prompt + response (float32, as
    returned)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tether.testing import build_gsm8k_tokenizer, build_tiny_reward_model

    rm = build_tiny_reward_model(tmp_path / "rm", build_gsm8k_tokenizer(tmp_path / "tok"))
    t = _trainer(small_cfg, f"reward.val_model={rm}")
    m, samples = _samples(t)
    model, tok = AutoModelForSequenceClassification.from_pretrained(rm).eval(), AutoTokenizer.from_pretrained(rm)
    with torch.no_grad():
        want = [model(**tok(s["prompt"] + s["response"], return_tensors="pt")).logits[0, 0].item() for s in samples]
    assert [s["gold"] for s in samples] == pytest.approx(want, abs=1e-5) and all(s["gold_scored"] for s in samples)
    assert m["gold_mean"] == pytest.approx(sum(want) / len(want), abs=1e-5) and m["gold_gap"] == pytest.approx(
        m["score_mean"] - m["gold_mean"], abs=1e-12
    )


def test_a_relative_gold_path_is_saved_absolute_in_the_runs_config(tmp_path, monkeypatch):
    """As reward.function's: tether eval RUN (which reads reward.val_function from config.yaml) works from any
    directory."""
    import yaml

    from tether.config import config_to_yaml

    (tmp_path / "gold.py").write_text(CONST)
    (tmp_path / "rm").mkdir()
    monkeypatch.chdir(tmp_path)
    saved = yaml.safe_load(config_to_yaml(load_config(None, ["reward.val_function=gold.py:gold"])))["reward"]
    assert saved["val_function"] == f"{tmp_path / 'gold.py'}:gold"
    assert yaml.safe_load(config_to_yaml(load_config(None, ["reward.val_model=rm"])))["reward"]["val_model"] == str(
        tmp_path / "rm"
    )
    module = yaml.safe_load(config_to_yaml(load_config(None, ["reward.val_function=my.module:gold"])))["reward"][
        "val_function"
    ]
    assert module == "my.module:gold"  # a module: kept as written
