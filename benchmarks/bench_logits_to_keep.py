"""The LM head on response positions only (``logits_to_keep``) against the head on every position.

    python benchmarks/bench_logits_to_keep.py [--prompt 150] [--response 128] [--batch 16] [--vocabs 2000,32000]

For a random Qwen2 (hidden 256, 8 layers, as ``bench_peer_trl.py``'s small model) per vocabulary
size, times ``tether.models.response_logprobs`` on a (B, P + T) batch, as the reference pass runs
it (no grad) and as the update runs it (forward + backward of the log-probs), once with the head on
the T + 1 last positions (the default) and once with it on all P + T positions (what the code did
before). CPU seconds of this process (``time.process_time``; the box is shared), best of 3, one thread.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=150)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocabs", default="2000,32000")
    args = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import tether.models as tm

    torch.set_num_threads(1)
    P, T, B = args.prompt, args.response, args.batch
    print(f"# B={B}, P={P}, T={T}; CPU s, best of 3\n")
    print("| vocab | head on | no-grad pass (s) | forward + backward (s) |")
    print("| ---: | --- | ---: | ---: |")
    for V in (int(v) for v in args.vocabs.split(",")):
        torch.manual_seed(0)
        cfg = Qwen2Config(
            vocab_size=V,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
        model = Qwen2ForCausalLM(cfg)
        ids = torch.randint(0, V, (B, P + T))
        mask = torch.ones_like(ids)

        def best(fn) -> float:
            fn()
            ts = []
            for _ in range(3):
                c0 = time.process_time()
                fn()
                ts.append(time.process_time() - c0)
            return min(ts)

        def nograd(model=model, ids=ids, mask=mask):
            with torch.no_grad():
                tm.response_logprobs(model, ids, mask, T)

        def fwdbwd(model=model, ids=ids, mask=mask):
            lp = tm.response_logprobs(model, ids, mask, T)[0]
            lp.sum().backward()

        for label, params in (("response positions (T+1)", None), ("every position (P+T)", set())):
            if params is not None:
                model._tether_forward_params = params  # the forward looks as if it had no logits_to_keep
            else:
                model.__dict__.pop("_tether_forward_params", None)
            print(f"| {V} | {label} | {best(nograd):.3f} | {best(fwdbwd):.3f} |")


if __name__ == "__main__":
    main()
