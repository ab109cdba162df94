"""Seconds per prompt of the digitsum_tool exact validation's trajectory enumeration: the full-row path
(``kv_cache=False``, every context + prefix re-run at every depth) against the KV-cached one (``kv_cache=True``,
the default for a transformers model), one thread, alternating in one process, medians.

python benchmarks/bench_trajectory_enumeration.py [--repeats 3] [--k 3]

Also prints the largest |Δ log-prob| between the two (float32 rounding, ~1e-4 nats at most).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.tasks import digitsum_tool as dt
from tether.tasks.exact import enumerate_trajectories


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=dt.DEFAULT_K)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = dt.reference_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path)
    rows = dt.make_dataset("val", k=args.k)

    def run(kv_cache, row):
        k, s = row["extra_info"]["k"], row["extra_info"]["s"]
        t0 = time.perf_counter()
        ts = enumerate_trajectories(
            model,
            tok,
            row["prompt"],
            lambda t, x: dt.transition(k, s, t, x),
            k + 1,
            max_turns=dt.MAX_TURNS,
            kv_cache=kv_cache,
        )
        return time.perf_counter() - t0, ts

    times = {False: [], True: []}
    diff = 0.0
    for i in range(args.repeats):
        row = rows[i % len(rows)]
        got = {}
        for kv in (False, True) if i % 2 == 0 else (True, False):
            times[kv].append((sec := run(kv, row))[0])
            got[kv] = sec[1]
        diff = max(diff, float(np.abs(got[True].space.token_logprobs - got[False].space.token_logprobs).max()))
    n = len(got[True])
    old, new = statistics.median(times[False]), statistics.median(times[True])
    print(f"{n} trajectories per prompt (k={args.k}), {args.repeats} repeats, 1 thread")
    print(f"full rows (kv_cache=False): {old:.2f} s/prompt  {[round(t, 2) for t in times[False]]}")
    print(f"KV cache  (kv_cache=True):  {new:.2f} s/prompt  {[round(t, 2) for t in times[True]]}")
    print(f"speed-up {old / new:.1f}x; max |Δ token log-prob| {diff:.2e} nats")


if __name__ == "__main__":
    main()
