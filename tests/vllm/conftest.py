"""vLLM writes caches, configs, usage stats and sockets under $HOME and $TMPDIR by default: keep
them in the project's .tmp/ (before vllm is first imported; vLLM reads these lazily)."""

import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_TMP = Path(os.environ.get("TETHER_TEST_TMP") or _ROOT / ".tmp")

for _key, _sub in (
    ("VLLM_CACHE_ROOT", "vllm/cache"),
    ("VLLM_CONFIG_ROOT", "vllm/config"),
    ("VLLM_ASSETS_CACHE", "vllm/assets"),
    ("VLLM_RPC_BASE_PATH", "vllm/rpc"),
    ("TORCHINDUCTOR_CACHE_DIR", "vllm/inductor"),
    ("TRITON_CACHE_DIR", "vllm/triton"),
):
    os.environ.setdefault(_key, str(_TMP / _sub))
    Path(os.environ[_key]).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the test's process, as the trainer runs it
