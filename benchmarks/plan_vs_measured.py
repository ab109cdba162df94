"""``tether plan``'s prediction against the measured peak of the actor's real training step, on CPU.

For tiny Qwen2 models of about 1M to 50M parameters (GQA, untied and tied heads), one actor update
(one mini-batch = one micro-batch of b responses, PPO clipped loss, AdamW step through
``tether.workers.ActorWorker.update``), in float32, in bfloat16 (``actor.dtype=bfloat16``) and
with bfloat16 autocast over float32 weights (``actor.compute_dtype=bfloat16``), runs after a warm-up update (so AdamW's
moments exist, as
they do from step 2 of a run). Measured:

* ``tracked``: the peak of live tensor bytes during the update, from torch's
  ``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch-mode tracker of every storage's
  bytes: independent of the CPU allocator and of other processes; what ``max_memory_allocated`` is
  on a GPU);
* ``rss``: the process's peak resident set (``ru_maxrss``, over the warm-up and both measured
  updates) minus its resident set just before the model was built, in a fresh subprocess with
  ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed large blocks go back to the OS. Shown for
  reference: it also counts the model's construction (initialisation temporaries), the autograd
  graph's bookkeeping and glibc's arenas.

Predicted: :func:`tether.plan.plan_memory` for one CPU device (``accelerator=False``), float32,
actor only: its weights + AdamW moments (kept) + the larger of its ``backward`` and
``optimizer step`` phases.

    PYTHONPATH=src python benchmarks/plan_vs_measured.py            # the table (about a minute on 2 cores)
    PYTHONPATH=src python benchmarks/plan_vs_measured.py --quick    # two small sizes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# name: (hidden, layers, heads, kv_heads, intermediate, vocab, tied, micro-batch, prompt, response, checkpointing)
CASES = {
    "1M": (64, 2, 4, 2, 256, 4096, False, 4, 48, 16, False),
    "5M": (192, 4, 6, 2, 512, 8192, False, 4, 64, 32, False),
    "12M-tied": (256, 6, 8, 4, 768, 16384, True, 4, 96, 32, False),
    "25M": (384, 8, 6, 2, 1024, 16384, False, 4, 96, 32, False),
    "50M": (512, 8, 8, 4, 1536, 32000, False, 4, 96, 32, False),
    "50M-ckpt": (512, 8, 8, 4, 1536, 32000, False, 4, 96, 32, True),
    "25M-long": (384, 8, 6, 2, 1024, 16384, False, 8, 384, 128, False),
    "25M-long-ckpt": (384, 8, 6, 2, 1024, 16384, False, 8, 384, 128, True),
}
BF16 = {"5M-bf16": "5M", "25M-long-bf16": "25M-long", "25M-long-ckpt-bf16": "25M-long-ckpt"}
"""bfloat16 weights, gradients, AdamW moments and compute (``actor.dtype=bfloat16``) of a float32 case."""
AMP = {"25M-long-amp": "25M-long", "25M-long-ckpt-amp": "25M-long-ckpt"}
"""float32 weights with bfloat16 autocast (``actor.compute_dtype=bfloat16``, float32 LM head) of a float32 case."""


def _case(name: str) -> tuple[tuple, str, str]:
    """(case, actor.dtype, actor.compute_dtype)."""
    if name in BF16:
        return CASES[BF16[name]], "bfloat16", "bfloat16"
    if name in AMP:
        return CASES[AMP[name]], "float32", "bfloat16"
    return CASES[name], "float32", "float32"


def _config(case):
    from transformers import Qwen2Config

    h, n, heads, kv, i, v, tied, *_ = case
    return Qwen2Config(
        vocab_size=v,
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=i,
        tie_word_embeddings=tied,
        max_position_embeddings=1024,
    )


def _batch(case, seed=0):
    import torch

    from tether.batch import RolloutBatch

    *_, v, _tied, b, p, t, _ = case
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :3] = 0  # left padding in one row, as rollouts have
    response_mask = torch.ones(b, t, dtype=torch.long)
    response_mask[1, t - 2 :] = 0
    return RolloutBatch(
        prompt_ids=torch.randint(0, v, (b, p), generator=g),
        prompt_mask=prompt_mask,
        response_ids=torch.randint(0, v, (b, t), generator=g),
        response_mask=response_mask,
        group_ids=torch.arange(b),
        rows=[None] * b,
        prompts=[""] * b,
        responses=[""] * b,
        old_logprobs=torch.full((b, t), -8.0),
        ref_logprobs=torch.full((b, t), -8.0),
        advantages=torch.randn(b, t, generator=g),
    )


def _spec(b):
    from tether.workers.actor import ActorUpdateSpec

    return ActorUpdateSpec(
        ppo_epochs=1,
        mini_batch_size=b,
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        dual_clip_c=3.0,
        loss_agg_mode="token-mean",
        entropy_coef=0.0,
        kl_loss_coef=0.0,
        kl_loss_estimator="k1",
        kl_loss_agg_mode="token-mean",
        log_ratio_clamp=20.0,
        value_clamp=10.0,
        target_kl=None,
        seed=0,
        norm_constant=1.0,
    )


def measure(name: str) -> dict:
    """Build the model, warm up, then measure one update both ways (meant for a fresh process:
    ``rss`` is that process's; ``tracked`` does not depend on it). Leaves torch's RNG and thread
    count as it found them."""
    import torch

    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            torch.set_num_threads(1)
            return _measure(name)
    finally:
        torch.set_num_threads(threads)


def _measure(name: str) -> dict:
    import gc
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    from tether.models import fp32_lm_head
    from tether.workers.actor import ActorWorker

    case, dtype, compute = _case(name)
    rss_before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    model = AutoModelForCausalLM.from_config(_config(case), dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if case[-1]:
        model.gradient_checkpointing_enable()
    if compute != dtype:
        fp32_lm_head(model)  # as tether.workers.build does for actor.compute_dtype=bfloat16
    actor = ActorWorker(
        model,
        lr=1e-5,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        warmup_steps=0,
        grad_clip=1.0,
        micro_batch_size=case[7],
        temperature=1.0,
        compute_dtype=compute,
    )
    batch, spec = _batch(case), _spec(case[7])
    actor.update(batch, spec, 0)  # AdamW's moments now exist
    gc.collect()
    actor.update(batch, spec, 1)
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, actor.optimizer)
    with mt:
        actor.update(batch, spec, 2)
    peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    return {"tracked": int(peak["Total"]), "rss_growth": int(rss), "params": sum(p.numel() for p in model.parameters())}


def predict(name: str) -> dict:
    from tether.plan import ModelShape, PlanSettings, plan_memory

    case, dtype, compute = _case(name)
    shape = ModelShape.from_hf(_config(case))
    b, p, t, ckpt = case[7:]
    s = PlanSettings(
        devices=1,
        storage_dtype=dtype,
        compute_dtype=compute,
        autocast=compute != dtype,
        actor_checkpointing=ckpt,
        actor_micro_batch=b,
        logprob_micro_batch=b,
        prompt_len=p,
        response_len=t,
        rollout_batch=b,
        separate_ref=False,
        accelerator=False,
    )
    plan = plan_memory(s, shape)
    kept = sum(i.bytes for i in plan.items if i.role == "actor" and i.phase == "always")
    phases = plan.phase_bytes()
    update = max(phases["actor backward"], phases["actor optimizer step"])
    return {"predicted": kept + update, "params": shape.causal_lm_params()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the two smallest sizes")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    names = list(CASES)[:2] if args.quick else [*CASES, *BF16, *AMP]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    rows = []
    print(
        "| model | parameters | micro-batch × tokens | checkpointing | predicted MiB | tracked peak MiB | error | peak "
        "RSS − RSS before the model, MiB |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for name in names:
        out = subprocess.run(
            [sys.executable, __file__, "--one", name], env=env, capture_output=True, text=True, check=True
        )
        m = json.loads(out.stdout.strip().splitlines()[-1])
        pr = predict(name)
        assert pr["params"] == m["params"], (name, pr["params"], m["params"])
        err = pr["predicted"] / m["tracked"] - 1
        case = _case(name)[0]
        rows.append((name, err))
        print(
            f"| {name} | {m['params']:,} | {case[7]} × {case[8] + case[9]} | {'on' if case[-1] else 'off'} | "
            f"{pr['predicted'] / 2**20:.1f} | {m['tracked'] / 2**20:.1f} | {err:+.1%} | {m['rss_growth'] / 2**20:.1f} |"
        )
    worst = max(abs(e) for _, e in rows)
    print(f"\nworst |predicted / tracked - 1| = {worst:.1%} (goal: within 15%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
