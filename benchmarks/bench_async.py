"""Wall time and CPU time per step of ``rollout.async_steps=1`` (one-step off-policy overlap) against 0.

    python benchmarks/bench_async.py [--steps 5] [--warmup 1] [--repeats 2] [--cases
    small-local,small-ray1,embedded-local]

Each case runs ``async_steps=0`` and ``=1`` in alternating fresh processes (0 1 0 1 ...), one torch
thread per Python thread (``trainer.threads=1``). A process builds the trainer, runs ``--warmup``
steps, then times ``--steps`` steps: wall seconds (``time.perf_counter``) and the driver process's
CPU seconds (``time.process_time``: all its threads, so the local background thread is included,
the Ray workers' processes are not). Printed per case: median s/step and CPU s/step of each
setting, the speed-up (median sync / median async) with the range over the repeats, and the
medians of the step's phases (``timing/*``) and of the background job's own
``timing/async_generate_s`` and ``timing/async_logprobs_s``.

Cases (model and workload of ``benchmarks/bench_peer_trl.py``):

* ``small-local``: Qwen2 5.2M parameters, vocab 2000, 8 prompts x 8 responses of 32 tokens (EOS
  blocked), GRPO with a k3 KL loss, one mini-batch; trainer.backend=local.
* ``small-ray1`` / ``small-ray2``: the same with trainer.backend=ray and 1 or 2 workers (the driver
  generates with HF generate while the workers train).
* ``embedded-local``: the embedded digit-sum default (81k-parameter Llama, 4-token responses):
  Python-bound, so the two threads mostly take turns holding the GIL.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]

CASES = {
    "small-local": ("small", []),
    "small-ray1": ("small", ["trainer.backend=ray", "trainer.n_workers=1"]),
    "small-ray2": ("small", ["trainer.backend=ray", "trainer.n_workers=2"]),
    "embedded-local": ("embedded", []),
}
PHASES = (
    "timing/rollout_s",
    "timing/reward_s",
    "timing/logprobs_s",
    "timing/update_actor_s",
    "timing/rollout_join_s",
    "timing/async_generate_s",
    "timing/async_logprobs_s",
)


def _peer():
    spec = importlib.util.spec_from_file_location("bench_peer_trl", HERE.parent / "bench_peer_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(args) -> dict:
    import torch

    torch.set_num_threads(1)
    from tether.config import load_config
    from tether.trainer import Trainer

    common = [
        "trainer.val_freq=0",
        "trainer.save_freq=0",
        "trainer.loggers=[jsonl]",
        "trainer.progress=false",
        "trainer.report=false",
        "trainer.threads=1",
        "trainer.device=cpu",
        f"trainer.output_dir={args.run_dir}",
        "trainer.resume=off",
        "trainer.total_steps=100000",
    ]
    if args.workload == "embedded":
        overrides = common
    else:
        peer = _peer()
        overrides = peer.tether_overrides(
            Path(args.model), Path(args.prompts), args.steps, peer.NEW_TOKENS, Path(args.run_dir)
        )
    cfg = load_config(None, overrides + [f"rollout.async_steps={args.async_steps}", *args.extra])
    trainer = Trainer(cfg)
    # EOS blocked: every response is 32 tokens (the snapshot's engine shares these kwargs)
    if args.workload != "embedded":
        trainer.roles.engine.engine.kwargs["suppress_tokens"] = list(trainer.roles.engine.eos_token_ids)
    out = []
    for i in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        m = trainer.train_step()
        rec = {
            "s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0,
            "approx_kl": m.get("policy/approx_kl"),
            "reward": m.get("reward/score_mean"),
        } | {k: m.get(k, 0.0) for k in PHASES}
        if i >= args.warmup:
            out.append(rec)
    if trainer.async_rollout is not None:
        trainer.async_rollout.close()
    trainer.roles.close()
    return {"steps": out}


def run_worker(case: str, async_steps: int, model: Path | None, prompts: Path | None, work: Path, args) -> dict:
    workload, extra = CASES[case]
    run_dir = work / f"{case}-{async_steps}-{time.time_ns()}"
    cmd = [
        sys.executable,
        str(HERE),
        "--worker",
        "--workload",
        workload,
        "--async-steps",
        str(async_steps),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--model",
        str(model or ""),
        "--prompts",
        str(prompts or ""),
    ]
    cmd += [f"--extra={e}" for e in extra]
    env = dict(
        os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1"
    )
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{case} async_steps={async_steps} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def med(steps: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def report(case: str, runs: dict[int, list[dict]]) -> list[str]:
    sync = [med(r["steps"], "s") for r in runs[0]]
    asyn = [med(r["steps"], "s") for r in runs[1]]
    ratios = [a / b for a, b in zip(sync, asyn, strict=True)]
    lines = [
        f"\n### {case}\n",
        "| async_steps | s/step (median of runs) | CPU s/step | "
        + " | ".join(p.removeprefix("timing/") for p in PHASES)
        + " |",
        "| --- | ---: | ---: |" + " ---: |" * len(PHASES),
    ]
    for a in (0, 1):
        all_steps = [s for r in runs[a] for s in r["steps"]]
        cells = [f"{med(all_steps, p):.3f}" for p in PHASES]
        lines.append(
            f"| {a} | {statistics.median(sync if a == 0 else asyn):.3f} | {med(all_steps, 'cpu_s'):.3f} | "
            + " | ".join(cells)
            + " |"
        )
    lines.append(
        f"\nspeed-up (sync s/step / async s/step): {statistics.median(ratios):.2f}x, range "
        f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} pairs"
    )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cases", default="small-local,small-ray1,embedded-local")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="small", help=argparse.SUPPRESS)
    ap.add_argument("--async-steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", default="", help=argparse.SUPPRESS)
    ap.add_argument("--extra", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    work = Path(tempfile.mkdtemp(prefix="tether-bench-async-", dir=os.environ.get("TMPDIR")))
    peer = _peer()
    model = peer.build_model(work / "small", "small")
    prompts = peer.build_prompts(work / "prompts.jsonl", 64, (peer.PROMPT_TOKENS, peer.PROMPT_TOKENS))
    print(
        f"# bench_async: {args.steps} timed steps after {args.warmup} warm-up, {args.repeats} repeats, "
        f"os.cpu_count()={os.cpu_count()}"
    )
    for case in args.cases.split(","):
        runs: dict[int, list[dict]] = {0: [], 1: []}
        for _ in range(args.repeats):
            for a in (0, 1):
                runs[a].append(run_worker(case, a, model, prompts, work, args))
        print("\n".join(report(case, runs)), flush=True)


if __name__ == "__main__":
    main()
