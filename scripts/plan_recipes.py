"""The 7B / 32B / 72B recipes of docs/distributed.md ("Planning memory"), each checked by ``tether plan``.

Every recipe is the 7B KL-PPO preset (``configs/presets/qwen2-7b-kl-ppo.yaml``: GAE with a critic,
a frozen reference, a reward model, prompt 1024 + response 512 tokens, micro-batch 4, mini-batch 8)
or its critic-free GRPO variant (rule-based reward, 64 prompts × 8 responses), on one node of 8
devices, with the models' shapes from ``tests/fixtures/model_configs`` (Qwen2.5's published
``config.json`` numbers). Prints a markdown table.

    PYTHONPATH=src python scripts/plan_recipes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "presets" / "qwen2-7b-kl-ppo.yaml"
FIX = ROOT / "tests" / "fixtures" / "model_configs"
GRPO = [
    "algo.adv_estimator=grpo",
    "rollout.n=8",
    "data.batch_size=64",
    "algo.mini_batch_size=64",
    "reward.model=null",
    "critic.model=null",
]
LORA = ["actor.dtype=bfloat16", "actor.lora.rank=64", "actor.lora.alpha=128", "ref.model=null"]
BF16 = {"param_dtype": "bfloat16"}
# vLLM's own tensor parallelism (--rollout-tp) runs in Ray replicas: planned under trainer.backend=ray
LONG = ["rollout.max_new_tokens=8192", "actor.micro_batch_size=1", "rollout.engine=vllm", "trainer.backend=ray"]

# (model, node memory, algorithm, overrides, flags)
RECIPES = [
    ("qwen2.5-7b", "80GiB", "KL-PPO (preset as written)", [], {}),
    ("qwen2.5-7b", "80GiB", "KL-PPO", [], BF16),
    ("qwen2.5-32b", "80GiB", "KL-PPO", [], BF16),
    ("qwen2.5-32b", "80GiB", "KL-PPO", [], {**BF16, "offload": True}),
    ("qwen2.5-32b", "141GB", "KL-PPO", LORA, {"activation_checkpointing": True}),
    ("qwen2.5-32b", "80GiB", "GRPO", GRPO, {**BF16, "offload": True}),
    ("qwen2.5-32b", "141GB", "GRPO", GRPO, BF16),
    ("qwen2.5-72b", "80GiB", "KL-PPO", LORA, {"offload": True, "activation_checkpointing": True}),
    ("qwen2.5-72b", "141GB", "KL-PPO", LORA, {"activation_checkpointing": True}),
    ("qwen2.5-72b", "141GB", "KL-PPO", LORA, {"offload": True, "activation_checkpointing": True}),
    ("qwen2.5-72b", "80GiB", "GRPO", GRPO + LORA, {}),
    ("qwen2.5-72b", "141GB", "GRPO", GRPO, {**BF16, "offload": True}),
    # long responses: the activations and the KV cache grow with the length; vLLM pages the cache, tp splits activations
    ("qwen2.5-72b", "80GiB", "GRPO", GRPO + LORA + LONG, {"rollout_tp": 8}),
    ("qwen2.5-72b", "80GiB", "GRPO", GRPO + LORA + LONG, {"tp_size": 4, "rollout_tp": 8}),
    ("qwen2.5-72b", "141GB", "GRPO", GRPO + LONG, {**BF16, "offload": True, "tp_size": 2, "rollout_tp": 8}),
]


def main() -> int:
    from tether.config import load_config
    from tether.plan import GIB, parse_size, plan_config

    print(
        "| model | node | algorithm | settings (on top of the preset) | mesh | peak / device | verdict | host RAM / "
        "node |"
    )
    print("|---|---|---|---|---|---:|---|---:|")
    for model, mem, algo, overrides, flags in RECIPES:
        m = FIX / model
        cfg = load_config(
            PRESET, [f"actor.model={m}", f"ref.model={m}", f"critic.model={m}", f"reward.model={m}", *overrides]
        )
        plan = plan_config(cfg, devices=8, device_memory=parse_size(mem), **flags)
        shown = [o for o in overrides if o not in GRPO] + [
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in flags.items()
        ]
        verdict = (
            f"fits ({plan.headroom / GIB:.0f} GiB free)" if plan.fits else f"over by {-plan.headroom / GIB:.0f} GiB"
        )
        host = f"{plan.host_per_node / GIB:.0f} GiB" if plan.host_per_node else "-"
        s = plan.settings
        print(
            f"| {model} | 8 × {mem} | {algo} | {' '.join(shown) or '-'} | dp {s.dp} × tp {s.tp} | "
            f"{plan.peak / GIB:.1f} GiB | {verdict} | {host} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
