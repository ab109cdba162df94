"""tether eval reports the gold reward too (issue 23 item 1): --val-function / --val-model, or the run's
reward.val_function / reward.val_model, scoring the same samples (gold_mean, gold_gap, ...)."""

from __future__ import annotations

import json
import shutil

import pytest

from tether.cli import main
from tether.config import config_to_yaml, load_config
from tether.evaluation.evaluate import EvalSettings, evaluate

CONST = "def gold(data_sources, solution_strs, ground_truths, extra_infos):\n    return [0.25] * len(solution_strs)\n"
HALF = "def gold(data_sources, solution_strs, ground_truths, extra_infos):\n    return [0.5] * len(solution_strs)\n"


def _fn(tmp_path, body, name="gold"):
    f = tmp_path / f"{name}.py"
    f.write_text(body)
    return f"{f}:{name}"


def test_cli_reports_the_gold_beside_the_score(tmp_path, capsys):
    spec = _fn(tmp_path, CONST)
    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                "embedded",
                "embedded",
                "--n",
                "2",
                "--val-function",
                spec,
                "--no-progress",
                "--out",
                str(out),
                "--samples",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f"; gold reward: reward.val_function {spec} (tether/digitsum)")
    table = {ln.split()[0]: ln.split()[1] for ln in lines[3:] if len(ln.split()) == 2 and not ln.startswith("written")}
    assert list(table)[:5] == ["pass@1", "pass@2", "maj@2", "mean@2", "gold_mean"] and list(table)[5] == "gold_gap"
    doc = json.loads(out.read_text())
    m = doc["metrics"]
    assert (
        m["gold_mean"] == 0.25
        and m["gold_gap"] == m["score_mean"] - 0.25
        and m["gold_unscored_frac"] == 0.0
        and m["gold_pass@1"] == 0.0
    )
    assert all(s["gold"] == 0.25 and s["gold_scored"] for s in doc["samples"])
    assert doc["settings"]["gold"] == {"tether/digitsum": f"reward.val_function {spec}"}


FAILING = (
    "from tether.rewards import batched\n@batched\ndef gold(data_source, solution_str, ground_truth, extra_info):\n    "
    "raise RuntimeError('no judge today')\n"
)


def test_a_gold_that_fails_on_every_sample_reports_no_gold_measurement(tmp_path, capsys):
    # issue 33: gold_mean 0.0 and a gold_gap of the whole score were reported for a gold that scored nothing
    out = tmp_path / "eval.json"
    spec = _fn(tmp_path, FAILING)
    args = ["eval", "embedded", "embedded", "--n", "2", "--val-function", spec, "--no-progress", "--out", str(out)]
    assert main(args) == 0
    rows = {ln.split()[0]: ln.split()[1:] for ln in capsys.readouterr().out.splitlines() if ln.split()}
    assert rows["gold_unscored_frac"] == ["1.0000"] and "gold_mean" not in rows and "gold_gap" not in rows
    m = json.loads(out.read_text())["metrics"]
    assert m["gold_unscored_frac"] == 1.0 and "score_mean" in m
    assert [k for k in m if k.startswith("gold")] == ["gold_unscored_frac"]
    # and each sample says it was not scored, with no number (the new-user trial found "gold": 0.0 there)
    samples = json.loads(out.read_text())["samples"]
    assert samples and all(s["gold"] is None and s["gold_scored"] is False for s in samples)


def test_without_a_gold_nothing_is_added(capsys):
    s = EvalSettings(n=2, kl=False)
    m = evaluate("embedded", "embedded", s)
    assert not [k for k in m if k.startswith("gold")] and s.resolved["gold"] == {}
    assert main(["eval", "embedded", "embedded", "--n", "2", "--no-progress", "--no-kl"]) == 0
    assert "gold" not in capsys.readouterr().out


def test_a_runs_gold_is_the_default_and_a_given_one_replaces_it(tmp_path):
    from tether.checkpoint import write_checkpoint
    from tether.models import resolve_model_path

    run_spec, given = _fn(tmp_path, CONST), _fn(tmp_path, HALF, "half")
    given = given.rsplit(":", 1)[0] + ":gold"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(
        config_to_yaml(load_config(None, [f"reward.val_function={run_spec}", "trainer.val_n=2"]))
    )
    write_checkpoint(
        run / "checkpoints", 1, {"actor": lambda d: shutil.copytree(resolve_model_path("embedded"), d / "actor")}
    )
    s = EvalSettings(kl=False)
    assert evaluate(run, "embedded", s)["gold_mean"] == 0.25 and s.resolved["val_function"] == run_spec
    s = EvalSettings(kl=False, val_function=given)
    assert evaluate(run, "embedded", s)["gold_mean"] == 0.5 and s.resolved["gold"] == {
        "tether/digitsum": f"reward.val_function {given}"
    }


def test_a_bad_gold_is_a_clear_error(tmp_path, capsys):
    assert main(["eval", "embedded", "embedded", "--val-function", f"{tmp_path}/nope.py:gold"]) == 2
    assert "from reward.val_function=" in capsys.readouterr().err
    with pytest.raises(ValueError, match="reward.val_function=.* and reward.val_model=.* are both set"):
        evaluate("embedded", "embedded", EvalSettings(val_function="a.py:f", val_model=str(tmp_path)))


def test_the_checkpoint_curve_shows_the_gold_when_every_policy_has_one(tmp_path):
    from tether.evaluation.evaluate import curve_table, plot_curve

    settings = {"n": 2, "ks": [1, 2], "temperature": 1.0}
    base = {"pass@1": 0.5, "pass@2": 0.75, "maj@2": 0.5, "mean@2": 0.5, "length_mean": 3.0, "truncated_frac": 0.0}
    results = [{"step": s, "metrics": base | {"gold_mean": g}} for s, g in ((0, 0.5), (10, 0.25))]
    table = curve_table(results, settings).splitlines()
    assert "gold_mean" in table[0].split(" | ") and table[3].split(" | ")[4] == "0.2500"
    assert plot_curve(results, settings, tmp_path / "curve.png").is_file()
    results[0]["metrics"].pop("gold_mean")  # not every policy has one: no column
    assert "gold_mean" not in curve_table(results, settings)


def test_an_evaluation_without_a_run_times_its_rewards_out_as_a_run_does(tmp_path):
    """tether eval of a bare model: the reward and the gold reward get reward.timeout_s's default (600 s), as in a
    run's validation (before: none, so a gold that hung waited forever); a run's own reward.timeout_s is kept."""
    import torch

    from tether.evaluation.evaluate import Evaluator
    from tether.models import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path("embedded"))
    s = EvalSettings(n=2, kl=False, top_p=0.99, val_function=_fn(tmp_path, CONST))
    ev = Evaluator("embedded", s, tok, torch.device("cpu"))
    assert ev.gold.manager.timeout_s == 600.0 and ev.reward._kw["timeout_s"] == 600.0
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config_to_yaml(load_config(None, ["reward.timeout_s=5"])))
    ev = Evaluator("embedded", EvalSettings(n=2, kl=False, top_p=0.99), tok, torch.device("cpu"), run=run)
    assert ev.gold.manager.timeout_s == 5.0 and ev.reward._kw["timeout_s"] == 5.0
