"""Benchmark: peak memory and time of log-probs + entropy from (B, T, V) logits.

Usage:
    python benchmarks/bench_logprobs.py                  # CPU, scaled-down sizes (a minute or two)
    python benchmarks/bench_logprobs.py --full           # CPU, also the issue's B=4, T=2048 row for the
                                                         # chunked method (~5.5 GB RSS; the naive one
                                                         # would need ~20 GB and is skipped)
    python benchmarks/bench_logprobs.py --device cuda    # GPU: the full size, both methods

Methods (each returns (B, T) log-probs of the given ids and (B, T) entropies):
  naive    lp = log_softmax(logits / tau); lp.gather(ids); -(exp(lp) * lp).sum(-1)
  chunked  tether.algos.logprobs_and_entropy_from_logits (default chunk: 2**22 logits on CPU, 2**24 on GPU)
Passes:
  fwd      under torch.no_grad() (old/ref log-probs in the trainer)
  fwd+bwd  forward, then backward of (logprobs.sum() + entropy.sum()) into the logits

"extra" is the peak memory beyond what was allocated before the call (logits, ids), after a warm-up
call on a (1, 2, V) input. For fwd+bwd the gradient of the logits (one logits-sized tensor,
unavoidable) is subtracted as well.

How memory is measured:
  cpu   each (method, size, pass) runs in a fresh child process. The child fills the logits (so their
        pages are resident), resets the kernel's high-water mark of its resident set (writes 5 to
        /proc/self/clear_refs, Linux >= 4.0), reads its resident set size (baseline), runs the method,
        then reads the high-water mark (VmHWM in /proc/self/status; getrusage's ru_maxrss if the reset
        is not permitted). extra = high-water mark - baseline. PyTorch's CPU allocator has no peak counter and
        tracemalloc
        does not see it, but the kernel counts every page touched. Children run with
        MALLOC_MMAP_THRESHOLD_=1048576, so glibc serves every block >= 1 MiB with mmap and unmaps it when
        freed: the high-water mark is then the peak of live allocations. With glibc's default dynamic
        threshold (--malloc-default) freed 16 MiB chunks stay in the heap and are reused, so RSS
        over-counts live memory (never under-counts it).
  cuda  torch.cuda.reset_peak_memory_stats(); extra = max_memory_allocated() - memory_allocated()
        before the call (exact for the caching allocator).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

try:
    from tether.algos import logprobs_and_entropy_from_logits
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from tether.algos import logprobs_and_entropy_from_logits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TEMPERATURE = 0.7


def naive(logits: torch.Tensor, ids: torch.Tensor):
    lp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)  # (B, T, V) float32
    return lp.gather(-1, ids[..., None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


CHUNK_SIZE: int | None = None  # None: the library default (2**22 logits per chunk on CPU, 2**24 on GPU)


def chunked(logits: torch.Tensor, ids: torch.Tensor):
    return logprobs_and_entropy_from_logits(logits, ids, TEMPERATURE, chunk_size=CHUNK_SIZE)


METHODS = {"naive": naive, "chunked": chunked}


def make_inputs(b: int, t: int, v: int, dtype: torch.dtype, device: str, requires_grad: bool):
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.empty(b, t, v, dtype=dtype, device=device)
    for i in range(b):  # in pieces: no logits-sized float32 temporary for bf16
        for t0 in range(0, t, 256):
            n = min(256, t - t0)
            logits[i, t0 : t0 + n] = (torch.randn(n, v, generator=g, device=device) * 2).to(dtype)
    ids = torch.randint(0, v, (b, t), generator=g, device=device)
    return logits.requires_grad_(requires_grad), ids


def _status_kib(field: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


_HWM_RESET = False


def _reset_cpu_peak() -> int:
    """Reset the kernel's resident-set high-water mark (Linux >= 4.0) and return the current RSS."""
    global _HWM_RESET
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _HWM_RESET = True
    except OSError:  # not permitted: fall back to the lifetime peak (then the inputs must be built lean)
        _HWM_RESET = False
    import psutil

    return psutil.Process().memory_info().rss


