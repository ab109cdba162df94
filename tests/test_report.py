"""``tether report``: the summary's numbers and the plots' panels, axes and legends."""

import json
from pathlib import Path

import pytest

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


# ----------------------------------------------------------------------------------------------
# plots


def _history(steps=4, exact=True, entropy=lambda s: 1.5 - 0.01 * s, kl=lambda s: 0.01 * s, unclamped=None):
    """Step records of a short run: the report's keys, ``exact/*`` only with ``exact``."""
    history = []
    for s in range(1, steps + 1):
        rec = {
            "step": s,
            "reward/score_mean": 0.4 + 0.05 * s,
            "kl/ref_mean": kl(s),
            "kl/ref_mean_unclamped": (unclamped or kl)(s),
            "kl/k3_mean": 1.5 * kl(s),
            "kl/coef": 0.05,
            "policy/entropy": entropy(s),
            "response/length_mean": 4.0,
            "policy/clipfrac": 0.01 * s,
            "diversity/unique_frac": 0.9,
            "diversity/collapse_rate": 0.0,
        }
        if exact and s % 2 == 0:
            rec |= {"exact/score_mean": 0.5 + 0.01 * s, "exact/objective": 0.45 + 0.01 * s, "exact/opt_objective": 0.96}
        history.append(rec)
    return history


def _close(figs):
    import matplotlib.pyplot as plt

    for fig in figs.values():
        plt.close(fig)


def test_no_exact_panel_without_exact_metrics(tmp_path):
    # Regression: a run without the embedded task got an empty "exact" panel (in the overview and as exact.png).
    figs = report.report_figures(_history(exact=False))
    shown = [ax.get_title() for ax in figs["overview"].axes]
    assert shown == ["reward", "kl", "beta", "entropy", "length", "clipfrac", "diversity"]
    assert sorted(figs) == sorted([*shown, "overview"])
    assert all(ax.lines for ax in figs["overview"].axes)
    assert figs["overview"].axes[0].get_subplotspec().get_geometry()[:2] == (2, 4)
    _close(figs)
    figs = report.report_figures(_history(exact=True))
    assert [ax.get_title() for ax in figs["overview"].axes][-1] == "exact" and "exact" in figs
    _close(figs)
    # fewer panels with data: a smaller grid, no blank axes
    for keys, titles, shape in [
        (["kl/coef", "policy/entropy"], ["beta", "entropy"], (1, 2)),
        (
            ["kl/coef", "policy/entropy", "kl/ref_mean", "policy/clipfrac", "reward/score_mean"],
            ["reward", "kl", "beta", "entropy", "clipfrac"],
            (2, 3),
        ),
    ]:
        figs = report.report_figures([{"step": s} | {k: 0.1 * s for k in keys} for s in range(1, 4)])
        assert [ax.get_title() for ax in figs["overview"].axes] == titles
        assert figs["overview"].axes[0].get_subplotspec().get_geometry()[:2] == shape
        _close(figs)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _history(exact=False)))
    (run / "report").mkdir()
    (run / "report" / "exact.png").write_bytes(b"an empty panel of an earlier report")
    out = report.write_report(run)
    assert not (out / "exact.png").exists() and (out / "kl.png").is_file() and (out / "overview.png").is_file()


def test_nearly_constant_series_is_flat_without_offset():
    # Regression: entropy 6.893 ± 1e-4 got a "+6.893" offset and filled the axis (a 2e-4 change drawn as a swing).
    figs = report.report_figures(_history(entropy=lambda s: 6.893 + 1e-4 * (s % 3)))
    for fig in figs.values():
        fig.canvas.draw()
        for ax in fig.axes:
            assert ax.yaxis.get_major_formatter().get_offset() == "", ax.get_title()
            assert ax.xaxis.get_major_formatter().get_offset() == "", ax.get_title()
    lo, hi = figs["entropy"].axes[0].get_ylim()
    assert hi - lo == pytest.approx(report.MIN_SPAN_REL * 6.8932, rel=1e-12) and (lo + hi) / 2 == pytest.approx(
        6.8931, rel=1e-12
    )
    # a constant β: the line sits in the middle of an axis a quarter of its value wide, its value in the legend
    ax = figs["beta"].axes[0]
    lo, hi = ax.get_ylim()
    assert (lo, hi) == (pytest.approx(0.05 - 0.00625, rel=1e-12), pytest.approx(0.05 + 0.00625, rel=1e-12))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["kl/coef = 0.05 (constant)"]
    # a constant 0: the absolute floor
    figs_zero = report.report_figures([{"step": s, "policy/clipfrac": 0.0} for s in range(1, 4)])
    assert figs_zero["clipfrac"].axes[0].get_ylim() == (-report.MIN_SPAN_ABS / 2, report.MIN_SPAN_ABS / 2)
    # a series that really moves keeps matplotlib's limits around its data
    lo, hi = figs["clipfrac"].axes[0].get_ylim()
    assert lo < 0.01 and hi > 0.04 and hi - lo < 0.05
    _close(figs)
    _close(figs_zero)


def test_coinciding_kl_lines_are_both_visible():
    # Regression: kl/ref_mean_unclamped (equal to kl/ref_mean when nothing is clamped) was drawn over it and hid it.
    figs = report.report_figures(_history())
    ax = figs["kl"].axes[0]
    first, second, third = ax.lines
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "kl/ref_mean",
        "kl/ref_mean_unclamped (= kl/ref_mean)",
        "kl/k3_mean",
    ]
    assert list(first.get_ydata()) == list(second.get_ydata())
    assert first.get_linestyle() == "-" and second.get_linestyle() == "--" and third.get_linestyle() == ":"
    assert second.get_linewidth() < first.get_linewidth() and second.get_zorder() > first.get_zorder()
    assert second.get_markersize() < first.get_markersize() and first.get_marker() != second.get_marker()
    _close(figs)
    # lines that differ anywhere say nothing of the sort
    figs = report.report_figures(_history(unclamped=lambda s: 0.01 * s + (0.002 if s == 3 else 0.0)))
    assert [t.get_text() for t in figs["kl"].axes[0].get_legend().get_texts()] == [
        "kl/ref_mean",
        "kl/ref_mean_unclamped",
        "kl/k3_mean",
    ]
    _close(figs)


def test_guard_events_are_counted_and_the_state_gauges_left_out(tmp_path):
    """A new user's trial: the summary said "`guard/coef_floor` × 1", the floor β (0.05 over 20 steps, 0.1 over 1)
    summed as if it were an event; gauges (β's scale and floor, the rollback count) are state, not events."""
    rows = [
        {"step": s, "guard/coef_scale": 2.0, "guard/rollbacks": 1.0, "guard/coef_floor": 0.05} for s in range(1, 21)
    ]
    rows[9]["guard/hacking_rollback"] = 1.0
    rows[19] |= {"guard/hacking_rollback": 1.0, "guard/coef_floor": 0.1, "guard/rollbacks": 2.0}
    text = report._summary(tmp_path, rows)
    assert "Guard events: `guard/hacking_rollback` × 2\n" in text
    assert "coef_floor" not in text.split("Guard events")[1] and "coef_scale` ×" not in text
