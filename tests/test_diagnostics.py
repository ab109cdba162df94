"""Training diagnostics: each check on histories that should and should not fire, the jsonl reader,
``doctor`` exit codes and output, and the live wrapper."""

from __future__ import annotations

import io
import json
import math
import random

import pytest

from tether.diagnostics import (
    CHECKS,
    Finding,
    LiveDiagnostics,
    check_clipfrac_high,
    check_collapse_rising,
    check_entropy_collapse,
    check_kl_rising,
    check_length_shrinking,
    check_no_learning_signal,
    check_reward_flat_kl_growing,
    diagnose,
    doctor,
    read_metrics,
)

TOL = dict(rel=1e-12, abs=1e-15)
# the KL checks leave out a run's first 30 points (its departure from the reference); these histories test the rest
NO_WARMUP = {"kl_rising": {"warmup": 0}, "reward_flat_kl_growing": {"warmup": 0}}


def hist(key: str, values, start: int = 0, **const) -> list[dict]:
    """One record per step from ``start``, ``key`` set to each value, plus constant extra metrics."""
    return [{"step": start + i, key: v, **const} for i, v in enumerate(values)]


def merge(*histories: list[dict]) -> list[dict]:
    by_step: dict[int, dict] = {}
    for h in histories:
        for r in h:
            by_step.setdefault(r["step"], {}).update(r)
    return [by_step[s] for s in sorted(by_step)]


def healthy_history(n: int = 40) -> list[dict]:
    """A run that improves reward with a KL that settles, steady entropy, length and clipfrac."""
    rng = random.Random(1)
    return [
        {
            "step": s,
            "kl/ref_mean": 0.03 + 0.002 * rng.uniform(-1, 1),
            "kl/coef": 0.05,
            "reward/score_mean": 0.2 + 0.01 * s + 0.01 * rng.uniform(-1, 1),
            "policy/entropy": 1.5 + 0.05 * rng.uniform(-1, 1),
            "response/length_mean": 120 + 5 * rng.uniform(-1, 1),
            "policy/clipfrac": 0.05 + 0.02 * rng.uniform(-1, 1),
            "diversity/collapse_rate": 0.05 + 0.05 * rng.uniform(-1, 1),
        }
        for s in range(n)
    ]


def test_healthy_history_has_no_findings():
    assert diagnose(healthy_history()) == []


# ------------------------------------------------------------------------------------------------
# kl_rising
# ------------------------------------------------------------------------------------------------
def test_kl_rising_fires_with_exact_evidence():
    # kl = s/64 for steps 0..29 (exact binary fractions); window = last 20 points = steps 10..29.
    # Every pairwise slope is exactly 1/64, intercept median(v - s/64) = 0, so the fit runs from
    # 10/64 to 29/64; rel. rise = 19/10; every pair concordant -> tau = 1.
    h = hist("kl/ref_mean", [s / 64 for s in range(30)], **{"kl/coef": 0.05})
    [f] = check_kl_rising(h, warmup=0)
    assert (f.check, f.metric, f.severity) == ("kl_rising", "kl/ref_mean", "warning")
    assert f.evidence["steps"] == list(range(10, 30))
    assert f.evidence["values"] == [s / 64 for s in range(10, 30)]
    assert f.evidence["slope_per_step"] == 1 / 64
    assert f.evidence["kendall_tau"] == 1.0
    assert f.evidence["fit_start"] == 10 / 64
    assert f.evidence["fit_end"] == 29 / 64
    assert f.evidence["rel_rise"] == pytest.approx(1.9, **TOL)
    assert f.evidence["floor"] == 0.05
    assert "steps 10–29" in f.message and "0.1562" in f.message and "0.4531" in f.message
    assert "raise kl.coef (now 0.05) to 0.1" in f.suggestion
    assert "kl.controller=adaptive with kl.target=0.05" in f.suggestion
    json.dumps(f.evidence)  # serialisable for logs


def test_kl_rising_is_robust_to_one_spike():
    values = [s / 64 for s in range(30)]
    values[25] = 5.0  # a single outlier inside the window (window index 15 of 0..19)
    [f] = check_kl_rising(hist("kl/ref_mean", values), warmup=0)
    # 171 of the 190 pairwise slopes are exactly 1/64, so the median is too
    assert f.evidence["slope_per_step"] == 1 / 64
    # the outlier is discordant only with the 4 later points: tau = (190 - 2*4) / 190
    assert f.evidence["kendall_tau"] == pytest.approx(182 / 190, **TOL)