def _cpu_peak() -> int:
    if _HWM_RESET:
        return (_status_kib("VmHWM") or 0) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_once(
    method: str,
    b: int,
    t: int,
    v: int,
    dtype: str,
    device: str,
    backward: bool,
    chunk_size: int | None = None,
) -> dict:
    global CHUNK_SIZE
    CHUNK_SIZE = chunk_size
    torch.manual_seed(0)
    logits, ids = make_inputs(b, t, v, DTYPES[dtype], device, backward)
    logits_bytes = logits.numel() * logits.element_size()
    fn = METHODS[method]
    # warm-up on a tiny input, so one-off costs (kernel code pages, thread pools, allocator arenas)
    # fall before the baseline instead of counting as the method's memory
    tiny, tiny_ids = make_inputs(1, 2, v, DTYPES[dtype], device, backward)
    if backward:
        sum(x.sum() for x in fn(tiny, tiny_ids)).backward()
    else:
        with torch.no_grad():
            fn(tiny, tiny_ids)
    del tiny, tiny_ids
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _reset_cpu_peak()
    t0 = time.perf_counter()
    if backward:
        lp, ent = fn(logits, ids)
        (lp.sum() + ent.sum()).backward()
    else:
        with torch.no_grad():
            lp, ent = fn(logits, ids)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _cpu_peak()
    extra = peak - base - (logits_bytes if backward else 0)
    return {
        "extra": extra,
        "logits_bytes": logits_bytes,
        "seconds": seconds,
        "check": float((lp.sum() + ent.sum()).detach()),
    }


def run_cpu_child(malloc_default: bool, **kw) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(kw)]
    env = dict(os.environ)
    if not malloc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # blocks >= 1 MiB: mmap'd, unmapped when freed
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description="peak memory of log-probs + entropy")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--full", action="store_true", help="CPU: add the B=4, T=2048 row for the chunked method")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--malloc-default",
        action="store_true",
        help="CPU: keep glibc's dynamic mmap threshold (RSS over-counts)",
    )
    ap.add_argument("--chunk-size", type=int, default=None, help="token positions per chunk (default: library's)")
    ap.add_argument("--methods", default="naive,chunked", help="comma-separated subset of naive,chunked")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(run_once(**json.loads(args.child))))
        return

    v = 151936
    cases = []  # (b, t, dtype, backward, methods)
    if args.device == "cuda":
        for dtype in ("float32", "bfloat16"):
            for backward in (False, True):
                cases.append((4, 2048, dtype, backward, ("naive", "chunked")))
    else:
        cases += [
            (4, 256, "float32", False, ("naive", "chunked")),
            (4, 256, "bfloat16", False, ("naive", "chunked")),
        ]
        cases += [(4, 256, "float32", True, ("naive", "chunked"))]
        if args.full:
            cases += [(4, 2048, "float32", False, ("chunked",)), (4, 2048, "bfloat16", False, ("chunked",))]

    dev = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} thread(s)"
    chunk = f"chunk_size={args.chunk_size}" if args.chunk_size else "default chunk (2**22 logits on CPU, 2**24 on GPU)"
    print(f"log-probs + entropy, V={v}, temperature {TEMPERATURE}, {chunk}, torch {torch.__version__}, {dev}")
    print("| B x T | logits dtype | logits size | pass | method | extra peak memory | extra / logits | time (s) |")
    print("|---|---|---:|---|---|---:|---:|---:|")
    results = {}
    for b, t, dtype, backward, methods in cases:
        for method in methods:
            if method not in args.methods.split(","):
                continue
            kw = {
                "method": method,
                "b": b,
                "t": t,
                "v": v,
                "dtype": dtype,
                "device": args.device,
                "backward": backward,
            }
            kw["chunk_size"] = args.chunk_size
            r = run_once(**kw) if args.device == "cuda" else run_cpu_child(args.malloc_default, **kw)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            key = (b, t, dtype, backward)
            results.setdefault(key, {})[method] = r
            print(
                f"| {b}x{t} | {dtype} | {r['logits_bytes'] / 2**30:.2f} GiB | {'fwd+bwd' if backward else 'fwd'} | "
                f"{method} | {r['extra'] / 2**20:.0f} MiB | {r['extra'] / r['logits_bytes']:.1%} | {r['seconds']:.2f} "
                "|",
                flush=True,
            )
    for key, res in results.items():
        if len(res) == 2:
            diff = abs(res["naive"]["check"] - res["chunked"]["check"]) / max(1.0, abs(res["naive"]["check"]))
            assert diff < 1e-4, f"methods disagree on {key}: {diff}"


if __name__ == "__main__":
    main()
