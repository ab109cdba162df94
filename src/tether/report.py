"""``tether report RUN_DIR``: PNG plots of a run's metrics and a summary.md."""

from __future__ import annotations

import math
from pathlib import Path

from tether.diagnostics import read_metrics

PANELS = [
    ("reward", ["reward/score_mean", "val/score_mean"], "score"),
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


def write_report(run_dir: str | Path) -> Path:
    """Write ``report/<panel>.png``, ``report/overview.png`` and ``report/summary.md``; returns the report dir.

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
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
    out.mkdir(exist_ok=True)
    fig_all, axes = plt.subplots(2, 4, figsize=(18, 7.5))
    for (name, keys, unit), ax_all in zip(PANELS, axes.flat, strict=False):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for a in (ax, ax_all):
            for key in keys:
                xs, ys = _series(history, key)
                if xs:
                    a.plot(xs, ys, label=key, marker="." if len(xs) < 30 else None)
            a.set_xlabel("step")
            a.set_ylabel(unit)
            a.set_title(name)
            a.grid(alpha=0.3)
            if a.lines:
                a.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
    for ax in axes.flat[len(PANELS) :]:
        ax.axis("off")
    fig_all.tight_layout()
    fig_all.savefig(out / "overview.png", dpi=90)
    plt.close(fig_all)
    (out / "summary.md").write_text(_summary(run_dir, history))
    return out


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
        "reward/score_mean", "val/score_mean", "kl/ref_mean", "kl/coef", "policy/entropy", "response/length_mean",
        "policy/clipfrac", "diversity/unique_frac", "diversity/collapse_rate", "perf/tokens_per_s",
        "exact/score_mean", "exact/kl_ref_tok", "exact/objective", "exact/opt_objective", "exact/objective_gap",
        "exact/correct_effective_answers", "exact/opt_correct_effective_answers",
    ]  # fmt: skip
    lines = [f"# Run summary: {run_dir.name}", "", f"{len(history)} steps logged.", "", "| metric | first | last | min | max |", "|---|---|---|---|---|"]
    for key in keys:
        _, ys = _series(history, key)
        if ys:
            lines.append(f"| `{key}` | {ys[0]:.4g} | {ys[-1]:.4g} | {min(ys):.4g} | {max(ys):.4g} |")
    lines += ["", f"Wall time in logged steps: {wall_time_s(history):.1f} s.", "", "![overview](overview.png)", ""]
    guard: dict[str, float] = {}  # event counts summed over the run (the state gauges are left out)
    for rec in history:
        for k, v in rec.items():
            if k.startswith("guard/") and k not in ("guard/coef_scale", "guard/rollbacks") and isinstance(v, (int, float)):
                guard[k] = guard.get(k, 0.0) + v
    if any(guard.values()):
        lines += ["Guard events: " + ", ".join(f"`{k}` × {int(v)}" for k, v in guard.items() if v), ""]
    return "\n".join(lines)
