"""Why `rollout.async_steps=1` does or does not overlap: per-thread CPU time, GIL share, snapshot copy (issue 13).

    python benchmarks/bench_async_threads.py [--models tiny,small] [--steps 5] [--workdir .tmp/bench_peer]

Uses the models and prompts that ``bench_peer_trl.py`` builds (it builds them if missing), on its
workload (8 prompts × 8, 32 tokens, EOS blocked), in this process with one torch thread.

1. **Threads.** tether sync, async (``rollout.async_steps=1``) and async with the sampled-token
   log-probs (``actor.old_logprobs_source=rollout``), ``--steps`` steps each (the first left out):
   wall and process CPU per step, the main thread's CPU (``time.thread_time``), and the background
   job's CPU and wall per batch. Overlap shows as process CPU > wall; a job whose wall far exceeds
   its CPU waited (for a core or the GIL).
2. **GIL share of generation.** HF ``generate`` on the workload under ``torch.profiler``: the time
   inside top-level ``aten::`` ops (PyTorch's bindings release the GIL before dispatch) against the
   wall; the rest is Python, holding the GIL, which the training thread then cannot have.
3. **Snapshot copy.** The copy of the trainable weights into the snapshot before each job.
4. **Threads of a new thread.** ``torch.set_num_threads(1)`` on the main thread, then 512² matmuls
   on two threads: a thread whose first op is a matmul runs MKL with its default thread count
   until some ``at::parallel_for`` op initialises it (without ``OMP_NUM_THREADS=1``/``MKL_NUM_THREADS=1``
   in the environment), one whose first op is elementwise does not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_peer_trl as peer  # noqa: E402


def threads_row(name: str, work: Path, steps: int, mode: str) -> dict:
    import tether.trainer.async_rollout as ar
    from tether.config import load_config
    from tether.trainer import Trainer

    job: list[tuple[float, float]] = []
    orig = ar.AsyncRollout._produce

    def produce(self, indices):
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return orig(self, indices)
        finally:
            job.append((time.thread_time() - c0, time.perf_counter() - t0))

    ar.AsyncRollout._produce = produce
    extra = {
        "sync": [],
        "async": ["rollout.async_steps=1"],
        "async-rlp": ["rollout.async_steps=1", "actor.old_logprobs_source=rollout"],
    }[mode]
    out = work / "runs" / f"threads-{mode}-{name}-{time.time_ns()}"
    cfg = load_config(
        None,
        peer.tether_overrides(work / f"qwen2-{name}", work / f"prompts-{name}.jsonl", steps, peer.NEW_TOKENS, out)
        + extra,
    )
    trainer = Trainer(cfg)
    trainer.roles.engine.engine.kwargs["suppress_tokens"] = list(trainer.roles.engine.eos_token_ids)
    rows = []
    try:
        for _ in range(steps):
            w0, p0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            trainer.train_step()
            rows.append((time.perf_counter() - w0, time.process_time() - p0, time.thread_time() - m0))
    finally:
        ar.AsyncRollout._produce = orig
        if trainer.async_rollout is not None:
            trainer.async_rollout.close()
    med = [statistics.median(r[i] for r in rows[1:]) for i in range(3)]
    jobs = job[1:] or [(0.0, 0.0)]
    return {
        "wall": med[0],
        "cpu": med[1],
        "main_cpu": med[2],
        "job_cpu": statistics.median(c for c, _ in jobs),
        "job_wall": statistics.median(w for _, w in jobs),
    }


def gil_share(name: str, work: Path) -> tuple[float, float]:
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(work / f"qwen2-{name}", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (peer.N_PROMPTS * peer.GROUP, peer.PROMPT_TOKENS), generator=g)
    kw = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        max_new_tokens=peer.NEW_TOKENS,
        suppress_tokens=[2],
        pad_token_id=0,
        eos_token_id=[2],
        top_k=0,
    )
    with torch.no_grad():
        model.generate(input_ids=ids, **kw)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            model.generate(input_ids=ids, **kw)
            wall = time.perf_counter() - t0
    inside = sum(e.cpu_time_total for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")) / 1e6
    return wall, inside / wall


def snapshot_copy_ms(name: str, work: Path) -> float:
    from transformers import AutoModelForCausalLM

    from tether.trainer.async_rollout import snapshot_model

    model = AutoModelForCausalLM.from_pretrained(work / f"qwen2-{name}", dtype=torch.float32)
    params = dict(snapshot_model(model).named_parameters())
    ts = []
    for _ in range(20):
        t0 = time.perf_counter()
        with torch.no_grad():
            for k, p in model.named_parameters():
                params[k].copy_(p)
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def two_threads(elementwise_first: bool, n: int = 300) -> tuple[float, float]:
    a = torch.randn(512, 512)

    def work(first: bool):
        if first:
            torch.randn(100_000).add_(1)  # an at::parallel_for kernel: the thread's pools are initialised
        for _ in range(n):
            a @ a

    t0, c0 = time.perf_counter(), time.process_time()
    th = threading.Thread(target=work, args=(elementwise_first,))
    th.start()
    work(False)
    th.join()
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--workdir", default=str(HERE.parent / ".tmp" / "bench_peer"))
    # internal: item 4 in a fresh process
    ap.add_argument("--two-threads", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.two_threads is not None:
        print(*two_threads(bool(args.two_threads)))
        return
    work = Path(args.workdir)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    print(
        f"# load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}\n"
    )
    print("| model | variant | wall s/step | process CPU s/step | CPU / wall | main thread CPU | job CPU | job wall |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.models.split(","):
        peer.build_model(work / f"qwen2-{name}", name)
        peer.build_prompts(work / f"prompts-{name}.jsonl", peer.N_PROMPTS, (peer.PROMPT_TOKENS, peer.PROMPT_TOKENS))
        for mode in ("sync", "async", "async-rlp"):
            r = threads_row(name, work, args.steps, mode)
            job = (f"{r['job_cpu']:.3f} | {r['job_wall']:.3f}") if mode != "sync" else " | "
            print(
                f"| {name} | {mode} | {r['wall']:.3f} | {r['cpu']:.3f} | {r['cpu'] / r['wall']:.2f} | "
                f"{r['main_cpu']:.3f} | {job} |",
                flush=True,
            )
    print()
    for name in args.models.split(","):
        wall, share = gil_share(name, work)
        print(
            f"* {name}: generate {wall:.3f} s (profiled); inside aten ops {share:.0%}, Python (GIL held) "
            f"~{1 - share:.0%}; snapshot copy {snapshot_copy_ms(name, work):.2f} ms"
        )
    # the pools' own defaults
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    for first in (False, True):
        out = subprocess.run(
            [sys.executable, __file__, "--two-threads", str(int(first))],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        w, c = map(float, out.stdout.split())
        print(
            "* two threads x 300 matmuls 512² (no OMP/MKL_NUM_THREADS), second thread's first op "
            f"{'elementwise' if first else 'a matmul'}: {w:.2f} s wall, {c:.2f} s CPU"
        )


if __name__ == "__main__":
    main()
