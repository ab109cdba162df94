"""Where one training step's time goes, by kernel class, and the floor the matmuls alone set (issue 13).

    PYTHONPATH=src python benchmarks/bench_step_profile.py [--models tiny,small] [--tether-args
    actor.compute_dtype=bfloat16]
    .venv-trl/bin/python benchmarks/bench_step_profile.py --trl [--trl-bf16]     # TRL 1.16's step too

Runs ``bench_peer_trl.py``'s workload (GRPO, 8 prompts × G = 8, 32 new tokens with EOS blocked, β = 0.04
k3 in the loss, one optimizer step per batch, fp32 unless overridden, one torch thread) in this
process: ``--warmup`` steps, then ``--steps`` timed steps (their median wall time is the step), then one
step under ``torch.profiler`` with FLOP counting (TRL's steps run in its own ``train()`` loop, timed
and profiled by a callback). Each library's step (tether's, and TRL's
``GRPOTrainer`` with ``--trl``) is split into:

* **linear matmuls**: ``aten::mm``/``addmm`` (every projection, MLP and LM-head product, forward and
  backward), with the FLOPs the profiler counts from their shapes;
* **attention**: the SDPA/flash kernels (forward and backward) and ``aten::bmm`` (tether's matmul path);
* **sampling**: ``aten::exponential_`` (``torch.multinomial``'s draws);
* **everything else**: the unprofiled step's median wall time less those three (element-wise ops,
  norms, rotary, casts, log-softmax, the optimizer, and the Python, autograd and dispatch around
  every kernel; the profiler's own per-kernel overhead lands on none of the three big classes).

Then the floor: the linear matmuls' FLOPs at this core's peak, the best of (n × n) @ (n × n) matmuls
for n in 512, 1024, 2048 in the step's compute dtype (``tether.trainer.perf.matmul_ceiling_flops``).
With ``--trl`` it prints what 2× TRL's step leaves for everything but those matmuls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import bench_peer_trl as peer  # noqa: E402

CLASSES = ("linear matmuls", "attention", "sampling", "everything else")


def classify(name: str) -> str:
    if name in ("aten::mm", "aten::addmm"):
        return "linear matmuls"
    if "scaled_dot_product" in name or "flash_attention" in name or name == "aten::bmm":
        return "attention"
    if name == "aten::exponential_":
        return "sampling"
    return "everything else"


def peak_flops(dtype) -> float:
    import torch

    from tether.trainer.perf import matmul_ceiling_flops

    return max(matmul_ceiling_flops(torch.device("cpu"), dtype, n=n) for n in (512, 1024, 2048))


def tether_steps(model: Path, prompts: Path, run_dir: Path, extra: list[str]):
    from tether.config import load_config
    from tether.trainer import Trainer

    cfg = load_config(None, peer.tether_overrides(model, prompts, 100, peer.NEW_TOKENS, run_dir) + extra)
    trainer = Trainer(cfg)
    peer.block_eos(trainer)
    dtype = cfg.actor.compute_dtype or cfg.actor.dtype
    return trainer.train_step, dtype


def measure(step, warmup: int, steps: int) -> tuple[float, dict[str, float], float]:
    """(median wall s of ``steps`` calls of ``step()`` after ``warmup``, seconds per class, linear-matmul FLOPs)
    with one more call profiled."""
    for _ in range(warmup):
        step()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
    prof = start_profile()
    step()
    return finish(prof, statistics.median(walls))


def measure_trl(model: Path, prompts: Path, run_dir: Path, bf16: bool, warmup: int, steps: int):
    """:func:`measure` for TRL's ``GRPOTrainer``: its own ``train()`` loop, timed and profiled by a callback."""
    from transformers import TrainerCallback

    trainer = peer.trl_trainer(model, prompts, run_dir, warmup + steps + 1, bf16=bf16)
    walls: list[float] = []
    state: dict = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, st, control, **k):
            if st.global_step == warmup + steps:
                state["prof"] = start_profile()
            state["t0"] = time.perf_counter()

        def on_step_end(self, args, st, control, **k):
            if "prof" in state:
                state["result"] = finish(state.pop("prof"), statistics.median(walls))
            elif st.global_step > warmup:
                walls.append(time.perf_counter() - state["t0"])

    trainer.add_callback(Clock())
    trainer.train()
    return state["result"]


def start_profile():
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], with_flops=True)
    prof.__enter__()
    return prof


