"""The reward-hacking checks (hacking_gold, hacking_proxy) on hand-built histories (guard.on_hacking in a run:
tests/trainer/test_hacking_guard.py)."""

from __future__ import annotations

import pytest

from tether.diagnostics import LiveDiagnostics, check_hacking_gold, check_hacking_proxy, diagnose


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


def test_sampled_gold_needs_the_drop_to_beat_its_noise():
    h = vals([0.6, 0.7, 0.6], [0.6, 0.7, 0.75], exact=False, sem=0.05)  # drop 0.1 < 2·√2·0.05 = 0.141
    assert check_hacking_gold(h) == []
    assert check_hacking_gold(vals([0.6, 0.7, 0.6], [0.6, 0.7, 0.75], exact=False, sem=0.02))  # 0.1 > 0.057
    assert check_hacking_gold(h, z=0) and check_hacking_gold(h)[0:0] == []


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


def test_a_failing_gold_is_not_a_falling_one():
    """A validation where the gold could not score some samples (counted 0) is left out: a broken gold never reads as
    hacking, and never makes guard.on_hacking act."""
    h = vals([0.54, 0.0], [0.55, 0.6], exact=False, sem=0.01)
    h[1]["val/gold_unscored_frac"] = 1.0
    assert check_hacking_gold(h) == []
    h[1]["val/gold_unscored_frac"] = 0.0
    assert check_hacking_gold(h)
