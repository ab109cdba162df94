"""Benchmark: vectorized GAE (tether.algos.compute_gae) vs the plain reference loop.

Usage:
    python benchmarks/bench_gae.py                 # B=64, T=8192 (the issue's size) and a smaller row
    python benchmarks/bench_gae.py --threads 2 --repeats 50

Both implementations compute the same thing (masked tokens skipped, value after the last valid
token 0, whitened advantages, returns = raw advantages + values). The loop is
``tether.algos.gae_reference_loop``: one Python iteration per time step over (B,) vectors, in
float64. The vectorized version runs on the float32 inputs. Times are the minimum and median of
``--repeats`` runs (the loop: of 3 runs) on ``--threads`` CPU threads. "max |err|" is the largest
difference of the vectorized raw advantages / returns from the float64 loop, "rel" divides it by
the largest |return|.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    from tether.algos import compute_gae, gae_reference_loop
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from tether.algos import compute_gae, gae_reference_loop


def _times(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _case(b: int, t: int, layout: str, g: torch.Generator):
    rewards = torch.randn(b, t, generator=g)
    values = torch.randn(b, t, generator=g)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]  # right padding, lengths in [T/2, T]
    if layout == "multi-turn":
        mask &= torch.rand(b, t, generator=g) > 0.1  # ~10% of tokens masked inside responses
    return rewards, values, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--gamma", type=float, default=0.99)
    ap.add_argument("--lam", type=float, default=0.95)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for b, t in ((64, 8192), (64, 1024)):
        for layout in ("padded", "multi-turn"):
            r, v, m = _case(b, t, layout, g)
            loop_t = _times(lambda r=r, v=v, m=m: gae_reference_loop(r, v, m, args.gamma, args.lam), 3)
            vec_t = _times(lambda r=r, v=v, m=m: compute_gae(r, v, m, args.gamma, args.lam), args.repeats)
            adv, ret = compute_gae(r, v, m, args.gamma, args.lam, whiten=False)
            adv_ref, ret_ref = gae_reference_loop(r, v, m, args.gamma, args.lam, whiten=False)
            err = max((adv.double() - adv_ref).abs().max().item(), (ret.double() - ret_ref).abs().max().item())
            scale = ret_ref.abs().max().item()
            rows.append(
                (
                    f"{b}x{t}",
                    layout,
                    min(loop_t) * 1e3,
                    min(vec_t) * 1e3,
                    statistics.median(vec_t) * 1e3,
                    min(loop_t) / min(vec_t),
                    err,
                    err / scale,
                )
            )
    print(
        f"GAE, gamma={args.gamma}, lambda={args.lam}, float32 inputs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print(
        "| B x T | mask | loop (ms) | vectorized min (ms) | vectorized median (ms) | speed-up (min/min) | max abs err "
        "| rel err |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for shape, layout, lt, vt, vm, sp, err, rel in rows:
        print(f"| {shape} | {layout} | {lt:.1f} | {vt:.2f} | {vm:.2f} | {sp:.0f}x | {err:.1e} | {rel:.1e} |")


if __name__ == "__main__":
    main()