@pytest.mark.parametrize(
    "values, why",
    [
        ([0.10 if s % 2 else 0.12 for s in range(30)], "flat (alternating) KL"),
        ([s / 6400 for s in range(30)], "steady rise that ends at 0.0045, below the 0.05 floor"),
        ([0.1 + 1e-5 * s for s in range(30)], "monotone but only +0.2% over the window"),
        ([s / 64 for s in range(9)], "9 points, below min_points=10"),
        ([(29 - s) / 64 for s in range(30)], "falling KL"),
    ],
)
def test_kl_rising_does_not_fire(values, why):
    assert check_kl_rising(hist("kl/ref_mean", values), warmup=0) == [], why


def test_kl_rising_thresholds_are_keywords():
    h = hist("kl/ref_mean", [s / 6400 for s in range(30)])
    assert check_kl_rising(h, warmup=0) == []
    [f] = check_kl_rising(h, floor=0.001, warmup=0)
    assert f.evidence["floor"] == 0.001
    assert diagnose(h, kl_rising={"floor": 0.001, "warmup": 0}) == [f]


def test_kl_rising_floor_is_the_adaptive_target():
    h = hist("kl/ref_mean", [s / 128 for s in range(30)])  # ends at 29/128 = 0.2266
    assert check_kl_rising(h, warmup=0, config={"kl": {"controller": "adaptive", "target": 0.3}}) == []
    [f] = check_kl_rising(h, warmup=0, config={"kl": {"controller": "adaptive", "target": 0.1}})
    assert f.evidence["floor"] == 0.1
    [f] = check_kl_rising(h, warmup=0, config={"kl": {"controller": "fixed", "target": 0.3}})
    assert f.evidence["floor"] == 0.05


def test_kl_rising_suggestions_follow_the_situation():
    kl = [s / 64 for s in range(30)]
    # a controller already raising beta inside the window
    h = [{"step": s, "kl/ref_mean": kl[s], "kl/coef": 0.05 * (1 + s / 10)} for s in range(30)]
    [f] = check_kl_rising(h, warmup=0, config={"kl": {"target": 0.02}, "actor": {"lr": 1e-6}})
    assert "kl/coef already rose from 0.1 to 0.195" in f.suggestion  # steps 10 and 29
    assert "lower kl.target (now 0.02)" in f.suggestion and "actor.lr (now 1e-06)" in f.suggestion
    # no penalty at all
    [f] = check_kl_rising(hist("kl/ref_mean", kl, **{"kl/coef": 0.0}), warmup=0)
    assert "set kl.coef=0.05 (now 0" in f.suggestion
    # KL only measured
    [f] = check_kl_rising(hist("kl/ref_mean", kl), warmup=0, config={"kl": {"placement": "none", "coef": 0.05}})
    assert "kl.placement=reward or kl.placement=loss (now none" in f.suggestion
    assert "kl.coef (now 0.05)" in f.suggestion


# ------------------------------------------------------------------------------------------------
# entropy_collapse
# ------------------------------------------------------------------------------------------------
def test_entropy_collapse_fires_on_relative_drop():
    values = [2.0, 2.1, 1.9, 2.0, 2.2] + [1.5] * 10 + [0.8, 0.9, 0.7, 0.8, 0.6]
    [f] = check_entropy_collapse(hist("policy/entropy", values))
    assert f.evidence["steps"] == [0, 1, 2, 3, 4, 15, 16, 17, 18, 19]
    assert f.evidence["values"] == [2.0, 2.1, 1.9, 2.0, 2.2, 0.8, 0.9, 0.7, 0.8, 0.6]
    assert f.evidence["early_median"] == 2.0
    assert f.evidence["recent_median"] == 0.8
    assert f.evidence["drop"] == pytest.approx(0.6, **TOL)  # 1 - 0.8/2.0
    assert "fell 60% from 2 (median of steps 0–4) to 0.8 (median of steps 15–19)" in f.message
    assert "rollout.temperature" in f.suggestion and "algo.entropy_coef=0.001" in f.suggestion
    cfg = {"algo": {"entropy_coef": 0.002}, "rollout": {"temperature": 0.7}}
    [f] = check_entropy_collapse(hist("policy/entropy", values), config=cfg)
    assert "raise rollout.temperature (now 0.7)" in f.suggestion
    assert "raise algo.entropy_coef (now 0.002) to 0.004" in f.suggestion


