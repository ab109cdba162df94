"""``actor.attn_implementation``: PyTorch's CPU SDPA (flash) kernel against tether's matmul path.

    python benchmarks/bench_attention.py [--dtype bfloat16] [--threads 1] [--reps 15]

For each shape (B rows, H query heads over H_kv key/value heads, L queries over S keys, head dim
D) it times, in one process, alternating, median of ``--reps``: transformers' ``sdpa_attention_forward``
(what ``sdpa`` models run) and :func:`tether.models.attention.matmul_attention`, forward only for decode
shapes (L = 1) and forward + backward for the others, and prints whether ``tether`` attention takes
the matmul path there (:func:`tether.models.attention.use_matmul`) and the largest difference of the
two outputs. The shapes: the peer bench's small model (4/2 heads of 64; decode over 48 and 300 keys,
64 rows of 48 tokens), a 16/2-head decode over 400 keys, 16 rows of 128, 192 and 256 tokens (and 8 rows of 128 of a
16/4-head, 128-dim model), and 4 rows of 1024
tokens of a 16/4-head, 128-dim model (where flash wins and ``tether`` hands the call to sdpa).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

SHAPES = [  # (B, H, H_kv, L, S, D)
    (64, 4, 2, 1, 48, 64),
    (64, 4, 2, 1, 300, 64),
    (16, 16, 2, 1, 400, 64),
    (64, 4, 2, 48, 48, 64),
    (16, 4, 2, 128, 128, 64),
    (8, 16, 4, 128, 128, 128),
    (16, 4, 2, 192, 192, 64),
    (16, 4, 2, 256, 256, 64),
    (4, 16, 4, 1024, 1024, 128),
]


def median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def run(which: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, module) -> torch.Tensor:
    """One call of ``which`` (``sdpa`` or ``matmul``); with its backward where the query has more than one token."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tether.models import attention

    grad = q.shape[2] > 1
    qq, kk, vv = (t.clone().requires_grad_(grad) for t in (q, k, v))
    with torch.set_grad_enabled(grad):
        if which == "sdpa":
            out = sdpa_attention_forward(module, qq, kk, vv, None, is_causal=True)[0]
        else:
            out = attention.matmul_attention(qq, kk, vv, None, None, is_causal=True)
        if grad:
            out.float().sum().backward()
    return out.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tether.models import attention

    dtype = getattr(torch, args.dtype)
    print(
        f"# {args.dtype}, {args.threads} thread(s), median of {args.reps}; ms per call (decode: forward; else forward "
        "+ backward)\n"
    )
    print(
        "| B | H / H_kv | L | S | D | sdpa (flash) ms | matmul path ms | sdpa / matmul | `tether` takes | max abs diff "
        "|"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for B, H, H_kv, L, S, D in SHAPES:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*s, generator=g, dtype=dtype) for s in ((B, H, L, D), (B, H_kv, S, D), (B, H_kv, S, D)))
        module = SimpleNamespace(num_key_value_groups=H // H_kv, is_causal=True)

        diff = (run("sdpa", q, k, v, module).float() - run("matmul", q, k, v, module).float()).abs().max().item()
        times = {"sdpa": [], "matmul": []}
        for _ in range(3):  # alternating rounds, so drift hits both
            for which in times:
                times[which].append(median_ms(lambda w=which, t=(q, k, v, module): run(w, *t), max(1, args.reps // 3)))
        a, b = (sorted(t)[1] for t in times.values())
        takes = "matmul" if attention.use_matmul(module, q, k, None, 0.0, {}) else "sdpa"
        print(
            f"| {B} | {H} / {H_kv} | {L} | {S} | {D} | {a:.2f} | {b:.2f} | {a / b:.2f} | {takes} | {diff:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
