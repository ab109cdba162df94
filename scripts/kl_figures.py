"""Figures and tables of docs/kl-regularization.md, from the sweeps of scripts/kl_sweeps.sh.

Reads runs/kl/{beta,estimators,controllers,seeds}/ (whatever exists) and docs/figures/kl_estimators.json
(scripts/kl_estimators.py), writes docs/figures/kl_*.png and docs/figures/kl_tables.md.

Usage:  python scripts/kl_figures.py [--runs runs/kl] [--out docs/figures]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from tether.diagnostics import read_metrics  # noqa: E402
from tether.sweep import (  # noqa: E402
    DONE_MARKER,
    EXACT_FINAL,
    _fmt,
    exact_prompts,
    optimum_curve,
    plot_sweep,
    summarize_run,
)


def series(hist, key):
    xs = [r["step"] for r in hist if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    ys = [float(r[key]) for r in hist if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return np.array(xs), np.array(ys)


def smooth(y, w=15):
    if len(y) < w:
        return y
    k = np.ones(w) / w
    pad = np.concatenate([np.full(w // 2, y[0]), y, np.full(w - 1 - w // 2, y[-1])])
    return np.convolve(pad, k, mode="valid")


def runs_in(d: Path):
    return sorted(p for p in d.iterdir() if (p / "metrics.jsonl").is_file()) if d.is_dir() else []


def tail(hist, key, n=20):
    _, y = series(hist, key)
    return float(y[-n:].mean()) if len(y) else float("nan")


def exact_final(run: Path) -> dict:
    try:
        return json.loads((run / EXACT_FINAL).read_text())["metrics"]
    except (OSError, KeyError, json.JSONDecodeError):
        return {}


def fig_trajectories(beta_runs, seed_runs, drgrpo_runs, kl_star_tok, out):
    """Claim 1: per-token KL (and reward) against step for each β (GRPO seeds 0 and 1, and Dr. GRPO)."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {
        "0": "tab:red",
        "0.01": "tab:orange",
        "0.05": "tab:blue",
        "0.1": "tab:purple",
        "0.3": "tab:green",
        "1.0": "tab:brown",
    }
    styled = (
        [(r, "-", "") for r in beta_runs]
        + [(r, "--", " (seed 1)") for r in seed_runs]
        + [(r, ":", " Dr. GRPO") for r in drgrpo_runs]
    )
    for run, ls, suffix in styled:
        h = read_metrics(run)
        b = run.name.split("kl.coef=")[1].split("__")[0]
        lab = f"β={b}{suffix}"
        x, y = series(h, "kl/ref_mean")
        c = colors.get(b, "gray")
        axes[0].plot(x, smooth(y), ls, color=c, label=lab, lw=1.3)
        if not suffix:
            axes[0].plot(x, y, color=c, alpha=0.15, lw=0.6)
            xe, ye = series(h, "exact/kl_ref_tok")
            axes[0].plot(xe, ye, "o", color=c, ms=3.5)
        x, y = series(h, "reward/score_mean")
        axes[1].plot(x, smooth(y), ls, color=c, label=lab, lw=1.3)
    axes[0].axhspan(0.01, 0.05, color="gray", alpha=0.15, label="'β=0.05 holds KL in 0.01–0.05'")
    axes[0].axhline(0.2, color="k", lw=0.8, ls=":", label="0.2 ('no KL passes 0.2')")
    axes[0].axhline(kl_star_tok, color="tab:blue", lw=0.9, ls="-.", label=f"KL* of π* at β=0.05: {kl_star_tok:.3f}")
    axes[0].set_ylabel("kl/ref_mean, nats/token")
    axes[1].set_ylabel("reward/score_mean (15-step mean)")
    for a in axes:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    axes[0].set_title("per-token KL to the reference")
    axes[1].set_title("training reward")
    fig.tight_layout()
    fig.savefig(out / "kl_trajectories.png", dpi=90)
    plt.close(fig)


