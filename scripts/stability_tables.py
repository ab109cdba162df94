"""The tables of docs/stability.md from the sweeps behind it (scripts/sweeps/{rollout_correction,kl_off_policy,
kl_off_policy_drgrpo,staleness,bf16_engine}.yaml): one row per configuration, seeds aggregated as mean (min–max).

    python scripts/stability_tables.py [--runs runs/stability] > tables.md

Reads each sweep's table.csv (written by tether sweep) and the last 20 steps of each run's metrics.jsonl for
the rollout_corr/* and rollout/staleness columns.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

SWEEPS = {
    "rollout_correction": "Engine at temperature 1.5, trainer at 1.0 (β = 0.05 in the reward, GRPO)",
    "bf16_engine": "Engine in bf16, trainer in fp32 (β = 0.05 in the reward, GRPO)",
    "kl_off_policy": "k3 in the loss, 4 mini-batches per batch (β = 0.05, GRPO)",
    "kl_off_policy_drgrpo": "k3 in the loss, 4 mini-batches per batch (β = 0.05, Dr. GRPO)",
    "staleness": "Batches generated k updates ahead (rollout.async_steps; β = 0.05 in the reward, GRPO)",
}
#: (column title, table.csv key, format)
COLUMNS = [
    ("E_π[r]", "exact_score", "{:.3f}"),
    ("KL/token", "exact_kl_tok", "{:.3f}"),
    ("objective gap", "objective_gap", "{:.3f}"),
    ("correct answers (eff.)", "correct_eff_answers", "{:.1f}"),
    ("collapse@8", "exact_collapse", "{:.0e}"),
]
#: (column title, metrics.jsonl key, format): means of the last TAIL steps
LIVE = [
    ("ESS", "rollout_corr/ess", "{:.3f}"),
    ("engine KL (k3)", "rollout_corr/k3_kl", "{:.4f}"),
    ("staleness", "rollout/staleness", "{:.1f}"),
]
TAIL = 20
KEYS_NOT_A_CONFIG = ("trainer.seed",)


def cell(values: list[float], fmt: str) -> str:
    if not values:
        return "–"
    mean = statistics.fmean(values)
    if len(values) == 1 or fmt.endswith("e}"):
        return fmt.format(mean)
    return f"{fmt.format(mean)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def tail_mean(run_dir: Path, key: str) -> float | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    vals = [r[key] for r in lines if r.get("step", 0) > 0 and isinstance(r.get(key), (int, float))][-TAIL:]
    return statistics.fmean(vals) if vals else None


def sweep_table(out: Path, title: str) -> str:
    rows = list(csv.DictReader((out / "table.csv").open()))
    config_keys = [k for k in rows[0] if "." in k and k not in KEYS_NOT_A_CONFIG and any(r[k] for r in rows)]
    groups: dict[str, list[dict]] = {}
    for r in rows:
        label = ", ".join(f"{k}={r[k]}" for k in config_keys if r[k] not in ("", "null", "None")) or "(defaults)"
        groups.setdefault(label, []).append(r)
    live = [c for c in LIVE if any(tail_mean(out / r["name"], c[1]) is not None for r in rows)]
    head = ["configuration", "seeds"] + [c[0] for c in COLUMNS] + [c[0] for c in live]
    lines = [f"**{title}** (`{out}`)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, rs in groups.items():
        done = [r for r in rs if r["status"] == "finished" and r.get("exact_score")]
        cells = [f"`{label}`", str(len(done))]
        cells += [cell([float(r[key]) for r in done if r.get(key)], fmt) for _, key, fmt in COLUMNS]
        for _, key, fmt in live:
            cells.append(cell([v for r in done if (v := tail_mean(out / r["name"], key)) is not None], fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs/stability", help="the sweeps' parent directory")
    args = ap.parse_args()
    for name, title in SWEEPS.items():
        out = Path(args.runs) / name
        if (out / "table.csv").is_file():
            print(sweep_table(out, title), end="\n\n")
        else:
            print(f"({out}: no table.csv yet: tether sweep scripts/sweeps/{name}.yaml)\n")


if __name__ == "__main__":
    main()