def test_entropy_collapse_does_not_fire_on_a_40_percent_drop():
    values = [2.0] * 5 + [1.6] * 5 + [1.2] * 5  # drop 0.4 <= 0.5, level 1.2 above the floor
    assert check_entropy_collapse(hist("policy/entropy", values)) == []
    [f] = check_entropy_collapse(hist("policy/entropy", values), max_drop=0.3)
    assert f.evidence["drop"] == pytest.approx(0.4, **TOL)


def test_entropy_collapse_absolute_floor():
    # only 5 points: no early level to compare, but the recent median 0.03 is below 0.05
    [f] = check_entropy_collapse(hist("policy/entropy", [0.03, 0.02, 0.04, 0.03, 0.03]))
    assert f.evidence["recent_median"] == 0.03 and f.evidence["drop"] is None
    assert "below the 0.05 nats/token floor" in f.message
    # 12 flat points at 0.03: no drop, still below the floor
    [f] = check_entropy_collapse(hist("policy/entropy", [0.03] * 12))
    assert f.evidence["drop"] == 0.0
    # 4 points is too few for anything
    assert check_entropy_collapse(hist("policy/entropy", [0.03] * 4)) == []


# ------------------------------------------------------------------------------------------------
# length_shrinking
# ------------------------------------------------------------------------------------------------
def test_length_shrinking_fires_and_suggests_placement():
    values = [100, 110, 90, 100, 105] + [80] * 5 + [60, 62, 58, 60, 61]
    [f] = check_length_shrinking(hist("response/length_mean", values, **{"kl/coef": 0.1}))
    assert f.evidence["steps"] == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    assert f.evidence["early_median"] == 100 and f.evidence["recent_median"] == 60
    assert f.evidence["drop"] == pytest.approx(0.4, **TOL)
    assert "shrank 40% from 100 tokens" in f.message
    assert "kl.placement=loss" in f.suggestion and "lower kl.coef (now 0.1)" in f.suggestion
    [f] = check_length_shrinking(hist("response/length_mean", values), config={"kl": {"placement": "loss"}})
    assert "kl.placement=loss" not in f.suggestion and "length bias" in f.suggestion


def test_length_shrinking_does_not_fire():
    assert check_length_shrinking(hist("response/length_mean", [100] * 5 + [75] * 5)) == []  # -25%
    assert check_length_shrinking(hist("response/length_mean", [100] * 5 + [150] * 5)) == []  # growing
    assert check_length_shrinking(hist("response/length_mean", [100] * 4 + [10] * 5)) == []  # 9 points


# ------------------------------------------------------------------------------------------------
# reward_flat_kl_growing
# ------------------------------------------------------------------------------------------------
def _flat_reward_growing_kl(n: int = 20, reward=None) -> list[dict]:
    reward = reward or [0.5 if s % 2 == 0 else 0.4 for s in range(n)]
    return [{"step": s, "kl/ref_mean": (s + 2) / 128, "reward/score_mean": reward[s]} for s in range(n)]


def test_reward_flat_kl_growing_fires_with_exact_evidence():
    [f] = check_reward_flat_kl_growing(_flat_reward_growing_kl(), warmup=0)
    assert (f.check, f.metric) == ("reward_flat_kl_growing", "reward/score_mean")
    assert f.evidence["steps"] == list(range(20))
    assert f.evidence["values"] == [0.5, 0.4] * 10
    # alternating high/low: (even i, odd j > i) pairs are discordant: sum_{a=0..9} (10 - a) = 55;
    # (odd i, even j > i) concordant: sum_{a=0..9} (9 - a) = 45 -> tau = (45 - 55) / 190 = -1/19
    assert f.evidence["reward_kendall_tau"] == pytest.approx(-1 / 19, **TOL)
    assert f.evidence["reward_median"] == pytest.approx(0.45, **TOL)
    assert f.evidence["kl_steps"] == list(range(20))
    assert f.evidence["kl_slope_per_step"] == 1 / 128
    assert f.evidence["kl_fit_start"] == 2 / 128 and f.evidence["kl_fit_end"] == 21 / 128
    assert "actor.lr" in f.suggestion and "kl.coef" in f.suggestion


