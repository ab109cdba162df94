"""False alarms of the hacking monitor with a sampled gold (docs/hacking.md, issue 34): replays the live checks on
honest runs' metrics.jsonl (no run is started here) and prints the warnings per run and in total.

    tether sweep scripts/sweeps/hacking_honest.yaml                        # the 20 honest runs
    python benchmarks/bench_hacking_false_alarms.py runs/hacking/honest/*  # their false alarms
    python benchmarks/bench_hacking_false_alarms.py --simulate 4000        # the stationary-gold simulation

A run's exact gold metrics (exact/gold_*) are removed before the replay, so hacking_gold reads the sampled
val/gold_mean with its val/gold_sem, as a run off the embedded prompts would. Every warning of a run that did not hack
(its exact gold never below the reference's, where logged) is a false alarm; the goal is at most one in 20 runs. A run
that hacked (an exact onset) is not an honest run, nor one whose guard rolled back or stopped (guard.on_hacking=
rollback|stop: whether it would have hacked is unknown): both are left out of the count, and the total says how many.
Paths that are plain files are skipped; a missing path or a directory without metrics.jsonl is an error (exit 2).
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


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ {low}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be ≥ {low}, got {v}")
        return v

    return parse


def main(argv: list[str] | None = None) -> None:
    mon = _monitor()
    ap = argparse.ArgumentParser(prog=Path(__file__).name, description=mon.description(__doc__))
    ap.add_argument("runs", nargs="*", type=Path, help="run directories (plain files among them are skipped)")
    ap.add_argument(
        "--simulate", type=_at_least(0), default=0, metavar="N", help="simulated stationary runs (default 0: none)"
    )
    ap.add_argument(
        "--per-prompt",
        type=_at_least(2),
        default=32,
        metavar="M",
        help="simulated samples per prompt, 4 prompts (default 32; at least 2 for a standard error)",
    )
    args = ap.parse_args(argv)
    if not args.runs and not args.simulate:
        ap.error("give run directories or --simulate N")
    if args.simulate:
        warned = simulate(args.simulate, per_prompt=args.per_prompt)
        print(f"simulated stationary runs that warned: {warned} of {args.simulate} ({args.per_prompt} a prompt)")
    runs = mon.read_runs(ap.prog, args.runs) if args.runs else []
    total = n = hacked = guarded = 0
    for run in runs:
        h = read_metrics(run)
        if not any("val/gold_sem" in r for r in h):
            print(f"{run.name}: no sampled gold (val/gold_sem): skipped", file=sys.stderr)
            continue
        onset = mon.exact_onset(h)[0]
        exact = any(isinstance(r.get("exact/gold_mean"), float) for r in h)
        steps = mon.warnings(h, gold="sampled")["hacking_gold"]
        last = max((r["step"] for r in h), default=0)
        at = "n/a (no exact gold)" if not exact else "none" if onset is None else onset
        acted = sorted(mon.guard_actions(h)) if mon.guard_mode(run) else []
        if onset is not None:  # it hacked: its warnings are not false alarms, and it is not an honest run
            hacked += 1
            note = ": hacked, not counted"
        elif acted:  # its guard rolled back or stopped: whether it would have hacked is unknown
            guarded += 1
            note = f": guard.on_hacking={mon.guard_mode(run)}, guard rolled back or stopped at {acted}, not counted"
        else:
            n += 1
            total += len(steps)
            note = ""
        print(f"{run.name}: {last} steps, exact onset {at}, sampled-gold warnings at {steps or 'none'}{note}")
    if runs:
        left = [f"{hacked} that hacked by the exact onset"] if hacked else []
        left += [f"{guarded} whose guard rolled back or stopped"] if guarded else []
        left = f" (runs left out: {'; '.join(left)})" if left else ""
        print(f"false alarms with a sampled gold: {total} in {n} honest runs{left}")


if __name__ == "__main__":
    main()
