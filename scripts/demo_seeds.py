"""The README's demo over several seeds: the endpoints' range, and whether two runs are bit-identical.

    for s in 0 1 2 3 4; do tether train trainer.seed=$s trainer.output_dir=runs/demo-seeds/seed$s; done
    tether train trainer.seed=0 trainer.output_dir=runs/demo-seeds/seed0-again
    python scripts/demo_seeds.py runs/demo-seeds/seed{0,1,2,3,4} --same runs/demo-seeds/seed0
    runs/demo-seeds/seed0-again

Per run (its ``metrics.jsonl``): the exact success rate on the held-out prompts (``exact/score_mean``)
of the reference (step 0) and at the last validation, the best validation, the per-token KL to the
reference (``exact/kl_ref_tok``, nats per token), the effective number of distinct correct answers
(``exact/correct_effective_answers``), the rollback steps and the β values used (``kl/coef``); then
min, median and max over the runs. ``--same A B`` counts the values of A's and B's metrics that
differ (``timing/*`` and ``perf/*`` aside): 0 means bit-identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COLUMNS = ("ref", "final", "best", "kl_tok", "correct_answers")


def read(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def endpoints(run: Path) -> dict:
    recs = read(run)
    val = [r for r in recs if "exact/score_mean" in r]
    last = val[-1]
    return {
        "run": run.name,
        "steps": recs[-1]["step"],
        "ref": val[0]["exact/score_mean"],
        "final": last["exact/score_mean"],
        "best": max(r["exact/score_mean"] for r in val[1:]),
        "kl_tok": last["exact/kl_ref_tok"],
        "correct_answers": last["exact/correct_effective_answers"],
        "rollbacks": [r["step"] for r in recs if r.get("guard/rollback")],
        "betas": sorted({round(r["kl/coef"], 6) for r in recs if "kl/coef" in r}),
    }


def differing(a: Path, b: Path) -> tuple[int, int]:
    """(values compared, values that differ) between two runs' metrics, timing/perf aside."""
    ra, rb = read(a), read(b)
    n = diff = abs(len(ra) - len(rb))
    for x, y in zip(ra, rb, strict=False):
        for k in x.keys() | y.keys():
            if not k.startswith(("timing/", "perf/")):
                n += 1
                diff += x.get(k) != y.get(k)
    return n, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--same", nargs=2, type=Path, metavar=("A", "B"))
    args = p.parse_args()
    rows = [endpoints(r) for r in args.runs]
    print("| run | steps | " + " | ".join(COLUMNS) + " | rollbacks at | β used |")
    print("|---" * (len(COLUMNS) + 4) + "|")
    for r in rows:
        cells = " | ".join(f"{r[c]:.4f}" if c != "correct_answers" else f"{r[c]:.1f}" for c in COLUMNS)
        print(f"| {r['run']} | {r['steps']} | {cells} | {r['rollbacks'] or '-'} | {r['betas']} |")
    for name, fn in (("min", min), ("median", statistics.median), ("max", max)):
        print(f"| {name} | | " + " | ".join(f"{fn(r[c] for r in rows):.4f}" for c in COLUMNS) + " | | |")
    if args.same:
        n, diff = differing(*args.same)
        print(
            f"\n{args.same[0]} vs {args.same[1]}: {diff} of {n} values differ"
            + (" (bit-identical)" if not diff else "")
        )


if __name__ == "__main__":
    main()
