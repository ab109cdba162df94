"""``tether report RUN_DIR``: PNG plots of a run's metrics and a summary.md."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from tether.diagnostics import read_metrics
from tether.outputs import OutputPathError, atomic_output, output_problem

PANELS = [
    # val/gold_mean: the gold reward's, when a run has one
    ("reward", ["reward/score_mean", "val/score_mean", "val/gold_mean"], "score"),
    ("kl", ["kl/ref_mean", "kl/ref_mean_unclamped", "kl/k3_mean"], "nats / token"),
    ("beta", ["kl/coef"], "β"),
    ("entropy", ["policy/entropy"], "nats / token"),
    ("length", ["response/length_mean"], "tokens"),
    ("clipfrac", ["policy/clipfrac"], "fraction"),
    ("diversity", ["diversity/unique_frac", "diversity/collapse_rate", "diversity/distinct_2"], "fraction"),
    ("exact", ["exact/score_mean", "exact/objective", "exact/opt_objective"], "score (exact, embedded task)"),
]


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for rec in history:
        v = rec.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(rec["step"])
            ys.append(float(v))
    return xs, ys


#: A panel whose values span less than this fraction of their magnitude (or less than
#: :data:`MIN_SPAN_ABS`) is drawn on a y-axis this wide, centred on them: a constant or nearly constant
#: series shows as a flat line at a readable value, not as a swing across its last digits.
MIN_SPAN_REL = 0.25
MIN_SPAN_ABS = 1e-3

#: (line style, marker, line width, marker size) of a panel's first, second, third line: each later line
#: is thinner and drawn on top, so a line that coincides with an earlier one leaves it visible.
LINE_STYLES = [("-", "o", 2.8, 6.0), ("--", "s", 1.6, 3.5), (":", "^", 1.6, 3.5)]


def panels_with_data(history: list[dict]) -> list[tuple[str, list[str], str]]:
    """The entries of :data:`PANELS` with at least one finite value in ``history`` (no empty panel is drawn)."""
    return [p for p in PANELS if any(_series(history, key)[0] for key in p[1])]


def draw_panel(ax, history: list[dict], name: str, keys: list[str], unit: str) -> None:
    """Draw one panel on ``ax``: a line per key of ``keys`` with data, without offset notation.

    A line identical to an earlier one says so in the legend (``kl/ref_mean_unclamped (= kl/ref_mean)``)
    and is drawn thinner and dashed on top of it (:data:`LINE_STYLES`); a constant line gives its value
    (``kl/coef = 0.05 (constant)``). The y-axis spans at least :data:`MIN_SPAN_REL` of the values'
    magnitude, or :data:`MIN_SPAN_ABS`.
    """
    from matplotlib.ticker import MaxNLocator

    drawn: list[tuple[str, list[int], list[float]]] = []
    for key in keys:
        xs, ys = _series(history, key)
        if not xs:
            continue
        same = next((k for k, xs0, ys0 in drawn if xs0 == xs and ys0 == ys), None)
        label = f"{key} (= {same})" if same else f"{key} = {ys[0]:.4g} (constant)" if len(set(ys)) == 1 else key
        ls, marker, lw, ms = LINE_STYLES[len(drawn) % len(LINE_STYLES)]
        ax.plot(
            xs, ys, ls=ls, lw=lw, marker=marker if len(xs) < 30 else None, ms=ms, label=label, zorder=2 + len(drawn)
        )
        drawn.append((key, xs, ys))
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.set_title(name)
    ax.grid(alpha=0.3)
    ax.ticklabel_format(useOffset=False)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if drawn:
        values = [y for _, _, ys in drawn for y in ys]
        lo, hi = min(values), max(values)
        floor = max(MIN_SPAN_REL * max(abs(lo), abs(hi)), MIN_SPAN_ABS)
        if hi - lo < floor:
            mid, half = (lo + hi) / 2, max(floor, 1.1 * (hi - lo)) / 2
            ax.set_ylim(mid - half, mid + half)
        ax.legend(fontsize=7)


def report_figures(history: list[dict]) -> dict[str, Any]:
    """The report's matplotlib figures by file stem: one per panel with data, and ``overview`` (all of them).

    Panels without data (``exact`` on a run without the embedded task) are left out: no figure, no
    axes in the overview, whose grid (at most 4 a row) holds only the others. The caller closes the figures.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels_with_data(history)
    nrows = max(1, math.ceil(len(panels) / 4))  # at most 4 a row, the rows as full as they can be
    ncols = max(1, math.ceil(len(panels) / nrows))
    fig_all, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.75 * nrows), squeeze=False)
    figs = {}
    for (name, keys, unit), ax_all in zip(panels, axes.flat, strict=False):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for a in (ax, ax_all):
            draw_panel(a, history, name, keys, unit)
        fig.tight_layout()
        figs[name] = fig
    for ax in axes.flat[max(1, len(panels)) :]:
        fig_all.delaxes(ax)
    if not panels:
        axes.flat[0].axis("off")
        axes.flat[0].text(0.5, 0.5, "no plottable metrics logged", ha="center", va="center")
    fig_all.tight_layout()
    figs["overview"] = fig_all
    return figs