def fig_collapse(beta_runs, out, opt_correct):
    """Claim 2: sampled collapse rate and exact distinct correct answers against step."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    colors = {
        "0": "tab:red",
        "0.01": "tab:orange",
        "0.05": "tab:blue",
        "0.1": "tab:purple",
        "0.3": "tab:green",
        "1.0": "tab:brown",
    }
    for run in beta_runs:
        h = read_metrics(run)
        b = run.name.split("kl.coef=")[1].split("__")[0]
        c = colors.get(b, "gray")
        x, y = series(h, "diversity/collapse_rate")
        axes[0].plot(x, smooth(y), color=c, label=f"β={b}")
        x, y = series(h, "diversity/unique_frac")
        axes[1].plot(x, smooth(y), color=c, label=f"β={b}")
        x, y = series(h, "exact/correct_effective_answers")
        axes[2].plot(x, y, "o-", color=c, ms=3, label=f"β={b}")
    axes[2].axhline(opt_correct, color="k", ls=":", label=f"π* (any β) = π_ref: {opt_correct:.1f}")
    axes[0].set_title("diversity/collapse_rate (train, 15-step mean)")
    axes[1].set_title("diversity/unique_frac (train, 15-step mean)")
    axes[2].set_title("exact distinct correct answers (val prompts)")
    for a in axes:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "kl_collapse.png", dpi=90)
    plt.close(fig)


def fig_controllers(ctrl_runs, out):
    """Claim 3: β and KL per controller, with the target / band / schedule."""
    n = len(ctrl_runs)
    if not n:
        return
    fig, axes = plt.subplots(2, n, figsize=(3.6 * n, 5.6), squeeze=False)
    for j, run in enumerate(ctrl_runs):
        h = read_metrics(run)
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        kl = cfg["kl"]
        x, b = series(h, "kl/coef")
        axes[0, j].plot(x, b, color="tab:purple")
        axes[0, j].set_yscale("log")
        axes[0, j].set_title(kl["controller"], fontsize=10)
        x, y = series(h, "kl/ref_mean")
        axes[1, j].plot(x, y, color="tab:blue", alpha=0.25, lw=0.6)
        axes[1, j].plot(x, smooth(y), color="tab:blue", label="kl/ref_mean")
        if kl["controller"] in ("adaptive", "exponential"):
            axes[1, j].axhline(kl["target"], color="k", ls=":", label=f"target {kl['target']}")
        elif kl["controller"] == "band":
            axes[1, j].axhspan(kl["low"], kl["high"], color="gray", alpha=0.2, label=f"band {kl['low']}–{kl['high']}")
        elif kl["controller"] == "scheduled":
            end = 0
            for steps, _beta in kl["schedule"]["stages"]:
                end += steps
                if steps:
                    axes[0, j].axvline(end, color="gray", ls=":", lw=0.8)
        axes[0, j].set_ylabel("β (kl/coef)")
        axes[1, j].set_ylabel("nats/token")
        axes[1, j].set_xlabel("step")
        axes[1, j].legend(fontsize=7)
        for a in axes[:, j]:
            a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "kl_controllers.png", dpi=85)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path("runs/kl"))
    ap.add_argument("--out", type=Path, default=Path("docs/figures"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    beta_runs = sorted(runs_in(args.runs / "beta"), key=lambda p: float(p.name.split("=")[1]))
    seed_runs = runs_in(args.runs / "seeds")
    est_runs = runs_in(args.runs / "estimators")
    ctrl_runs = runs_in(args.runs / "controllers")
    drgrpo_runs = runs_in(args.runs / "drgrpo")
    cache: dict = {}
    curve = optimum_curve(
        exact_prompts("all"),
        [0.0, 0.01, 0.03, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0],
        n_samples=8,
        ref_cache=cache,
    )
    by_beta = {c["beta"]: c for c in curve}
    val_curve = optimum_curve(exact_prompts("val"), [0.05], n_samples=8, ref_cache=cache)[0]
    fig_trajectories(beta_runs, seed_runs, drgrpo_runs, by_beta[0.05]["kl_tok"], out)
    fig_collapse(beta_runs, out, val_curve["correct_effective_answers"])
    fig_controllers(ctrl_runs, out)

    # reward against KL / diversity, every finished run of every sweep, with the optimum's curve (all 20 prompts)
    all_runs = beta_runs + seed_runs + drgrpo_runs + est_runs + ctrl_runs
    rows, labels = [], {}
    for run in all_runs:
        ex = exact_final(run)
        row = summarize_run(run, None, tail=20, exact=(ex | {"_prompts": "all"}) if ex else None)
        row["name"] = f"{run.parent.name}/{run.name}"
        labels[row["name"]] = row["name"].replace("kl.", "").replace("__", " ")
        row["finished"] = (run / DONE_MARKER).is_file()
        rows.append(row)
    plot_sweep(rows, curve, out, labels=labels)
    for name in ("reward_vs_kl.png", "reward_vs_diversity.png"):
        (out / name).rename(out / f"kl_{name}")

    lines = ["# Tables generated by scripts/kl_figures.py", ""]
    lines += [
        "## Optimum (all 20 prompts, shipped reference)",
        "",
        "| β | KL*/tok | KL*/seq | E*[r] | value | distinct correct | collapse@8 |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in curve:
        lines.append(
            f"| {c['beta']:g} | {c['kl_tok']:.3f} | {c['kl_seq']:.3f} | {c['reward']:.3f} | {c['value']:.3f} | "
            f"{c['correct_effective_answers']:.1f} | {c['collapse']:.2e} |"
        )
    lines += [
        "",
        "## Per run (sampled: last 20 steps; exact: final checkpoint, all 20 prompts, at the run's final β)",
        "",
    ]
    cols = [
        ("steps", "steps"),
        ("beta", "β final"),
        ("reward", "reward (sampled)"),
        ("kl_tok", "KL/tok (sampled)"),
        ("exact_score", "E_π[r]"),
        ("exact_kl_tok", "KL/tok"),
        ("exact_kl_seq", "KL/seq"),
        ("opt_kl_seq", "KL*/seq"),
        ("objective", "objective"),
        ("opt_objective", "optimum"),
        ("objective_gap", "gap"),
        ("kl_opt_seq", "KL(π‖π*)"),
        ("correct_eff_answers", "distinct correct"),
        ("opt_correct_eff_answers", "π*: distinct correct"),
        ("collapse_rate", "collapse (sampled)"),
        ("val_collapse_rate", "val collapse"),
        ("exact_collapse", "collapse@8 exact"),
        ("unique_frac", "unique frac"),
    ]
    lines += ["| run | " + " | ".join(h for _, h in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        lines.append(f"| `{r['name']}` | " + " | ".join(_fmt(r.get(c, float("nan"))) for c, _ in cols) + " |")
    est = Path("docs/figures/kl_estimators.json")
    if est.is_file():
        data = json.loads(est.read_text())
        lines += [
            "",
            f"## KL estimators against the exact KL ({data['prompts']} prompts; std = one response's value; batch = "
            "128 responses)",
            "",
        ]
        lines += [
            "| policy | exact KL/tok | estimator | E[·] per token | bias | std | E[·] per response | bias (vs KL/seq) "
            "| std | sampled batch mean ± std |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, s in data["results"].items():
            for k in ("k1", "k2", "k3"):
                lines.append(
                    f"| `{name}` | {s['kl_tok']:.4f} | {k} | {s[f'{k}_tok']:.4f} | {s[f'{k}_tok'] - s['kl_tok']:+.4f} "
                    f"| {s[f'{k}_tok_std']:.3f} | {s[f'{k}_seq']:.4f} | {s[f'{k}_seq'] - s['kl_seq']:+.4f} | "
                    f"{s[f'{k}_seq_std']:.3f} | {s[f'{k}_tok_batch_mean']:.4f} ± {s[f'{k}_tok_batch_std']:.4f} |"
                )
    (out / "kl_tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
