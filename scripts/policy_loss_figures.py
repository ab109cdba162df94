"""The policy-loss comparison of docs/stability.md ("Policy losses") from its sweeps
(scripts/sweeps/policy_losses.yaml, entropy_vanilla.yaml and entropy_control.yaml): one table row per configuration,
seeds aggregated as mean (min–max), and docs/figures/policy_losses_reward_vs_kl.png.

    python scripts/policy_loss_figures.py [--runs runs/stability] [--figure docs/figures/policy_losses_reward_vs_kl.png]

Reads each sweep's table.csv (tether sweep's final exact evaluation on all 20 embedded prompts) and each run's
metrics.jsonl for the trajectory columns: the best objective gap over the run (its validations, exact on the
validation prompts, and the final evaluation) and the first step whose validation E_π[r] (exact) reached 0.8.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

from stability_tables import cell as stability_cell  # scripts/ is on sys.path when run as a script

SWEEPS = ("policy_losses", "entropy_vanilla", "entropy_control")
KEYS_NOT_A_CONFIG = ("trainer.seed",)
SUCCESS = 0.8


def cell(values: list[float], fmt: str) -> str:
    """stability_tables.cell over the finite values."""
    return stability_cell([v for v in values if v is not None and math.isfinite(v)], fmt)


def history(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def best_gap(hist: list[dict], final: float) -> float:
    gaps = [r["exact/objective_gap"] for r in hist if isinstance(r.get("exact/objective_gap"), (int, float))]
    return min([*gaps, final])


def steps_to(hist: list[dict], level: float = SUCCESS) -> float | None:
    """First validation step whose exact E_π[r] reached ``level`` (None: never)."""
    for r in hist:
        if (
            r.get("step", 0) > 0
            and isinstance(r.get("exact/score_mean"), (int, float))
            and r["exact/score_mean"] >= level
        ):
            return float(r["step"])
    return None


def groups(out: Path) -> dict[str, list[dict]]:
    rows = list(csv.DictReader((out / "table.csv").open()))
    keys = [k for k in rows[0] if "." in k and k not in KEYS_NOT_A_CONFIG and any(r[k] for r in rows)]
    found: dict[str, list[dict]] = {}
    for r in rows:
        label = (
            ", ".join(f"{k.split('.')[-1]}={r[k]}" for k in keys if r[k] not in ("", "null", "None")) or "(defaults)"
        )
        if r["status"] == "finished" and r.get("exact_score"):
            hist = history(out / r["name"])
            r = dict(r, best_gap=best_gap(hist, float(r["objective_gap"])), steps_to=steps_to(hist))
            found.setdefault(label, []).append(r)
    return found


COLUMNS = [  # (title, key, format)
    ("gap (final)", "objective_gap", "{:.3f}"),
    ("gap (best)", "best_gap", "{:.3f}"),
    ("E_π[r]", "exact_score", "{:.3f}"),
    ("KL/token", "exact_kl_tok", "{:.3f}"),
    ("correct answers (eff.)", "correct_eff_answers", "{:.1f}"),
    ("collapse@8", "exact_collapse", "{:.0e}"),
]


def table(found: dict[str, list[dict]], title: str) -> str:
    head = ["configuration", "seeds", *[c[0] for c in COLUMNS], f"steps to E_π[r] ≥ {SUCCESS}"]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, rs in found.items():
        cells = [f"`{label}`", str(len(rs))]
        cells += [cell([float(r[key]) for r in rs if r.get(key) not in (None, "")], fmt) for _, key, fmt in COLUMNS]
        reached = [r["steps_to"] for r in rs if r["steps_to"] is not None]
        never = len(rs) - len(reached)
        cells.append(
            (cell(reached, "{:.0f}") if reached else "never") + (f", {never} never" if reached and never else "")
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(all_found: dict[str, dict[str, list[dict]]], curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 7.5), sharey=True)
    cmap = plt.get_cmap("tab20")
    colors: dict[str, tuple] = {}  # one colour per configuration in both panels
    for ax, coef in zip(axes, ("0.05", "0.0"), strict=True):
        pts = [c for c in curve if c["beta"] < 50]
        ax.plot(
            [c["kl_tok"] for c in pts], [c["reward"] for c in pts], "k-", lw=1, label="π*_β (exact optimum, every β)"
        )
        opt = next(c for c in curve if abs(c["beta"] - float(coef)) < 1e-12)
        ax.plot([opt["kl_tok"]], [opt["reward"]], "k*", ms=12, label=f"π* at β = {coef}")
        for sweep, found in all_found.items():
            for label, rs in found.items():
                parts = dict(p.split("=", 1) for p in label.split(", ") if "=" in p)
                run_coef = parts.get("coef") or rs[0]["beta"]  # a fixed β (not in the label): the runs' own
                if float(run_coef) != float(coef):
                    continue
                name = ", ".join(f"{k}={v}" for k, v in parts.items() if k != "coef")
                key = f"{sweep}:{name}"
                color = colors.setdefault(key, cmap(len(colors) % 20))
                x = [float(r["exact_kl_tok"]) for r in rs]
                y = [float(r["exact_score"]) for r in rs]
                marker = "o" if sweep == "policy_losses" else "D"
                ax.scatter(x, y, s=10, color=color, alpha=0.5, marker=marker)
                ax.scatter(
                    [statistics.fmean(x)],
                    [statistics.fmean(y)],
                    s=50,
                    color=color,
                    edgecolor="k",
                    marker=marker,
                    label=name + (" + entropy_target=1.0" if sweep == "entropy_control" else ""),
                )
        ax.set_xlabel("KL(π‖π_ref) per token, exact (nats)")
        ax.set_title(f"β = {coef}: mean of 3 seeds (large) and each seed (small)")
        ax.set_xlim(0, max(0.8, ax.get_xlim()[1]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    axes[0].set_ylabel("E_π[r], exact (20 prompts)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/stability", help="the sweeps' parent directory")
    ap.add_argument("--figure", default="docs/figures/policy_losses_reward_vs_kl.png")
    args = ap.parse_args()
    all_found, curve = {}, None
    for name in SWEEPS:
        out = Path(args.runs) / name
        if not (out / "table.csv").is_file():
            print(f"({out}: no table.csv yet: tether sweep scripts/sweeps/{name}.yaml)\n")
            continue
        all_found[name] = groups(out)
        print(table(all_found[name], f"{name} (`{out}`)"), end="\n\n")
        if curve is None and (out / "optimum_curve.json").is_file():
            curve = json.loads((out / "optimum_curve.json").read_text())["curve"]
    if all_found and curve:
        figure(all_found, curve, Path(args.figure))
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
