"""Validation: trainer.val_max_prompts (a fixed seeded subset), the shared evaluation's keys, the
progress bar (issue 10 item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tether.config import ConfigError, load_config
from tether.evaluation.sampled import capped_indices


def test_capped_indices_is_a_fixed_seeded_subset_in_order():
    idx = list(range(100, 200))
    a = capped_indices(idx, 10, seed=0)
    assert len(a) == 10 and a == sorted(a) and set(a) <= set(idx)
    assert capped_indices(idx, 10, seed=0) == a  # the same at every validation
    assert capped_indices(idx, 10, seed=1) != a  # another seed, another subset
    assert capped_indices(idx, None, seed=0) == idx and capped_indices(idx, 500, seed=0) == idx
    assert set(capped_indices(idx, 20, seed=0)) != set(a)  # a larger cap is a new draw, not a superset promise


def test_val_max_prompts_config():
    assert load_config(None, []).trainer.val_max_prompts is None
    assert load_config(None, ["trainer.val_max_prompts=64"]).trainer.val_max_prompts == 64
    with pytest.raises(ConfigError, match="val_max_prompts"):
        load_config(None, ["trainer.val_max_prompts=0"])
    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "gsm8k.yaml").read_text())
    assert cfg["trainer"]["val_max_prompts"] == 256  # 1,319 test prompts would take minutes on every validation


def test_validation_uses_the_capped_subset_with_a_progress_bar(small_cfg, capsys):
    from tether.trainer import Trainer

    t = Trainer(
        small_cfg(
            "trainer.val_max_prompts=3", "data.embedded_val_size=12", "trainer.progress=true", "trainer.report=false"
        )
    )
    m = t.maybe_validate(force=True)
    assert m["val/prompts"] == 3 and m["val/samples"] == 3 * 2
    assert {"val/pass@1", "val/pass@2", "val/maj@2", "val/mean@2", "val/score_sem", "val/truncated_frac"} <= set(m)
    err = capsys.readouterr().err
    assert "validation" in err and "3/3" in err and "prompt" in err
    m2 = t.maybe_validate(force=True)
    assert m2["val/prompts"] == 3


def test_validation_logs_each_data_source(small_cfg, tmp_path):
    from tether.data import write_records
    from tether.rewards import register_reward_function
    from tether.tasks.digitsum import make_dataset
    from tether.trainer import Trainer

    register_reward_function("test/digitsum-copy", "tether.tasks.digitsum:compute_score", overwrite=True)
    rows = make_dataset("val")
    rows[2]["data_source"] = rows[3]["data_source"] = "test/digitsum-copy"
    val = tmp_path / "val.jsonl"
    write_records(rows, val)
    t = Trainer(small_cfg(f"data.val_files={val}", "trainer.report=false"))
    m = t.maybe_validate(force=True)
    for ds in ("tether/digitsum", "test/digitsum-copy"):
        assert m[f"val/{ds}/prompts"] == 2 and 0.0 <= m[f"val/{ds}/pass@1"] <= 1.0
    assert m["val/pass@1"] == pytest.approx((m["val/tether/digitsum/pass@1"] + m["val/test/digitsum-copy/pass@1"]) / 2)


def test_samples_the_reward_could_not_score_are_counted_and_warned(small_cfg, tmp_path, caplog):
    """A reward that fails on some samples (here: every response starting with an even digit)
    scores them 0 in val/score_mean; val/unscored_frac says how many, and a warning names it."""
    import logging

    from tether.trainer import Trainer

    fn = tmp_path / "flaky.py"
    fn.write_text(
        "from tether.rewards import batched\n@batched\ndef compute_score(data_source, solution_str, ground_truth, "
        "extra_info=None):\n    if solution_str[:1] in '02468':\n        raise RuntimeError('cannot score this one')\n "
        "   return 1.0\n"
    )
    t = Trainer(small_cfg(f"reward.function={fn}:compute_score", "trainer.report=false"))
    samples: list[dict] = []
    from tether.evaluation.sampled import evaluate_prompts

    with caplog.at_level(logging.WARNING, logger="tether"):
        m = evaluate_prompts(
            t.roles.engine, t.roles.reward, t.val_set, n=2, batch_size=8, samples=samples, do_sample=False
        )
        v = t.maybe_validate(force=True)
    bad = sum(s["response"][:1] in "02468" for s in samples)
    assert 0 < bad < len(samples)  # the test means something: some scored, some not
    assert m["unscored_frac"] == bad / len(samples)
    assert m["score_mean"] == (len(samples) - bad) / len(samples)
    assert [s["scored"] for s in samples] == [s["response"][:1] not in "02468" for s in samples]
    assert "val/unscored_frac" in v and "could not be scored by the reward" in caplog.text