def test_reward_flat_kl_growing_does_not_fire():
    rising = [0.1 * s for s in range(20)]
    assert check_reward_flat_kl_growing(_flat_reward_growing_kl(reward=rising), warmup=0) == []
    flat_kl = [{"step": s, "kl/ref_mean": 0.1, "reward/score_mean": 0.5} for s in range(20)]
    assert check_reward_flat_kl_growing(flat_kl, warmup=0) == []
    # KL tiny: ends at 21/12800 < kl_floor 0.02
    tiny = [{**r, "kl/ref_mean": r["kl/ref_mean"] / 100} for r in _flat_reward_growing_kl()]
    assert check_reward_flat_kl_growing(tiny, warmup=0) == []


# ------------------------------------------------------------------------------------------------
# clipfrac_high
# ------------------------------------------------------------------------------------------------
def test_clipfrac_high_fires_with_run_length():
    values = [0.1, 0.1, 0.25, 0.3, 0.22, 0.21, 0.26, 0.3]
    [f] = check_clipfrac_high(hist("policy/clipfrac", values), config={"actor": {"lr": 3e-6}})
    assert f.evidence == {
        "steps": [3, 4, 5, 6, 7],
        "values": [0.3, 0.22, 0.21, 0.26, 0.3],
        "run_length": 6,
        "threshold": 0.2,
    }
    assert "for the last 6 logged steps (2–7; latest 0.3)" in f.message
    assert "lower actor.lr (now 3e-06) or algo.ppo_epochs" in f.suggestion


def test_clipfrac_high_does_not_fire():
    assert check_clipfrac_high(hist("policy/clipfrac", [0.3, 0.3, 0.2, 0.3, 0.3])) == []  # 0.2 is not > 0.2
    assert check_clipfrac_high(hist("policy/clipfrac", [0.1, 0.3, 0.3, 0.3, 0.3])) == []  # only 4 above
    assert check_clipfrac_high(hist("policy/clipfrac", [0.9] * 4)) == []  # fewer than patience points
    assert len(check_clipfrac_high(hist("policy/clipfrac", [0.9] * 4), patience=4)) == 1


# ------------------------------------------------------------------------------------------------
# collapse_rising
# ------------------------------------------------------------------------------------------------
def test_collapse_rising_fires():
    values = [0.0, 0.0, 0.125, 0.0, 0.0, 0.25, 0.25, 0.375, 0.25, 0.5, 0.25]
    [f] = check_collapse_rising(hist("diversity/collapse_rate", values, **{"kl/coef": 0.02}))
    assert f.evidence["steps"] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert f.evidence["early_median"] == 0.0 and f.evidence["recent_median"] == 0.25
    assert f.evidence["rise"] == 0.25
    assert "raise kl.coef (now 0.02) to 0.04" in f.suggestion and "rollout.temperature" in f.suggestion


def test_collapse_rising_does_not_fire():
    assert check_collapse_rising(hist("diversity/collapse_rate", [0.1] * 5 + [0.25] * 5)) == []  # +0.15
    assert check_collapse_rising(hist("diversity/collapse_rate", [0.6] * 10)) == []  # high but not rising


# ------------------------------------------------------------------------------------------------
# series handling and diagnose
# ------------------------------------------------------------------------------------------------
def test_series_skip_bad_values_and_dedupe_steps():
    good = [0.1, 0.1, 0.12, 0.3, 0.3, 0.3]
    h = hist("policy/clipfrac", good)
    # noise that must be ignored: missing key, None, NaN, inf, a bool, a string, a record without a step
    h += [
        {"step": 6},
        {"step": 7, "policy/clipfrac": None},
        {"step": 8, "policy/clipfrac": math.nan},
        {"step": 9, "policy/clipfrac": math.inf},
        {"step": 10, "policy/clipfrac": True},
        {"step": 11, "policy/clipfrac": "0.9"},
        {"policy/clipfrac": 0.9},
    ]
    assert check_clipfrac_high(h) == []  # 0.1 at step 1 is among the last 5 valid points
    # step 1 re-logged after a resume: the last record wins; order in the list does not matter
    h2 = list(reversed(h)) + [{"step": 1, "policy/clipfrac": 0.4}, {"step": 2, "policy/clipfrac": 0.5}]
    [f] = check_clipfrac_high(h2)
    assert f.evidence["steps"] == [1, 2, 3, 4, 5] and f.evidence["values"] == [0.4, 0.5, 0.3, 0.3, 0.3]


