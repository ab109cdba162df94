"""The table of docs/distillation.md#exact from the run directories of scripts/sweeps/distill_exact.yaml.

For each run: the steps until the exact objective gap J_β(π*_β) − J_β(π) of the validation prompts is within 0.02
(the first validation at or under it; validations every trainer.val_freq steps), and at the last validation the gap
and the sequence-level KL(π‖π*_β). A distillation run (distill.teacher=exact) reads exact/teacher_objective_gap and
exact/kl_student_teacher; an RL run reads exact/objective_gap and exact/kl_opt_seq, the same quantities when its kl.coef
is the teacher's β and its reward the task's (tests/trainer/test_distill.py checks they agree). Runs of one setting
over seeds are one row: the mean and, in brackets, the seeds' range.

Usage: python scripts/distill_exact_table.py runs/distill/exact [--within 0.02]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def _label(cfg: dict) -> str:
    d = cfg.get("distill") or {}
    if d.get("teacher") != "exact":
        return f"RL (task reward, β = {cfg['kl']['coef']:g})"
    top = f", top-{d['top_k']}" if d.get("top_k") else ""
    return f"distill {d.get('estimator', 'k1')}{top} (λ = {d.get('coef', 1.0):g}, β_T = {d.get('teacher_beta')})"


def run_row(run: Path, within: float) -> tuple[str, dict] | None:
    """(label, {steps_within, gap, kl, gap0, last_step}) of one run, or None without validations."""
    if not (run / "config.yaml").is_file() or not (run / "metrics.jsonl").is_file():
        return None
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    distill = (cfg.get("distill") or {}).get("teacher") == "exact"
    gap_key = "exact/teacher_objective_gap" if distill else "exact/objective_gap"
    kl_key = "exact/kl_student_teacher" if distill else "exact/kl_opt_seq"
    vals = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if gap_key in rec:
            vals.append(rec)
    if len(vals) < 2:
        return None
    hit = next((r["step"] for r in vals if r[gap_key] <= within), None)
    last = vals[-1]
    return _label(cfg), {
        "steps_within": hit,
        "gap": last[gap_key],
        "kl": last[kl_key],
        "gap0": vals[0][gap_key],
        "last_step": last["step"],
    }


def _cell(xs: list[float], fmt: str) -> str:
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} [{format(min(xs), fmt)}, {format(max(xs), fmt)}]"


def table(root: Path, within: float) -> str:
    rows: dict[str, list[dict]] = {}
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        got = run_row(run, within)
        if got is not None:
            rows.setdefault(got[0], []).append(got[1])
    out = [
        f"| setting | seeds | steps to gap ≤ {within:g} | gap at step 0 | final gap | final KL(π‖π*) nats/response | "
        "last step |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in sorted(rows, key=lambda s: (not s.startswith("RL"), s)):
        rs = rows[label]
        hits = [r["steps_within"] for r in rs]
        steps = ", ".join("—" if h is None else str(h) for h in hits)
        out.append(
            f"| {label} | {len(rs)} | {steps} | {_cell([r['gap0'] for r in rs], '.3f')} | "
            f"{_cell([r['gap'] for r in rs], '.4f')} | {_cell([r['kl'] for r in rs], '.3f')} | "
            f"{max(r['last_step'] for r in rs)} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="the sweep's out directory (runs/distill/exact)")
    ap.add_argument("--within", type=float, default=0.02, help="the objective gap to reach (default 0.02)")
    a = ap.parse_args(argv)
    if not a.root.is_dir():
        print(f"{a.root}: no such directory; run tether sweep scripts/sweeps/distill_exact.yaml first", file=sys.stderr)
        return 2
    print(table(a.root, a.within))
    return 0


if __name__ == "__main__":
    sys.exit(main())
