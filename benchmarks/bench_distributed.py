"""Throughput of the local backend vs the Ray backend at world size 1 and 2, on the embedded task.

    python benchmarks/bench_distributed.py [--steps N] [--batch-size P] [--n R]

Each configuration trains ``--steps`` steps (validation and checkpoints off) of the embedded digit-sum
task in this process; the table gives, over the steps after the first, the mean wall time of the
training phases per step (rollout → reward → log-probs → KL → advantages → update; timing/*_s),
response tokens per second (perf/tokens_per_s), the update and log-prob phases alone, and the
driver's overhead per step: the Ray configuration's step time minus the local one's at the same
batch (serialising the batch, dispatch, gathering, and pulling the updated weights into the
driver's copy for the next rollout). Ray starts once (its ~10 s start is not in the table).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

PHASES = ("rollout", "reward", "logprobs", "values", "kl", "advantages", "update_critic", "update_actor", "controller")


def run(label: str, overrides: list[str], steps: int, root: Path) -> dict:
    from tether.config import load_config
    from tether.trainer.trainer import Trainer

    cfg = load_config(
        None,
        [
            *overrides,
            f"trainer.total_steps={steps}",
            "trainer.val_freq=0",
            "trainer.save_freq=0",
            "trainer.report=false",
            "trainer.loggers=[jsonl]",
            "trainer.progress=false",
            f"trainer.output_dir={root / label}",
        ],
    )
    trainer = Trainer(cfg)
    rows = [trainer.train_step() for _ in range(steps)][1:]  # the first step warms up
    trainer.roles.close()

    def mean(key):
        return statistics.mean(r.get(key, 0.0) for r in rows)

    step_s = statistics.mean(sum(r.get(f"timing/{p}_s", 0.0) for p in PHASES) for r in rows)
    return {
        "label": label,
        "step_s": step_s,
        "tok_s": mean("perf/tokens_per_s"),
        "update_s": mean("timing/update_actor_s"),
        "logprobs_s": mean("timing/logprobs_s"),
        "rollout_s": mean("timing/rollout_s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per step (data.batch_size)")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt (rollout.n)")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    root = Path(tempfile.mkdtemp(prefix="tether-bench-dist-"))
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(os.cpu_count() or 1, 2))
    base = [f"data.batch_size={args.batch_size}", f"rollout.n={args.n}"]
    results = [
        run("local", base, args.steps, root),
        run("ray, 1 worker", [*base, "trainer.backend=ray", "trainer.n_workers=1"], args.steps, root),
        run("ray, 2 workers", [*base, "trainer.backend=ray", "trainer.n_workers=2"], args.steps, root),
    ]
    ray.shutdown()
    local = results[0]["step_s"]
    print(
        f"embedded task, {args.batch_size} prompts x {args.n} responses per step, {args.steps - 1} timed steps, "
        f"{os.cpu_count()} CPU cores\n"
    )
    print("| backend | step s | tokens/s | rollout s | log-probs s | update s | step time vs local s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        over = "-" if r["label"] == "local" else f"{r['step_s'] - local:+.3f}"
        print(
            f"| {r['label']} | {r['step_s']:.3f} | {r['tok_s']:.0f} | {r['rollout_s']:.3f} | {r['logprobs_s']:.3f} | "
            f"{r['update_s']:.3f} | {over} |"
        )


if __name__ == "__main__":
    main()
