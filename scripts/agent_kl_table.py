"""The tables of docs/agents.md#the-kl-across-turns-measured from the run directories of scripts/sweeps/agent_kl.yaml.

Each run trains the embedded multi-turn task (data.embedded_task=digitsum_tool) at one β with the KL placed in the
reward or in the loss, with or without kl.loss_to_go, and validates exactly: every trajectory of the 4 validation
prompts is enumerated, so J_β(π) = E_π[r] − β·KL(π‖π_ref) over the model's tokens and its gap to π*_β are exact.
Two tables: the exact objective gap J_β(π*_β) − J_β(π) at each validation, and at the last validation the gap,
KL(π‖π*_β), KL(π‖π_ref), the expected reward, the tool-call rate and the effective number of distinct trajectories
(exp of the sequence entropy of the answers; π*'s and the reference's beside them). Runs of one setting over seeds
are one row: the mean and, in brackets, the seeds' range.

Usage: python scripts/agent_kl_table.py runs/agents/kl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

COLUMNS = (  # (metric, header, format)
    ("exact/objective_gap", "gap J(π*) − J(π)", ".3f"),
    ("exact/kl_opt_seq", "KL(π‖π*) nats/traj.", ".2f"),
    ("exact/kl_ref_seq", "KL(π‖π_ref) nats/traj.", ".3f"),
    ("exact/score_mean", "E[r]", ".3f"),
    ("exact/tool_call_rate", "tool calls", ".3f"),
    ("exact/effective_answers", "effective answers", ".0f"),
)


def _label(cfg: dict) -> str:
    kl = cfg["kl"]
    where = kl["placement"]
    est = kl.get("loss_estimator") or kl["estimator"] if where == "loss" else kl["estimator"]
    to_go = " + KL-to-go" if kl.get("loss_to_go") else ""
    return f"{est} in the {where}{to_go} (β = {kl['coef']:g})"


def validations(run: Path) -> tuple[str, dict, list[dict]] | None:
    """(label, config, the records that hold the exact evaluation) of one run; None without two of them."""
    if not (run / "config.yaml").is_file() or not (run / "metrics.jsonl").is_file():
        return None
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    vals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "exact/objective_gap" in r]
    return (_label(cfg), cfg, vals) if len(vals) >= 2 else None


def _cell(xs: list[float], fmt: str) -> str:
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} [{format(min(xs), fmt)}, {format(max(xs), fmt)}]"


def tables(root: Path) -> str:
    runs: dict[str, list[list[dict]]] = {}
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        got = validations(run)
        if got is not None:
            runs.setdefault(got[0], []).append(got[2])
    if not runs:
        return f"{root}: no run with two exact validations yet"
    order = sorted(runs, key=lambda s: ("reward" not in s, "to-go" in s, s))
    steps = sorted({r["step"] for vs in runs.values() for v in vs for r in v})
    out = ["| setting | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for label in order:
        cells = []
        for s in steps:
            xs = [r["exact/objective_gap"] for v in runs[label] for r in v if r["step"] == s]
            cells.append(format(sum(xs) / len(xs), ".3f") if xs else "")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out += ["", "| setting | seeds | last step | " + " | ".join(h for _, h, _ in COLUMNS) + " |"]
    out.append("|---|---|---|" + "---|" * len(COLUMNS))
    first = runs[order[0]][0][-1]
    out.append(
        "| π*_β (exact optimum) | | | 0 | 0 | "
        f"{first['exact/opt_kl_ref_seq']:.3f} | {first['exact/opt_score_mean']:.3f} | "
        f"{first['exact/opt_tool_call_rate']:.3f} | {first['exact/opt_effective_answers']:.0f} |"
    )
    out.append(
        f"| π_ref (the reference) | | | | | 0 | {first['exact/ref_score_mean']:.3f} | "
        f"{first['exact/ref_tool_call_rate']:.3f} | {first['exact/ref_effective_answers']:.0f} |"
    )
    for label in order:
        last = [v[-1] for v in runs[label]]
        out.append(
            f"| {label} | {len(last)} | {max(r['step'] for r in last)} | "
            + " | ".join(_cell([r[k] for r in last], f) for k, _, f in COLUMNS)
            + " |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="the sweep's out directory (runs/agents/kl)")
    a = ap.parse_args(argv)
    if not a.root.is_dir():
        print(f"{a.root}: no such directory; run tether sweep scripts/sweeps/agent_kl.yaml first", file=sys.stderr)
        return 2
    print(tables(a.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
