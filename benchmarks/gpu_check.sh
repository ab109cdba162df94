#!/usr/bin/env bash
# GPU checks for tether, for someone with an NVIDIA GPU (about 5 minutes on one GPU):
#   1. install vllm if it is missing (skip with GPU_CHECK_INSTALL=0; the vLLM checks then skip),
#   2. the vLLM tests (tests/vllm: stand-ins, and the real engine, marker vllm) and the real-model tests on CUDA (GSM8K GRPO/offline,
#      LoRA, eval: trainer.device=auto picks the GPU),
#   3. a 3-step `tether train` of a tiny Qwen2 model with rollout.engine=vllm, and the same with the
#      HF engine on CUDA for comparison,
# printing the wall time of each. Exit status: non-zero if a check failed.
#
#   bash benchmarks/gpu_check.sh            # from the repository root or anywhere
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
FAILED=0
declare -a SUMMARY

step() {  # step NAME COMMAND...: run, time, record
  local name=$1; shift
  echo; echo "== $name"
  local t0=$EPOCHREALTIME
  "$@"; local rc=$?
  local dt=$(awk "BEGIN {print $EPOCHREALTIME - $t0}")
  SUMMARY+=("$(printf '%-44s %6.1fs  %s' "$name" "$dt" "$([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")")")
  [ $rc -eq 0 ] || FAILED=1
  return $rc
}

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi not found"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

if ! $PY -c "import vllm" 2>/dev/null && [ "${GPU_CHECK_INSTALL:-1}" != 0 ]; then
  step "pip install vllm" $PY -m pip install -q --timeout 20 --retries 1 "vllm>=0.6" || echo "vllm could not be installed: the vLLM checks will skip"
fi
HAS_VLLM=$($PY -c "import vllm; print(vllm.__version__)" 2>/dev/null || echo "")
echo "vllm: ${HAS_VLLM:-not installed}"

step "pytest tests/vllm (vLLM engine, weight sync, GRPO)" $PY -m pytest -q -rs -p no:cacheprovider tests/vllm
step "pytest real-model tests on CUDA" $PY -m pytest -q -rs -p no:cacheprovider tests/gsm8k tests/trainer/test_lora.py tests/trainer/test_offline.py tests/test_eval.py

$PY - "$WORK" <<'PYEOF'
import sys
from pathlib import Path
from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts
root = Path(sys.argv[1])
tok = build_gsm8k_tokenizer(root / "tok", texts=synthetic_math_texts())
build_tiny_causal_lm(root / "model", tok, arch="qwen2", hidden=128, layers=2, heads=2)
PYEOF
TRAIN=($PY -m tether.cli train "actor.model=$WORK/model" trainer.total_steps=3 trainer.val_freq=0 trainer.progress=false
       trainer.report=false data.batch_size=8 rollout.n=4 rollout.max_new_tokens=16 trainer.device=cuda)
if [ -n "$HAS_VLLM" ]; then
  step "tether train 3 steps, rollout.engine=vllm" "${TRAIN[@]}" rollout.engine=vllm "trainer.output_dir=$WORK/run-vllm"
  $PY -c "import json; [print({k: round(v, 4) for k, v in json.loads(l).items() if k.startswith(('step', 'timing/rollout', 'timing/update_actor', 'reward/score_mean', 'response/length_mean'))}) for l in open('$WORK/run-vllm/metrics.jsonl')]" || true
fi
step "tether train 3 steps, rollout.engine=hf (cuda)" "${TRAIN[@]}" rollout.engine=hf "trainer.output_dir=$WORK/run-hf"
$PY -c "import json; [print({k: round(v, 4) for k, v in json.loads(l).items() if k.startswith(('step', 'timing/rollout', 'timing/update_actor', 'reward/score_mean', 'response/length_mean'))}) for l in open('$WORK/run-hf/metrics.jsonl')]" || true

echo; echo "== summary (vllm: ${HAS_VLLM:-not installed})"
printf '%s\n' "${SUMMARY[@]}"
rm -rf "$WORK"
exit $FAILED
