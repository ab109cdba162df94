"""False alarms of the hacking monitor with a sampled gold (docs/hacking.md, issue 34): replays the live checks on
honest runs' metrics.jsonl (no run is started here) and prints the warnings per run and in total.

    tether sweep scripts/sweeps/hacking_honest.yaml                        # the 20 honest runs
    python benchmarks/bench_hacking_false_alarms.py runs/hacking/honest/*  # their false alarms
    python benchmarks/bench_hacking_false_alarms.py --simulate 4000        # the stationary-gold simulation

A run's exact gold metrics (exact/gold_*) are removed before the replay, so hacking_gold reads the sampled
val/gold_mean with its val/gold_sem, as a run off the embedded prompts would. Every warning of a run that did not hack
(its exact gold never below the reference's, where logged) is a false alarm; the goal is at most one in 20 runs.
--simulate counts runs that warn among N simulated 30-validation runs of a stationary gold (4 prompts at
p = 0.9, 0.8, 0.75, 0.6, 32 samples each, or --per-prompt M).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np

from tether.diagnostics import gold_warn_flags, read_metrics


def _monitor():
    path = Path(__file__).resolve().parents[1] / "scripts" / "hacking_monitor.py"
    spec = importlib.util.spec_from_file_location("hacking_monitor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def simulate(runs: int, validations: int = 30, seed: int = 0, per_prompt: int = 32) -> int:
    rng = np.random.default_rng(seed)
    p = np.array([0.9, 0.8, 0.75, 0.6])
    warned = 0
    for _ in range(runs):
        g, s = [], []
        for _ in range(validations):
            x = (rng.random((4, per_prompt)) < p[:, None]).astype(float)
            g.append(float(x.mean()))
            s.append(math.sqrt(float(sum(per_prompt * row.var(ddof=1) for row in x))) / x.size)
        warned += any(w is not None for w in gold_warn_flags(g, s, [0.5] * validations, [0.0] * validations))
    return warned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--simulate", type=int, default=0, metavar="N")
    ap.add_argument("--per-prompt", type=int, default=32, metavar="M", help="simulated samples per prompt (4 prompts)")
    args = ap.parse_args()
    if args.simulate:
        warned = simulate(args.simulate, per_prompt=args.per_prompt)
        print(f"simulated stationary runs that warned: {warned} of {args.simulate} ({args.per_prompt} a prompt)")
    mon = _monitor()
    total = n = 0
    for run in args.runs:
        if not (run / "metrics.jsonl").is_file():
            continue
        h = read_metrics(run)
        if not any("val/gold_sem" in r for r in h):
            print(f"{run.name}: no sampled gold (val/gold_sem): skipped", file=sys.stderr)
            continue
        onset = mon.exact_onset(h)[0]
        steps = mon.warnings(h, gold="sampled")["hacking_gold"]
        last = max(r.get("step", 0) for r in h)
        n += 1
        total += len(steps) if onset is None else 0
        print(f"{run.name}: {last} steps, exact onset {onset or 'none'}, sampled-gold warnings at {steps or 'none'}")
    if n:
        print(f"false alarms with a sampled gold: {total} in {n} honest runs")


if __name__ == "__main__":
    main()
