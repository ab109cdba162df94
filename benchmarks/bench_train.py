"""Wall time and outcome of `tether train` with no arguments (the README's demo), end to end.

    python benchmarks/bench_train.py [--runs N] [--threads T] [--keep DIR]

Runs the `tether` console script with no arguments in a fresh temporary working directory (so
the run directory is the default `runs/<timestamp>`), N times, and prints a table: wall time
(process start to exit, model loading and the report included), steps, the exact success rate of
the reference and of the trained policy on the validation prompts (by enumeration), the sampled
validation score, and the final per-token KL to the reference. --keep copies the last run's
directory (metrics, report plots) to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_once(threads: int | None) -> tuple[float, Path, Path]:
    work = Path(tempfile.mkdtemp(prefix="tether-bench-"))
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    exe = shutil.which("tether") or f"{sys.executable} -m tether.cli"
    t0 = time.perf_counter()
    subprocess.run(
        exe.split() + ["train"], cwd=work, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wall = time.perf_counter() - t0
    (run,) = list((work / "runs").iterdir())
    return wall, run, work


def summarize(run: Path) -> dict:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    vals = [r for r in recs if "exact/score_mean" in r]
    last = recs[-1]
    return {
        "steps": last["step"],
        "ref_exact": vals[-1]["exact/ref_score_mean"],
        "first_val_exact": vals[0]["exact/score_mean"],
        "final_exact": vals[-1]["exact/score_mean"],
        "final_val": vals[-1]["val/score_mean"],
        "kl_tok_exact": vals[-1]["exact/kl_ref_tok"],
        "kl_tok_sampled": last["kl/ref_mean"],
        "opt_kl_tok": vals[-1].get("exact/opt_kl_ref_seq", float("nan")) / 4,
        "train_s": sum(
            v for r in recs for k, v in r.items() if k.startswith("timing/") and isinstance(v, (int, float))
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the run (default: torch's choice)")
    ap.add_argument("--keep", default=None, help="copy the last run directory here")
    args = ap.parse_args()
    print(f"cpu cores: {os.cpu_count()}  python: {sys.version.split()[0]}")
    print(
        "| run | wall s | loop s | steps | ref success (exact) | trained success (exact) | val score (sampled) | "
        "KL/token exact | KL/token sampled |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for i in range(args.runs):
        wall, run, work = run_once(args.threads)
        s = summarize(run)
        print(
            f"| {i + 1} | {wall:.1f} | {s['train_s']:.1f} | {s['steps']} | {s['ref_exact']:.3f} | "
            f"{s['final_exact']:.3f} | {s['final_val']:.3f} | {s['kl_tok_exact']:.3f} | {s['kl_tok_sampled']:.3f} |"
        )
        if args.keep and i == args.runs - 1:
            shutil.rmtree(args.keep, ignore_errors=True)
            shutil.copytree(run, args.keep)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