def finish(prof, wall: float) -> tuple[float, dict[str, float], float]:
    """(wall, seconds per class, linear-matmul FLOPs) from a profile started by :func:`start_profile`."""
    prof.__exit__(None, None, None)
    secs = dict.fromkeys(CLASSES, 0.0)
    flops = 0.0
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue  # autograd nodes and Python-level ranges: their kernels are counted under aten::
        c = classify(e.key)
        if c != CLASSES[-1]:
            secs[c] += e.self_cpu_time_total / 1e6
        if c == "linear matmuls":
            flops += e.flops
    secs[CLASSES[-1]] = max(0.0, wall - sum(secs.values()))
    return wall, secs, flops


def table(rows: list[tuple[str, float, dict[str, float], float, float]]) -> list[str]:
    out = [
        "| library | step s (median) | "
        + " | ".join(CLASSES)
        + " | matmul GFLOP | matmul GFLOP/s | floor s (matmuls at peak) |",
        "| --- | ---: | " + " | ".join("---:" for _ in CLASSES) + " | ---: | ---: | ---: |",
    ]
    for lib, wall, secs, flops, peak in rows:
        cells = " | ".join(f"{secs[c]:.3f} ({secs[c] / wall:.0%})" for c in CLASSES)
        mm = secs["linear matmuls"]
        out.append(
            f"| {lib} | {wall:.3f} | {cells} | {flops / 1e9:.1f} | {flops / mm / 1e9 if mm else 0:.1f} | "
            f"{flops / peak:.3f} |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--tether-args", nargs="*", default=[], help="tether overrides, e.g. actor.compute_dtype=bfloat16")
    ap.add_argument("--trl", action="store_true", help="profile TRL 1.16's step too (run with .venv-trl/bin/python)")
    ap.add_argument("--trl-bf16", action="store_true", help="TRL with bf16=True")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workdir", default=str(peer.ROOT / ".tmp" / "bench_step_profile"))
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in peer.MODELS]
    if not models or unknown:
        ap.error(
            f"--models: {'unknown ' + ', '.join(map(repr, unknown)) if unknown else 'none given'}; the bench models "
            f"are {', '.join(peer.MODELS)}"
        )
    if args.steps < 1 or args.warmup < 1:
        ap.error(
            f"--steps ({args.steps}) and --warmup ({args.warmup}) must be at least 1 (the first step of a run is cold)"
        )
    if args.trl_bf16 and not args.trl:
        ap.error("--trl-bf16 needs --trl")
    if args.trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            ap.error("--trl needs TRL: run this script with .venv-trl/bin/python (`make bench-peer` installs it)")

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"# one torch thread; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; tether "
        f"{args.tether_args or 'defaults (fp32)'}{'; TRL bf16' if args.trl and args.trl_bf16 else ''}",
        flush=True,
    )
    peaks: dict[str, float] = {}
    for name in models:
        model, prompts = peer.peer_inputs(work, name)
        runs = work / "runs"
        step, dtype = tether_steps(model, prompts, runs / f"{name}-tether-{time.time_ns()}", list(args.tether_args))
        peaks.setdefault(dtype, peak_flops(getattr(torch, dtype)))
        rows = [("tether", *measure(step, args.warmup, args.steps), peaks[dtype])]
        if args.trl:
            dtype = "bfloat16" if args.trl_bf16 else "float32"
            peaks.setdefault(dtype, peak_flops(getattr(torch, dtype)))
            res = measure_trl(
                model, prompts, runs / f"{name}-trl-{time.time_ns()}", args.trl_bf16, args.warmup, args.steps
            )
            rows.append(("TRL 1.16", *res, peaks[dtype]))
        print(
            f"\n### {name} ({peer.param_count(model) / 1e3:.0f}k parameters); peak of one core: "
            + ", ".join(f"{d} {p / 1e9:.1f} GFLOP/s" for d, p in peaks.items())
            + "\n"
        )
        print("\n".join(table(rows)))
        if args.trl:
            (_, tw, ts, tf, tp), (_, rw, *_rest) = rows
            floor = tf / tp
            print(
                f"\n2× TRL's step is {rw / 2:.3f} s; tether's linear matmuls at the peak take {floor:.3f} s, which "
                f"leaves {rw / 2 - floor:.3f} s for all the rest (now {tw - ts['linear matmuls']:.3f} s: attention "
                f"{ts['attention']:.3f}, sampling {ts['sampling']:.3f}, everything else {ts['everything else']:.3f}); "
                f"at the peak with nothing else tether would be {rw / floor:.2f}× TRL"
            )


if __name__ == "__main__":
    main()
