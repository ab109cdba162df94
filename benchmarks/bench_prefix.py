"""Shared-prompt forward (``actor.share_prompt_prefix``) against the ordinary pass, in one process.

    python benchmarks/bench_prefix.py [--reps 5] [--shapes peer,gsm8k] [--models small,tiny]

For each shape, on bench_peer_trl.py's small Qwen2 (vocab 2000, hidden 256, 8 layers, 4 / 2 heads,
MLP 512) and/or its tiny one (vocab 100, hidden 64, 2 layers, 4 / 2 heads, MLP 128), random weights,
fp32, one torch thread, B = prompts × G rows where every G rows share a
prompt (rows shuffled): times a no-grad log-prob pass (the reference's) and a forward + backward of
sum(log-probs) (the update's), ordinary and shared alternately, ``--reps`` times each, and prints
the median CPU time (``time.process_time``) and wall time of each, their ratio, and the largest
log-prob difference between the two.

Shapes: ``peer`` (8 prompts × G = 8, prompt 16 tokens, response 32: bench_peer_trl.py's
workload) and ``gsm8k`` (8 × 8, prompts 120–180 tokens left-padded, responses 1–256 tokens, mean
about 108, the GSM8K-shaped rows of bench_peer_trl.py ``--extra``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tether.models import response_logprobs
from tether.models.prefix import prompt_groups, shared_prefix_logprobs

MODELS = {
    "small": dict(vocab_size=2000, hidden_size=256, intermediate_size=512, num_hidden_layers=8),
    "tiny": dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2),
}


def build_model(name: str = "small"):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        **MODELS[name], num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def build_batch(shape: str, g: torch.Generator, vocab: int = 2000):
    """(prompt_ids, prompt_mask, response_ids, response_mask), rows shuffled."""
    n, group = 8, 8
    if shape == "peer":
        p_len = torch.full((n,), 16)
        r_len = torch.full((n * group,), 32)
    else:
        p_len = torch.randint(120, 181, (n,), generator=g)
        r_len = torch.randint(1, 216, (n * group,), generator=g)  # mean ~108
        r_len[0] = 256
    P, T = int(p_len.max()), int(r_len.max())
    pmask = (torch.arange(P)[None] >= (P - p_len)[:, None]).long()
    prompts = torch.randint(3, vocab, (n, P), generator=g).masked_fill(pmask == 0, 0)
    which = torch.randperm(n * group, generator=g) % n
    rmask = (torch.arange(T)[None] < r_len[:, None]).long()
    rids = torch.randint(3, vocab, (n * group, T), generator=g).masked_fill(rmask == 0, 0)
    return prompts[which], pmask[which], rids, rmask


def run(model, batch, shared: bool, grad: bool):
    pids, pmask, rids, rmask = batch
    t = rids.shape[1]
    model.train(grad)
    model.zero_grad(set_to_none=True)
    c0, w0 = time.process_time(), time.perf_counter()
    with torch.set_grad_enabled(grad):
        if shared:
            lp = shared_prefix_logprobs(model, pids, pmask, rids, rmask, prompt_groups(pids, pmask))[0]
        else:
            lp = response_logprobs(model, torch.cat([pids, rids], 1), torch.cat([pmask, rmask], 1), t)[0]
        if grad:
            (lp * rmask).sum().backward()
    return time.process_time() - c0, time.perf_counter() - w0, lp.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default="peer,gsm8k")
    ap.add_argument("--models", default="small", help="comma-separated: small, tiny")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        "| model | shape | pass | ordinary CPU s | shared CPU s | ordinary / shared (CPU) | ordinary wall s | shared "
        "wall s | max abs Δ log-prob |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, shape in ((m, s) for m in args.models.split(",") for s in args.shapes.split(",")):
        model = build_model(name)
        batch = build_batch(shape, torch.Generator().manual_seed(0), MODELS[name]["vocab_size"])
        mask = batch[3].bool()
        for grad, label in ((False, "no-grad log-probs"), (True, "forward + backward")):
            times = {False: [], True: []}
            diff = 0.0
            run(model, batch, True, grad), run(model, batch, False, grad)  # warm-up
            for _ in range(args.reps):
                out = {}
                for shared in (False, True):
                    c, w, lp = run(model, batch, shared, grad)
                    times[shared].append((c, w))
                    out[shared] = lp
                diff = max(diff, float((out[True] - out[False])[mask].abs().max()))
            med = {
                s: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for s, v in times.items()
            }
            print(
                f"| {name} | {shape} | {label} | {med[False][0]:.3f} | {med[True][0]:.3f} | "
                f"{med[False][0] / med[True][0]:.2f} | {med[False][1]:.3f} | {med[True][1]:.3f} | {diff:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
