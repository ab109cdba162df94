"""The actor/reference forward on P + T − 1 positions (the last response token never fed) against P + T.

    python benchmarks/bench_last_position.py [--reps 9] [--shapes 64x16x32,16x150x128] [--models tiny,small]

For random Qwen2 models shaped as ``bench_peer_trl.py``'s (tiny: vocab 100, hidden 64, 2 layers;
small: vocab 2000, hidden 256, 8 layers), times :func:`tether.models.response_logprobs` on a
(B, P + T) batch as the reference pass runs it (no grad) and as the update runs it (forward +
backward), once as it is (P + T − 1 positions fed, T logits) and once as it was before issue 13's
change (all P + T positions fed, T + 1 logits kept). The two alternate call by call (A B A B ...),
so the box's load hits both alike; medians of ``--reps`` calls of this process's CPU time
(``time.process_time``) and wall time, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

MODELS = {
    "tiny": dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        vocab_size=2000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def full_input_logprobs(model, ids, mask, t):
    """The pass before: every column fed, the head on the last T + 1 positions, the outputs at P-1 .. P+T-2 kept."""
    from tether.algos import logprobs_and_entropy_from_logits
    from tether.models import position_ids_from_mask

    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=False,
        logits_to_keep=t + 1,
    )
    return logprobs_and_entropy_from_logits(out.logits[:, -t - 1 : -1, :], ids[:, -t:], 1.0)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--shapes", default="64x16x32,16x150x128", help="BxPxT, comma-separated")
    ap.add_argument("--models", default="tiny,small")
    args = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tether.models import response_logprobs

    torch.set_num_threads(1)
    print(f"# median of {args.reps} alternating calls, one thread; CPU s (wall s)\n")
    print("| model | B×P×T | pass | P+T fed (before) | P+T−1 fed | CPU saved |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**MODELS[name], tie_word_embeddings=True, attn_implementation="sdpa"))
        for shape in args.shapes.split(","):
            B, P, T = (int(x) for x in shape.split("x"))
            ids = torch.randint(3, MODELS[name]["vocab_size"], (B, P + T))
            mask = torch.ones_like(ids)
            variants = {
                "before": lambda ids=ids, mask=mask, T=T, model=model: full_input_logprobs(model, ids, mask, T),
                "now": lambda ids=ids, mask=mask, T=T, model=model: response_logprobs(model, ids, mask, T)[0],
            }
            for label in ("no-grad (reference)", "forward + backward (update)"):
                grad = label.startswith("forward")
                times = {k: ([], []) for k in variants}
                for rep in range(args.reps + 1):
                    for k, fn in variants.items():
                        c0, t0 = time.process_time(), time.perf_counter()
                        if grad:
                            fn().sum().backward()
                            model.zero_grad(set_to_none=True)
                        else:
                            with torch.no_grad():
                                fn()
                        if rep:  # the first round warms up
                            times[k][0].append(time.process_time() - c0)
                            times[k][1].append(time.perf_counter() - t0)
                cpu = {k: statistics.median(v[0]) for k, v in times.items()}
                wall = {k: statistics.median(v[1]) for k, v in times.items()}
                saved = 1 - cpu["now"] / cpu["before"]
                print(
                    f"| {name} | {shape} | {label} | {cpu['before']:.4f} ({wall['before']:.4f}) | {cpu['now']:.4f} "
                    f"({wall['now']:.4f}) | {saved:.1%} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
