"""The reward-hacking checks (hacking_gold, hacking_proxy) on hand-built histories (guard.on_hacking in a run:
tests/trainer/test_hacking_guard.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tether.diagnostics import (
    LiveDiagnostics,
    check_hacking_gold,
    check_hacking_proxy,
    diagnose,
    gold_fall_flags,
    gold_warn_flags,
)


def vals(gold, proxy, *, every=10, exact=True, sem=None):
    g, p = ("exact/gold_mean", "exact/score_mean") if exact else ("val/gold_mean", "val/score_mean")
    out = []
    for i, (a, b) in enumerate(zip(gold, proxy, strict=True)):
        rec = {"step": i * every, g: a, p: b}
        if sem is not None:
            rec |= {"val/gold_sem": sem, "val/score_sem": sem}
        out.append(rec)
    return out


def test_gold_check_fires_on_the_first_fall_below_the_peak_while_the_proxy_rises():
    h = vals([0.47, 0.61, 0.69, 0.61], [0.49, 0.64, 0.76, 0.83])
    (f,) = check_hacking_gold(h)
    assert (
        f.check == "hacking_gold"
        and f.evidence["peak_step"] == 20
        and f.evidence["drop"] == pytest.approx(0.08, abs=1e-12)
    )
    assert (
        "fell from 0.69 at step 20 to 0.61 at step 30" in f.message
        and "exact/score_mean went from 0.76 to 0.83" in f.message
    )


@pytest.mark.parametrize(
    "gold,proxy,why",
    [
        ([0.47, 0.61, 0.69, 0.66], [0.49, 0.64, 0.76, 0.83], "a 4% dip is below min_rel_drop (10%)"),
        ([0.47, 0.61, 0.69, 0.55], [0.49, 0.64, 0.76, 0.60], "gold and proxy fall together: a bad update, not hacking"),
        ([0.47, 0.61, 0.69, 0.72], [0.49, 0.64, 0.76, 0.83], "gold still rising"),
        ([0.47], [0.49], "one validation"),
    ],
)
def test_gold_check_stays_quiet(gold, proxy, why):
    assert check_hacking_gold(vals(gold, proxy)) == [], why


def test_sampled_gold_compares_confidence_bounds_and_needs_two_falls_in_a_row_unless_the_fall_is_sharp():
    # sem 0.04, z 2: best lower bound 0.8 − 0.08 = 0.72; upper bound of 0.55 is 0.63; 0.72 − 0.63 = 0.09 > 10% of 0.72.
    # Sharp would need 0.8 − 0.55 = 0.25 ≥ 5·hypot(0.04, 0.04) = 0.283: not sharp, so one fall is not yet a warning.
    gold, proxy = [0.6, 0.8, 0.55, 0.55], [0.6, 0.7, 0.75, 0.8]
    assert check_hacking_gold(vals(gold[:3], proxy[:3], exact=False, sem=0.04)) == []
    (f,) = check_hacking_gold(vals(gold, proxy, exact=False, sem=0.04))
    assert f.evidence["peak_step"] == 10 and f.evidence["persist"] == 2 and "2 validations in a row" in f.message
    assert not f.evidence["sharp"]
    assert check_hacking_gold(vals(gold[:3], proxy[:3], exact=False, sem=0.04), persist=1)
    # 0.8 → 0.45 is 0.35 ≥ 0.283, 0.35 / 0.0566 = 6.2 combined standard errors: a sharp fall warns at once
    (f,) = check_hacking_gold(vals([0.6, 0.8, 0.45], proxy[:3], exact=False, sem=0.04))
    assert f.evidence["sharp"] and "a sharp fall of 6.2 standard errors" in f.message
    assert check_hacking_gold(vals([0.6, 0.8, 0.45], proxy[:3], exact=False, sem=0.04), sharp_z=6.5) == []
    # without val/gold_sem the size of a fall in standard errors is unknown: only persistence counts
    bare = [{k: v for k, v in r.items() if k != "val/gold_sem"} for r in vals([0.6, 0.8, 0.45], proxy[:3], exact=False)]
    assert check_hacking_gold(bare) == [] and check_hacking_gold(bare + [dict(bare[-1], step=30)])
    # sem 0.05: bounds 0.7 and 0.65 differ by 0.05 < 10% of 0.7 = 0.07: within the noise
    assert check_hacking_gold(vals(gold, proxy, exact=False, sem=0.05)) == []
    # an exact gold has no sampling noise: one fall is enough (drop 0.25 > 10% of 0.8)
    assert check_hacking_gold(vals(gold[:3], proxy[:3]))


def test_gold_warn_flags_by_hand():
    """sems 0.01, z 2: lower bounds 0.48, 0.88, ...; a fall (bounds) needs gold + 0.02 < 0.9·0.88 = 0.792, i.e. gold <
    0.772; a sharp fall needs 0.9 − gold > 0.09 (10% of 0.9) and ≥ 5·hypot(0.01, 0.01) = 0.0707, i.e. gold < 0.81."""
    proxy, psem = [0.5] * 6, [0.0] * 6
    gold = [0.5, 0.9, 0.85, 0.79, 0.9, 0.7]
    # 2: 0.05 down, neither; 3: 0.11 down (12%, 7.8 standard errors) but bounds 0.81 vs 0.792: sharp only; 5: both
    assert gold_warn_flags(gold, [0.01] * 6, proxy, psem) == [None, None, None, (1, True), None, (1, True)]
    assert gold_warn_flags(gold, [0.01] * 6, proxy, psem, sharp_z=math.inf) == [None] * 6  # no two falls in a row
    assert gold_warn_flags(gold, [0.01] * 6, proxy, psem, persist=1, sharp_z=math.inf)[5] == (1, False)
    two = gold_warn_flags([0.5, 0.9, 0.7, 0.7], [0.01] * 4, [0.5] * 4, [0.0] * 4, sharp_z=math.inf)
    assert two == [None, None, None, (1, False)]
    # the training reward fell with the gold: neither path
    assert gold_warn_flags(gold, [0.01] * 6, [0.5, 0.5, 0.5, 0.1, 0.5, 0.1], psem)[3] is None
    with pytest.raises(ValueError, match="same length"):
        gold_warn_flags(gold[:3], [0.01] * 6, proxy, psem)
    with pytest.raises(ValueError, match="persist must be >= 1"):
        gold_warn_flags(gold, [0.01] * 6, proxy, psem, persist=0)


def test_gold_fall_flags_by_hand():
    # best lower bounds: 0.5−0.02, then 0.9−0.02 = 0.88; 0.7+0.02 = 0.72 < 0.88·0.9 = 0.792 -> falls from index 1
    flags = gold_fall_flags([0.5, 0.9, 0.7, 0.85], [0.01] * 4, [0.1, 0.2, 0.3, 0.1], [0.0] * 4)
    assert flags == [None, None, 1, None]  # index 3: 0.87 > 0.792, and its proxy fell too
    with pytest.raises(ValueError, match="same length"):
        gold_fall_flags([0.5], [0.0, 0.0], [0.1], [0.0])


def _sampled_validation(rng, p, n):
    """One validation of a stationary gold: n Bernoulli(p_i) samples per prompt, mean and the stratified standard
    error of tether.evaluation.sampled (sem² = Σ_p n·s²_p / N²)."""
    x = (rng.random((len(p), n)) < np.asarray(p)[:, None]).astype(float)
    return float(x.mean()), math.sqrt(float(sum(n * row.var(ddof=1) for row in x))) / x.size


def test_false_alarm_rate_under_a_stationary_sampled_gold():
    """A stationary gold (4 prompts at p = 0.9, 0.8, 0.75, 0.6, 32 samples each, as the docs' runs validate) seen at
    30 validations: the check may warn in at most 1% of runs. The union bound over the 29·28/2 pairs (j < i) gives at
    most Σ_i (i−1)·Φ(−2√2) ≈ 406·0.0023 = 0.95 per run for a single fall (a loose bound; simulated 0.3%), and two falls
    in a row need two such deviations of the same maximum; a sharp single fall (5 combined standard errors) adds at
    most 406·Φ(−5) ≈ 1.2e-4: in 4000 simulated runs none warned. With 400 runs a true
    rate of 1% would give 4 ± 2 warnings; we allow 4. The former rule (mean drop > 10% and > 2σ of the difference,
    one fall) fails this in most runs: shown with z on the means by persist=1, z=0, which the new rule also rejects."""
    rng = np.random.default_rng(0)
    p, n, validations, runs = (0.9, 0.8, 0.75, 0.6), 32, 30, 400
    warned = warned_one = 0
    for _ in range(runs):
        g, s = zip(*(_sampled_validation(rng, p, n) for _ in range(validations)), strict=True)
        warned += any(w is not None for w in gold_warn_flags(g, s, [0.5] * validations, [0.0] * validations))
        warned_one += any(f is not None for f in gold_fall_flags(g, s, [0.5] * validations, [0.0] * validations, z=0))
    assert warned <= 4
    assert warned_one > runs // 2  # without the confidence bounds the maximum of noisy means runs away: most warn


def test_live_check_on_a_stationary_sampled_gold_history_stays_quiet():
    rng = np.random.default_rng(1)
    g, s = zip(*(_sampled_validation(rng, (0.9, 0.8, 0.75, 0.6), 32) for _ in range(30)), strict=True)
    h = [
        {"step": 10 * i, "val/gold_mean": a, "val/gold_sem": b, "val/score_mean": 0.5, "val/score_sem": 0.01}
        for i, (a, b) in enumerate(zip(g, s, strict=True))
    ]
    assert all(check_hacking_gold(h[: i + 1]) == [] for i in range(len(h)))


def proxy_history(kl, length, reward_slope=0.01):
    return [
        {"step": i + 1, "kl/ref_mean": k, "response/length_mean": n, "reward/score_mean": 0.5 + reward_slope * i}
        for i, (k, n) in enumerate(zip(kl, length, strict=True))
    ]


def test_proxy_check_needs_kl_acceleration_and_length_drift_together():
    """KL rises 0.005/step for 20 steps, then 0.05/step for 10 (a new behaviour spreading); length 3.9 → 3.5."""
    kl = [0.005 * i for i in range(20)] + [0.1 + 0.05 * i for i in range(10)]
    drifting = [3.9] * 20 + [3.5] * 10
    (f,) = check_hacking_proxy(proxy_history(kl, drifting))
    assert f.check == "hacking_proxy" and f.evidence["kl_slope_after"] == pytest.approx(0.05, rel=1e-9)
    assert f.evidence["kl_slope_before"] == pytest.approx(0.005, rel=1e-9) and f.evidence[
        "length_drift"
    ] == pytest.approx(-0.4 / 3.9, rel=1e-9)
    assert check_hacking_proxy(proxy_history(kl, [3.9] * 30)) == []  # the KL alone: ordinary learning can do that
    steady = [0.01 * i for i in range(30)]
    assert check_hacking_proxy(proxy_history(steady, drifting)) == []  # the length alone
    slowing = [0.3 * (1 - 0.9**i) for i in range(30)]  # ordinary training: KL fastest at the start
    assert check_hacking_proxy(proxy_history(slowing, drifting)) == []
    # the reward falls: breaking, not hacking
    assert check_hacking_proxy(proxy_history(kl, drifting, reward_slope=-0.01)) == []


def test_live_schedule_reports_once_and_diagnose_includes_both():
    h = vals([0.47, 0.61, 0.69, 0.61, 0.55], [0.49, 0.64, 0.76, 0.83, 0.9])
    assert [f.check for f in diagnose(h)] == ["hacking_gold"]
    live = LiveDiagnostics(every=10)
    fired = []
    for rec in [r for r in h if r["step"] > 0]:
        for step in range(rec["step"] - 9, rec["step"] + 1):
            fired += [(step, f.check) for f in live.update(step, rec if step == rec["step"] else {})]
    assert fired == [(30, "hacking_gold")]  # reported once while it keeps firing


def test_a_gold_that_fails_on_some_samples_is_measured_on_the_ones_it_scored():
    """val/gold_mean is over the samples the gold scored (failures left out, not counted 0: a failing gold is not a
    falling one), so a validation scored in part is measured, as the guard's rollback measures it, and the message says
    how much was unscored. The new-user trial: a gold failing on 40% of samples silently turned the check off while the
    guard kept rolling back on the same partial gold."""
    h = vals([0.54, 0.2], [0.55, 0.6], exact=False, sem=0.01)
    h[1]["val/gold_unscored_frac"] = 0.4
    (f,) = check_hacking_gold(h, persist=1)
    assert "the gold could not score 40% at step 10: measured over the samples it scored" in f.message
    assert check_hacking_gold(h)  # 0.34 down at 0.014 combined: a sharp fall
    h[1]["val/gold_unscored_frac"] = 0.0
    assert "could not score" not in check_hacking_gold(h)[0].message
    # a validation the gold scored none of logs no gold mean: nothing to compare
    assert check_hacking_gold([h[0], {"step": 10, "val/score_mean": 0.6, "val/gold_unscored_frac": 1.0}]) == []


def test_observed_reference_validation_is_the_first_best_without_a_call_on_the_schedule():
    """The trainer observes the step-0 validation (the reference's gold): a flaw the policy exploits from the start
    (gold never above the reference's) falls from it. Exact gold 0.47 at step 0, 0.31 at 10 (34% down)."""
    live = LiveDiagnostics(every=10)
    live.observe(0, {"exact/gold_mean": 0.47, "exact/score_mean": 0.56})
    fired = []
    for step in range(1, 11):
        rec = {"exact/gold_mean": 0.31, "exact/score_mean": 0.96} if step == 10 else {}
        fired += [(step, f.check) for f in live.update(step, rec)]
    assert fired == [(10, "hacking_gold")]


def test_a_hack_that_returns_after_a_rollback_is_reported_again():
    """held-out short_any under guard.on_hacking=rollback (docs/hacking.md): exact gold 0.47 (step 0), 0.50 (20), 0.10
    at 30 -> rolled back to step 20's weights, the run goes on at step 31 and the gold falls again, 0.36 at 40 (28%
    below 0.50). Still firing since step 30, the second fall stayed silent and the guard never escalated (the run
    hacked to gold 0); forgetting the firing findings at the rollback reports it again."""

    def run(live, golds, steps):
        fired = []
        for step in steps:
            rec = dict(zip(("exact/gold_mean", "exact/score_mean"), golds[step], strict=True)) if step in golds else {}
            fired.extend((step, f.check) for f in live.update(step, rec))
        return fired

    golds = {10: (0.48, 0.6), 20: (0.50, 0.7), 30: (0.10, 1.16), 40: (0.36, 1.0)}
    for forget, want in ((False, [(30, "hacking_gold")]), (True, [(30, "hacking_gold"), (40, "hacking_gold")])):
        live = LiveDiagnostics(every=10)
        live.observe(0, {"exact/gold_mean": 0.47, "exact/score_mean": 0.56})
        fired = run(live, golds, range(1, 31))
        if forget:
            live.forget_findings()  # Trainer.react, after the guard restored a checkpoint
        assert fired + run(live, golds, range(31, 41)) == want


def focus_history(share, kl=0.3, reward_slope=0.01):
    return [
        {"step": i + 1, "kl/token_top_share": x, "kl/ref_mean": kl, "reward/score_mean": 0.5 + reward_slope * i}
        for i, x in enumerate(share)
    ]


def test_kl_focus_fires_on_the_median_of_the_last_window():
    from tether.diagnostics import check_hacking_kl_focus

    # last 10 points: five at 0.25, five at 0.75 -> median (0.25 + 0.75) / 2 = 0.5 (exact in binary), at min_share
    share = [0.25] * 10 + [0.25, 0.75] * 5
    (f,) = check_hacking_kl_focus(focus_history(share), min_share=0.5)
    assert f.check == "hacking_kl_focus" and f.evidence["share_median"] == 0.5
    # one point fewer at 0.75 in the window: the median is 0.25, below
    assert check_hacking_kl_focus(focus_history([0.25] * 16 + [0.75] * 4), min_share=0.5) == []
    # a concentrated but tiny KL (0.05 < 0.1 nats/token) is noise, and a falling reward is not hacking
    assert check_hacking_kl_focus(focus_history([0.9] * 20, kl=0.05)) == []
    assert check_hacking_kl_focus(focus_history([0.9] * 20, reward_slope=-0.01)) == []
    assert check_hacking_kl_focus(focus_history([0.9] * 9)) == []  # fewer than `window` points
    # a hacking check that diagnose runs, but warn-only: guard.on_hacking does not act on it (held-out false alarms)
    from tether.diagnostics import GUARDED_HACKING_CHECKS, HACKING_CHECKS

    assert "hacking_kl_focus" in HACKING_CHECKS and "hacking_kl_focus" not in GUARDED_HACKING_CHECKS
    assert [x.check for x in diagnose(focus_history([0.9] * 20))].count("hacking_kl_focus") == 1


def test_no_gold_checks_in_a_run_with_a_gold_point_to_the_gold_check_and_not_to_the_guard():
    """The new-user trial: in a run with reward.val_function, hacking_proxy said 'without a gold reward this is a
    warning sign' and 'guard.on_hacking=rollback acts on this', though the guard acts on hacking_gold alone there."""
    kl = [0.005 * i for i in range(20)] + [0.1 + 0.05 * i for i in range(10)]
    h = proxy_history(kl, [3.9] * 20 + [3.5] * 10)
    config = {"guard": {"on_hacking": "warn"}, "trainer": {"save_freq": 10, "total_steps": 100}}
    (bare,) = check_hacking_proxy(h, config=config)
    assert "without a gold reward" in bare.message and "guard.on_hacking=rollback (now warn) acts on this" in (
        bare.suggestion
    )
    h[5]["val/gold_mean"] = 0.5
    (f,) = check_hacking_proxy(h, config=config)
    assert "without a gold reward" not in f.message and "hacking_gold, which compares it, decides" in f.message
    assert "guard.on_hacking" not in f.suggestion and f.suggestion.startswith("compare the gold")
    assert all("guard.on_hacking" not in o for o in f.overrides)


def test_the_kl_coef_advice_reads_the_beta_a_guard_set():
    """β now is the last kl/coef_next (the guard's floor included), not the step's kl/coef before the guard acted."""
    h = vals([0.47, 0.61, 0.69, 0.61], [0.49, 0.64, 0.76, 0.83])
    for r in h:
        r["kl/coef"] = 0.0
    (f,) = check_hacking_gold(h)
    assert "set kl.coef=0.05 (now 0" in f.suggestion
    h[-1]["kl/coef_next"] = 0.05  # a hacking rollback at the last step set the floor
    (f,) = check_hacking_gold(h)
    assert "raise kl.coef (now 0.05) to 0.1" in f.suggestion and {"kl.coef": 0.1} in f.overrides


def test_a_gold_below_zero_is_not_judged_and_says_so():
    """A new user's trial: a gold of correctness − 1 (from −0.25 to −0.33: 10.8% of its 0-to-1 range) read as "33%
    down, a sharp fall" and the guard rolled back on it; its first warning said "121% down". The 10% is relative to 0 as
    the worst score, so a gold below 0 is not judged: one info finding says why, and the guard does not act on it."""
    h = vals([-0.53, -0.25, -0.33, -0.40], [0.47, 0.75, 0.80, 0.85], exact=False, sem=0.01)
    (f,) = check_hacking_gold(h)
    assert f.check == "hacking_gold" and f.severity == "info"
    assert "cannot judge val/gold_mean: it went below 0 (-0.53 at step 0)" in f.message
    assert f.evidence["negative_steps"] == [0, 10, 20, 30] and "reward.val_function" in f.suggestion
    # a gold of 0 is the worst score, not a shifted one: judged as before
    (g,) = check_hacking_gold(vals([0.0, 0.61, 0.69, 0.40], [0.49, 0.64, 0.76, 0.83]))
    assert g.severity == "warning" and "fell from 0.69" in g.message
