#!/usr/bin/env bash
# GPU check of trainer.backend=ray (one short run, ~2-3 minutes on one GPU; prepared but not yet run
# on a GPU): a tiny Qwen2 model trained 3 steps with one NCCL worker, fp32 master weights and bf16
# compute, then with CPU offload, printing per-step phase times and each worker's peak GPU memory.
#
#   bash benchmarks/gpu_check_distributed.sh     # from anywhere; PYTHON=.venv/bin/python to choose
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
WORK=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "nvidia-smi not found"
$PY - "$WORK" <<'PYEOF'
import sys, time
from pathlib import Path

import ray

from tether.config import load_config
from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts
from tether.trainer.trainer import Trainer

root = Path(sys.argv[1])
tok = build_gsm8k_tokenizer(root / "tok", texts=synthetic_math_texts())
build_tiny_causal_lm(root / "model", tok, arch="qwen2", hidden=256, layers=4, heads=4)
ray.init(include_dashboard=False, log_to_driver=False)
for label, extra in [("bf16 compute, fp32 master", []), ("+ cpu_offload", ["trainer.fsdp.cpu_offload=true"])]:
    cfg = load_config(None, [f"actor.model={root / 'model'}", "trainer.total_steps=3", "trainer.val_freq=0", "trainer.save_freq=0",
                             "trainer.progress=false", "trainer.report=false", "data.batch_size=8", "rollout.n=4",
                             "rollout.max_new_tokens=16", "trainer.backend=ray", "trainer.n_gpus_per_node=1",
                             "trainer.fsdp.param_dtype=bfloat16", f"trainer.output_dir={root / label.replace(' ', '_')}", *extra])
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    rows = [trainer.train_step() for _ in range(3)]
    mem = trainer.roles.placement.actor_group.call("memory_stats")
    trainer.roles.close()
    print(f"== {label}: {time.perf_counter() - t0:.1f} s with start-up; memory of rank 0: {mem}")
    for r in rows:
        print({k: round(v, 4) for k, v in r.items() if k.startswith(("timing/rollout", "timing/logprobs", "timing/update_actor", "policy/loss", "perf/"))})
ray.shutdown()
PYEOF