def test_diagnose_runs_all_checks_in_order_and_validates_thresholds():
    h = merge(
        _flat_reward_growing_kl(),
        hist("policy/clipfrac", [0.5] * 20),
    )
    found = diagnose(h, **NO_WARMUP)
    assert [f.check for f in found] == ["kl_rising", "reward_flat_kl_growing", "clipfrac_high"]
    assert [f.check for f in diagnose(h, clipfrac_high=False, **NO_WARMUP)] == ["kl_rising", "reward_flat_kl_growing"]
    assert diagnose(h, clipfrac_high={"threshold": 0.6}, **NO_WARMUP) == found[:2]
    with pytest.raises(ValueError, match="unknown check 'kl_rsing'"):
        diagnose(h, kl_rsing={})
    with pytest.raises(ValueError, match="unknown threshold kl_rising.flor"):
        diagnose(h, kl_rising={"flor": 0.1})
    assert list(CHECKS) == [
        "kl_rising",
        "entropy_collapse",
        "length_shrinking",
        "reward_flat_kl_growing",
        "clipfrac_high",
        "collapse_rising",
        "no_learning_signal",
        "hacking_gold",
        "hacking_proxy",
        "hacking_kl_focus",
    ]


# ------------------------------------------------------------------------------------------------
# read_metrics and doctor
# ------------------------------------------------------------------------------------------------
def write_run(tmp_path, records, tail: str = "", config: str | None = None):
    run = tmp_path / "run"
    run.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (run / "metrics.jsonl").write_text(text, encoding="utf-8")
    if config is not None:
        (run / "config.yaml").write_text(config, encoding="utf-8")
    return run


def test_read_metrics_tolerates_and_reports_a_truncated_last_line(tmp_path, caplog):
    run = write_run(tmp_path, [{"step": 0, "a": 1.0}, {"step": 1, "a": 2.0}], tail='{"step": 2, "a": 3.')
    with caplog.at_level("WARNING", logger="tether"):
        records = read_metrics(run)
    assert records == [{"step": 0, "a": 1.0}, {"step": 1, "a": 2.0}]
    assert [r.name for r in caplog.records] == ["tether"]  # the tether logger, not a Python warning
    assert "last line (3, 19 characters, no final newline) is truncated" in caplog.text
    # the same path given as the file itself
    caplog.clear()
    with caplog.at_level("WARNING", logger="tether"):
        assert read_metrics(run / "metrics.jsonl") == records
    assert len(caplog.records) == 1


def test_read_metrics_clean_file_and_final_line_without_newline(tmp_path, caplog):
    run = write_run(tmp_path, [{"step": 0, "a": 1.0}], tail='\n{"step": 1, "a": 2.0}')
    with caplog.at_level("WARNING", logger="tether"):
        assert read_metrics(run) == [{"step": 0, "a": 1.0}, {"step": 1, "a": 2.0}]
    assert caplog.records == []


