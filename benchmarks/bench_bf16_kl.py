"""What ``actor.compute_dtype=bfloat16`` does to the log-probs and the KL metrics, against float32.

    python benchmarks/bench_bf16_kl.py [--steps 6] [--lr 1e-4] [--model small]

Trains the benchmark model of ``bench_peer_trl.py`` (random Qwen2, built locally) for ``--steps``
GRPO steps in float32 with the KL in the loss, so that π_θ has moved away from π_ref, then samples
one batch and scores it with the *same* weights several ways: fp32 again (a control: 0 difference);
bf16 autocast with the fp32 LM head and ``tether`` attention (what ``actor.compute_dtype=bfloat16``
does on CPU) or sdpa (``actor.attn_implementation=model``); and bf16 autocast of everything, head
included (``actor.lm_head_fp32=false``), with either attention. It prints, per way, against fp32:

* the per-token log-prob error |Δ log π| (mean and max over counted tokens), nats;
* ``policy/approx_kl`` a mismatch alone would show: mean ½(Δ log π)² of the actor, nats/token
  (the PPO ratio's deviation from 1 when rollout and update disagree in precision);
* the KL metrics of the batch, ``kl/ref_mean`` (k3) and k1, computed from that way's actor and
  reference log-probs, and their difference from fp32's, nats/token.

One thread, CPU; a few seconds per step for the small model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--model", default="small", choices=["tiny", "small"])
    ap.add_argument("--workdir", default=str(HERE.parents[1] / ".tmp" / "bench_peer"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    import bench_peer_trl as bp

    from tether.algos import kl_penalty, masked_mean
    from tether.config import load_config
    from tether.models import attention, fp32_lm_head, response_logprobs
    from tether.trainer import Trainer
    from tether.workers.common import trim

    work = Path(args.workdir)
    model = bp.build_model(work / f"qwen2-{args.model}", args.model)
    prompts = bp.build_prompts(work / f"prompts-{args.model}.jsonl", bp.N_PROMPTS, (bp.PROMPT_TOKENS, bp.PROMPT_TOKENS))
    out = Path(tempfile.mkdtemp(prefix="bf16kl-"))
    over = bp.tether_overrides(model, prompts, args.steps, bp.NEW_TOKENS, out) + [f"actor.lr={args.lr}"]
    t = Trainer(load_config(None, over))
    t.roles.engine.engine.kwargs["suppress_tokens"] = list(t.roles.engine.eos_token_ids)
    for _ in range(args.steps):
        m = t.train_step()
    print(f"# {args.model} model after {args.steps} fp32 steps at lr {args.lr}: kl/ref_mean {m['kl/ref_mean']:.3e}")
    batch = t.rollout()
    ids, mask, T = trim(batch)
    rmask = batch.response_mask[:, :T].float()
    actor, ref = t.roles.actor.model.eval(), t.roles.ref.model

    import copy

    def score(dtype: str, head_fp32: bool, attn: str = "sdpa"):
        a, r = actor, ref
        if dtype != "float32" and head_fp32:
            a, r = fp32_lm_head(copy.deepcopy(actor)), fp32_lm_head(copy.deepcopy(ref))
        if attn != "sdpa":
            a, r = (attention.set_attn_implementation(copy.deepcopy(m), attn) for m in (a, r))
        with torch.no_grad():
            lp = response_logprobs(a, ids, mask, T, compute_dtype=dtype)[0]
            lr = response_logprobs(r, ids, mask, T, compute_dtype=dtype)[0]
        return lp.double(), lr.double()

    lp32, lr32 = score("float32", True)
    k3_32 = float(masked_mean(kl_penalty(lp32, lr32, "k3"), rmask))
    k1_32 = float(masked_mean(kl_penalty(lp32, lr32, "k1", log_ratio_clamp=None), rmask))
    print(f"# fp32: k3 kl/ref_mean {k3_32:.4e}, k1 {k1_32:.4e} nats/token; {int(rmask.sum())} tokens\n")
    print(
        "| compute | mean abs Δ log π (nats) | max abs Δ log π | approx_kl from the mismatch (nats/token) | k3 KL "
        "(nats/token) | k3 − fp32 | k1 KL | k1 − fp32 |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ways = (
        ("fp32 (control)", "float32", True, "sdpa"),
        ("bf16 autocast, fp32 LM head, `tether` attention (compute_dtype=bfloat16 on CPU)", "bfloat16", True, "tether"),
        ("bf16 autocast, fp32 LM head, sdpa attention (attn_implementation=model)", "bfloat16", True, "sdpa"),
        ("bf16 autocast, bf16 LM head, `tether` attention (lm_head_fp32=false)", "bfloat16", False, "tether"),
        ("bf16 autocast, bf16 LM head, sdpa attention", "bfloat16", False, "sdpa"),
    )
    for label, dtype, head, attn in ways:
        lp, lr = score(dtype, head, attn)
        d = (lp - lp32).abs()[rmask.bool()]
        approx = float(masked_mean(0.5 * (lp - lp32) ** 2, rmask))
        k3 = float(masked_mean(kl_penalty(lp, lr, "k3"), rmask))
        k1 = float(masked_mean(kl_penalty(lp, lr, "k1", log_ratio_clamp=None), rmask))
        print(
            f"| {label} | {float(d.mean()):.2e} | {float(d.max()):.2e} | {approx:.2e} | {k3:.4e} | {k3 - k3_32:+.1e} | "
            f"{k1:.4e} | {k1 - k1_32:+.1e} |"
        )


if __name__ == "__main__":
    main()