#: The files a report writes (the panels' PNGs, the overview, the summary); any other file in an earlier
#: ``report/`` (the user's) is carried over into the new one.
REPORT_FILES = frozenset({*(f"{name}.png" for name, _, _ in PANELS), "overview.png", "summary.md"})


def write_report(run_dir: str | Path) -> Path:
    """Write ``report/<panel>.png`` (panels with data), ``report/overview.png`` and ``report/summary.md``; returns the
    report dir.

    The report is written whole or not at all: into ``RUN_DIR/.report.tmp-<pid>/``, which then replaces
    ``report/`` (:func:`tether.outputs.atomic_output`); a failed write leaves an earlier report as it was.
    A panel's PNG left by an earlier report is gone when the panel has no data; other files there are kept.

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
        OutputPathError: ``report`` is a file, or ``run_dir`` is read-only (before anything is drawn).
        OutputWriteError: a write failed (no space left, a read-only file system, ...): nothing was left
            beside ``report/``, an earlier report is unchanged.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: not a tether run directory")
    history = read_metrics(run_dir)
    if not history:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl holds no step record: nothing to report")
    out = run_dir / "report"
    if problem := output_problem(out, "dir", "the report directory", beside=True):
        raise OutputPathError(problem)
    figs = report_figures(history)
    try:
        with atomic_output(out, "dir", replace=True) as tmp:
            for name, fig in figs.items():
                fig.savefig(tmp / f"{name}.png", dpi=90 if name == "overview" else 110)
            (tmp / "summary.md").write_text(_summary(run_dir, history))
            _carry_over(out, tmp)
    finally:
        for fig in figs.values():
            plt.close(fig)
    return out


def _carry_over(old: Path, new: Path) -> None:
    """Copy the entries of an earlier report that a report does not write (the user's) into the new one."""
    if not old.is_dir():
        return
    for f in sorted(old.iterdir()):
        if f.name in REPORT_FILES or (new / f.name).exists():
            continue
        if f.is_dir() and not f.is_symlink():
            shutil.copytree(f, new / f.name, symlinks=True)
        else:
            shutil.copy2(f, new / f.name, follow_symlinks=False)


def wall_time_s(history: list[dict]) -> float:
    """Seconds of wall time the logged steps took: the sum of ``timing/step_s``.

    ``timing/step_s`` already contains every ``timing/<phase>_s`` of its step, so the phases are
    added only for a record without it (a line from before ``timing/step_s`` was logged).
    """
    total = 0.0
    for rec in history:
        step_s = rec.get("timing/step_s")
        if isinstance(step_s, (int, float)):
            total += step_s
        else:
            total += sum(v for k, v in rec.items() if k.startswith("timing/") and isinstance(v, (int, float)))
    return total


def _summary(run_dir: Path, history: list[dict]) -> str:
    keys = [
        "reward/score_mean",
        "val/score_mean",
        "val/gold_mean",
        "val/gold_gap",
        "kl/ref_mean",
        "kl/coef",
        "policy/entropy",
        "response/length_mean",
        "policy/clipfrac",
        "diversity/unique_frac",
        "diversity/collapse_rate",
        "perf/tokens_per_s",
        "exact/score_mean",
        "exact/gold_mean",
        "exact/kl_ref_tok",
        "exact/objective",
        "exact/opt_objective",
        "exact/objective_gap",
        "exact/correct_effective_answers",
        "exact/opt_correct_effective_answers",
    ]
    lines = [
        f"# Run summary: {run_dir.name}",
        "",
        f"{len(history)} steps logged.",
        "",
        "| metric | first | last | min | max |",
        "|---|---|---|---|---|",
    ]
    for key in keys:
        _, ys = _series(history, key)
        if ys:
            lines.append(f"| `{key}` | {ys[0]:.4g} | {ys[-1]:.4g} | {min(ys):.4g} | {max(ys):.4g} |")
    lines += ["", f"Wall time in logged steps: {wall_time_s(history):.1f} s.", "", "![overview](overview.png)", ""]
    guard: dict[str, float] = {}  # event counts summed over the run (the state gauges are left out)
    for rec in history:
        for k, v in rec.items():
            if (
                k.startswith("guard/")
                and k not in ("guard/coef_scale", "guard/coef_floor", "guard/rollbacks")
                and isinstance(v, (int, float))
            ):
                guard[k] = guard.get(k, 0.0) + v
    if any(guard.values()):
        lines += ["Guard events: " + ", ".join(f"`{k}` × {int(v)}" for k, v in guard.items() if v), ""]
    return "\n".join(lines)
