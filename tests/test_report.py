"""``tether report``: the summary's numbers."""

from pathlib import Path

from tether import report


def test_wall_time_counts_each_step_once():
    # Regression: the summary added timing/step_s to the phases it already contains (≈ double).
    history = [
        {"step": 0, "val/score_mean": 0.5},  # the reference's validation: no timing
        {"step": 1, "timing/rollout_s": 2.0, "timing/update_actor_s": 1.0, "timing/step_s": 3.5},
        {"step": 2, "timing/rollout_s": 1.5, "timing/update_actor_s": 0.5, "timing/step_s": 2.25},
    ]
    assert report.wall_time_s(history) == 5.75
    assert "Wall time in logged steps: 5.8 s." in report._summary(Path("run"), history)


def test_wall_time_sums_phases_without_step_s():
    assert report.wall_time_s([{"step": 1, "timing/rollout_s": 2.0, "timing/kl_s": 0.25}]) == 2.25