def test_read_metrics_reports_malformed_middle_lines(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "a\n[1, 2]\n{"a": 1}\n{"step": 4}\n')
    with caplog.at_level("WARNING", logger="tether"):
        records = read_metrics(run)
    assert records == [{"step": 0}, {"step": 4}]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    assert "line 2 is malformed" in messages[0]
    assert "line 3 is malformed (not a JSON object but list)" in messages[1]
    assert 'line 4 is malformed (no integer "step")' in messages[2]


def test_read_metrics_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        read_metrics(tmp_path / "nope")


def test_doctor_healthy(tmp_path, capsys):
    run = write_run(tmp_path, healthy_history())
    assert doctor(run) == 0
    out = capsys.readouterr().out
    assert f"tether doctor: {run} (40 steps, 0–39)" in out
    assert out.strip().splitlines()[-1].startswith("healthy: no check fired")


def test_doctor_truncated_line_only_is_info(tmp_path):
    run = write_run(tmp_path, healthy_history(), tail='{"step": 40, "kl/re')
    buf = io.StringIO()
    assert doctor(run, out=buf) == 0
    out = buf.getvalue()
    assert "[info] metrics_file (metrics.jsonl)" in out and "truncated" in out
    assert "healthy: no check fired" in out and "(1 info)" in out


def test_doctor_warnings_exit_1_and_quote_config(tmp_path):
    h = merge(healthy_history(20), hist("policy/clipfrac", [0.1] * 14 + [0.3] * 6))
    run = write_run(tmp_path, h, config="actor:\n  lr: 1.0e-06\nalgo:\n  ppo_epochs: 4\n")
    buf = io.StringIO()
    assert doctor(run, out=buf) == 1
    out = buf.getvalue()
    assert "[warning] clipfrac_high (policy/clipfrac)" in out
    assert "evidence: step 15: 0.3, 16: 0.3, 17: 0.3, 18: 0.3, 19: 0.3" in out
    assert "suggestion: lower actor.lr (now 1e-06) or algo.ppo_epochs (now 4)" in out
    assert out.strip().splitlines()[-1] == "1 warning(s), 0 info"
    # thresholds reach the checks
    assert doctor(run, out=io.StringIO(), clipfrac_high={"threshold": 0.5}) == 0


def test_doctor_unreadable_run_dir_exit_2(tmp_path, capsys):
    assert doctor(tmp_path / "gone") == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"cannot read run directory {tmp_path / 'gone'}" in captured.err
    buf = io.StringIO()
    missing = tmp_path / "does-not-exist"
    assert doctor(missing, out=buf) == 2
    assert str(missing) in buf.getvalue() and "cannot read" in buf.getvalue()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    buf = io.StringIO()
    assert doctor(empty, out=buf) == 2
    assert f"no metric records in {empty / 'metrics.jsonl'}" in buf.getvalue()
    bad = tmp_path / "isdir"
    (bad / "metrics.jsonl").mkdir(parents=True)  # a directory where the file should be
    assert doctor(bad, out=io.StringIO()) == 2


# ------------------------------------------------------------------------------------------------
# LiveDiagnostics
# ------------------------------------------------------------------------------------------------
def test_live_reports_once_until_cleared():
    live = LiveDiagnostics(every=1)
    clip = [0.1] * 3 + [0.3] * 7 + [0.1] * 2 + [0.3] * 5
    fired_at = []
    for s, v in enumerate(clip):
        for f in live.update(s, {"policy/clipfrac": v}):
            assert isinstance(f, Finding) and f.check == "clipfrac_high"
            fired_at.append(s)
    # fires when the 5th consecutive high point arrives (step 7), stays silent while high,
    # clears at step 10, fires again at step 16 (5 high points 12..16)
    assert fired_at == [7, 16]


def test_live_evaluates_every_n_calls():
    live = LiveDiagnostics(every=4)
    out = [live.update(s, {"policy/clipfrac": 0.9}) for s in range(12)]
    # calls 4 and 8 evaluate: at call 4 only 4 points (< patience 5); call 8 fires
    assert [i for i, o in enumerate(out) if o] == [7]
    with pytest.raises(ValueError, match="every"):
        LiveDiagnostics(every=0)
    with pytest.raises(ValueError, match="unknown check"):
        LiveDiagnostics(bogus={})


def test_live_matches_diagnose_on_the_full_history():
    # A long noisy run with drifting metrics: the bounded storage must see what diagnose sees.
    rng = random.Random(7)
    full: list[dict] = []
    thresholds = {"kl_rising": {"window": 15}, "entropy_collapse": {"early": 8, "recent": 6}}
    live = LiveDiagnostics(every=7, **thresholds)
    active: set[tuple[str, str]] = set()
    for s in range(300):
        rec = {
            "step": s,
            "kl/ref_mean": 0.02 + 0.0004 * s * (1 + 0.3 * rng.uniform(-1, 1)) * (s % 100 > 50),
            "kl/coef": 0.05,
            "reward/score_mean": 0.5 + 0.1 * rng.uniform(-1, 1),
            "policy/entropy": 2.0 * math.exp(-s / 150) + 0.1 * rng.uniform(0, 1),
            "response/length_mean": 100 - 0.2 * s + 5 * rng.uniform(-1, 1),
            "policy/clipfrac": 0.15 + 0.1 * rng.uniform(-1, 1),
        }
        if s % 3 == 0:
            rec["diversity/collapse_rate"] = min(1.0, s / 400 + 0.1 * rng.uniform(0, 1))
        full.append(rec)
        new = live.update(s, rec)
        if (s + 1) % 7 == 0:
            expected = diagnose(full, **thresholds)
            assert new == [f for f in expected if (f.check, f.metric) not in active]
            active = {(f.check, f.metric) for f in expected}
        else:
            assert new == []
    # bounded (the first and last 40 points of each metric: hacking_proxy's 2·window + lookback), not the 300 steps
    assert len(live.history()) < 150
    assert {c for c, _ in active} >= {"entropy_collapse", "length_shrinking"}


def test_live_load_restores_early_levels_after_resume():
    past = hist("policy/entropy", [2.0] * 10)
    live = LiveDiagnostics(every=1)
    live.load(past)
    # recent medians: [2,2,2,2,.5] -> 2.0 at step 10; [2,2,2,.5,.5] -> 2.0 at 11; [2,2,.5,.5,.5] -> 0.5 at 12
    assert live.update(10, {"policy/entropy": 0.5}) == []
    assert live.update(11, {"policy/entropy": 0.5}) == []
    [f] = live.update(12, {"policy/entropy": 0.5})
    assert f.check == "entropy_collapse" and f.evidence["early_median"] == 2.0  # from the loaded past
    assert f.evidence["drop"] == 0.75
    # without load() the early level would be the post-resume 0.5 and nothing would fire
    fresh = LiveDiagnostics(every=1)
    assert [fresh.update(s, {"policy/entropy": 0.5}) for s in range(10, 20)] == [[]] * 10


# ---------------------------------------------------------------- no learning signal (issue 10 item 7)


def silent_history(n: int = 30) -> list[dict]:
    """The issue's run: every reward 0, every advantage and gradient 0, and KL exactly 0."""
    return [
        {
            "step": s,
            "reward/score_mean": 0.0,
            "rollout/zero_var_group_frac": 1.0,
            "advantages/abs_mean": 0.0,
            "policy/grad_norm": 0.0,
            "kl/ref_mean": 0.0,
            "kl/coef": 0.05,
            "policy/entropy": 1.5,
            "response/length_mean": 12.0,
        }
        for s in range(1, n + 1)
    ]


def test_no_learning_signal_fires_on_the_issue_run_and_says_what_to_do():
    [f] = diagnose(silent_history(), config={"rollout": {"temperature": 1.0, "n": 4}, "algo": {"filter_groups": False}})
    assert f.check == "no_learning_signal" and f.metric == "rollout/zero_var_group_frac"
    assert f.evidence["steps"] == list(range(21, 31)) and f.evidence["values"] == [1.0] * 10
    assert f.message.startswith(
        "no learning signal over steps 21–30: 100% of prompts got the same reward for all their samples"
    )
    assert "mean |advantage| was 0 at every step" in f.message and "gradient norm was 0 at every step" in f.message
    assert "(reward/score_mean 0)" in f.message
    assert "raise rollout.temperature (now 1) or rollout.n (now 4)" in f.suggestion
    assert "set algo.filter_groups=true" in f.suggestion and "tether eval" in f.suggestion


def test_no_learning_signal_thresholds_and_quiet_cases():
    # 85% flat groups on average (< 0.9) with moving advantages and gradients: a hard task, not a dead run
    h = [
        {"step": s, "rollout/zero_var_group_frac": 0.85, "advantages/abs_mean": 0.3, "policy/grad_norm": 0.8}
        for s in range(1, 21)
    ]
    assert check_no_learning_signal(h) == []
    assert check_no_learning_signal(h, max_flat_frac=0.85)[0].metric == "rollout/zero_var_group_frac"
    # fewer than min_points points: too early to tell
    assert check_no_learning_signal(silent_history(4)) == []
    assert check_no_learning_signal(silent_history(5))[0].evidence["steps"] == [1, 2, 3, 4, 5]
    # rewards differ and advantages move, but nothing reaches the weights: the trainable parameters
    h = [
        {"step": s, "rollout/zero_var_group_frac": 0.2, "advantages/abs_mean": 0.4, "policy/grad_norm": 0.0}
        for s in range(1, 11)
    ]
    [f] = check_no_learning_signal(h, config={"actor": {"lora": {"rank": 0}}})
    assert f.metric == "policy/grad_norm" and "trainable parameters (a LoRA rank above 0" in f.suggestion
    # one non-zero gradient in the window clears it
    h[-1]["policy/grad_norm"] = 1e-3
    assert check_no_learning_signal(h) == []
    # already filtering: raise the number of draws instead
    [f] = check_no_learning_signal(
        silent_history(), config={"algo": {"filter_groups": True, "filter_groups_max_draws": 10}}
    )
    assert "rollout.n so that samples differ, or raise algo.filter_groups_max_draws (now 10)" in f.suggestion


def test_doctor_is_no_longer_healthy_on_a_run_that_learns_nothing(tmp_path):
    buf = io.StringIO()
    assert doctor(write_run(tmp_path, silent_history()), out=buf) == 1
    assert "[warning] no_learning_signal (rollout/zero_var_group_frac)" in buf.getvalue()


# ---------------------------------------------------------------- live vs doctor agreement (issue 10 item 13)


def early_kl_rise(n: int = 100) -> list[dict]:
    """KL rising over the first 20 steps, then flat: what the embedded demo does."""
    return [{"step": s, "kl/ref_mean": min(s, 20) * 0.005, "kl/coef": 0.05} for s in range(1, n + 1)]


def test_doctor_reports_what_the_live_checks_reported_during_the_run(tmp_path):
    live = LiveDiagnostics(**NO_WARMUP)  # the trainer's: every LIVE_EVERY = 10 steps
    printed = [f for rec in early_kl_rise() for f in live.update(rec["step"], rec)]
    [warned] = printed  # the run's console showed one kl_rising warning, at step 10 (KL 0.005 -> 0.05)
    assert warned.check == "kl_rising" and warned.evidence["steps"] == list(range(1, 11))
    assert diagnose(early_kl_rise(), **NO_WARMUP) == []  # the last window (steps 81-100) is flat
    buf = io.StringIO()
    assert doctor(write_run(tmp_path, early_kl_rise()), out=buf, **NO_WARMUP) == 0
    out = buf.getvalue()
    # before the fix the doctor printed only "healthy" for this run; now it names what the run printed
    assert "[info] kl_rising (kl/ref_mean)" in out
    assert f"reported during training at step 10, no longer firing at step 100: {warned.message}" in out
    assert out.strip().splitlines()[-1].endswith("1 finding(s) reported during training have cleared (above)")


def test_the_departure_from_the_reference_is_not_drift():
    # issue 33: the demo's live doctor told every run to raise kl.coef at step 20, where its KL rose from 0 (the
    # reference) and then levelled off at 0.15-0.19, below the 0.195 that β = 0.05's exact optimum needs
    live = LiveDiagnostics()
    assert [f for rec in early_kl_rise() for f in live.update(rec["step"], rec)] == []
    # the same rise after the first 30 points is drift: 0.005 per step over steps 31-50
    later = [{"step": s, "kl/ref_mean": 0.05 + 0.005 * max(s - 30, 0), "kl/coef": 0.05} for s in range(1, 51)]
    [f] = check_kl_rising(later)
    assert f.evidence["steps"] == list(range(31, 51)) and f.evidence["slope_per_step"] == pytest.approx(0.005, rel=1e-9)
    assert check_kl_rising(later, warmup=40)[0].evidence["steps"] == list(range(41, 51))  # min_points = 10 left
    assert check_kl_rising(later, warmup=41) == []  # 9 left


def test_a_logged_infinite_kl_reads_back_as_the_live_check_saw_it(tmp_path):
    from tether.trainer.logging import MetricsLogger

    h = [{"step": s, "kl/ref_mean": 0.05 + 0.004 * s, "kl/coef": 0.05} for s in range(1, 21)]
    h[9]["kl/ref_mean"] = math.inf  # a step whose KL was infinite (the guard skipped its update)
    logger = MetricsLogger(tmp_path, ["jsonl"], config={}, project="t")
    for rec in h:
        logger.log(rec["step"], {k: v for k, v in rec.items() if k != "step"})
    logger.close()
    assert '"kl/ref_mean": 1e+308' in (tmp_path / "metrics.jsonl").read_text()  # how jsonl stores +inf
    live = LiveDiagnostics(every=20, **NO_WARMUP)
    [live_finding] = [f for rec in h for f in live.update(rec["step"], rec)]
    [doctor_finding] = diagnose(read_metrics(tmp_path), **NO_WARMUP)
    assert doctor_finding == live_finding  # the same 19 points, not 1e308 as a KL value
    assert 10 not in doctor_finding.evidence["steps"]
