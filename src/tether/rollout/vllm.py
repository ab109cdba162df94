"""Rollout with vLLM (``rollout.engine=vllm``): fast sampling on a GPU, the trainer's log-probs.

vLLM only samples. The trainer recomputes old/ref log-probs with its own forward pass (same
temperature), so vLLM's sampler numerics never enter the loss; after each actor update
:meth:`VLLMRolloutEngine.sync_weights` copies the actor's current weights into the engine (LoRA
adapters merged on the fly, the trainer's base weights untouched) and drops vLLM's prefix cache,
whose KV entries were computed with the old weights.

The engine runs in the trainer's process on the same GPU (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set
unless you set it), taking ``gpu_memory_utilization`` of the GPU's memory for its weights and KV cache;
the rest is the trainer's. Install with ``pip install 'tether[vllm]'`` on a machine with an NVIDIA GPU.

Weight loading reaches into vLLM internals, which move between releases; :func:`_load_into_vllm`
tries, in order, the in-process model runner (``llm_engine.model_executor.driver_worker[.worker]
.model_runner.model``, vLLM 0.4-0.11), ``LLM.collective_rpc`` and ``LLM.apply_model``, and raises a
RuntimeError naming what it tried when none works.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from tether.config import ConfigError

log = logging.getLogger("tether")

__all__ = ["VLLMRolloutEngine", "check_vllm_available", "hf_named_weights"]


def check_vllm_available() -> None:
    """Raise a ConfigError saying what is missing for ``rollout.engine=vllm`` (the package, a GPU)."""
    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("the vllm package is not installed (pip install 'tether[vllm]', on a machine with an NVIDIA GPU)")
    if not torch.cuda.is_available():
        missing.append("no CUDA GPU is visible (torch.cuda.is_available() is False)")
    if missing:
        raise ConfigError("rollout.engine=vllm: " + "; ".join(missing) + ". Use rollout.engine=hf (the default, CPU or GPU).")


def hf_named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's weights under Hugging Face checkpoint names, as vLLM's ``load_weights`` expects.

    A plain model: its ``state_dict()`` items. A peft LoRA model: the base model's names (no
    ``base_model.model.`` prefix, no ``.base_layer``), each adapted weight replaced by
    ``W + scaling · B @ A`` of its active adapters, computed out of place (the trainer's frozen base
    weights, i.e. the reference policy, are never modified). Tensors stay on the model's device.
    """
    if not hasattr(model, "peft_config"):
        return [(k, v.detach()) for k, v in model.state_dict().items()]
    inner = model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for name, mod in inner.named_modules():
        if hasattr(mod, "base_layer") and hasattr(mod, "lora_A") and hasattr(mod, "get_delta_weight"):
            active = [a for a in getattr(mod, "active_adapters", []) if a in mod.lora_A]
            if active and not getattr(mod, "merged", False):
                deltas[name] = sum(mod.get_delta_weight(a) for a in active)
    out = []
    for key, t in inner.state_dict().items():
        if "lora_" in key or "modules_to_save" in key:
            continue
        clean = key.replace(".base_layer.", ".")
        owner = clean.rsplit(".", 1)[0]
        if ".base_layer." in key and key.endswith(".base_layer.weight") and owner in deltas:
            t = t + deltas[owner].to(t.dtype)
        out.append((clean, t.detach()))
    return out


def _vllm_model(llm):
    """The in-process vLLM model (an nn.Module with ``load_weights``), or None."""
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    worker = getattr(executor, "driver_worker", None)
    for w in (worker, getattr(worker, "worker", None)):
        model = getattr(getattr(w, "model_runner", None), "model", None)
        if model is not None and hasattr(model, "load_weights"):
            return model
    return None


def _load_into_vllm(llm, weights: list[tuple[str, torch.Tensor]]) -> str:
    """Load ``weights`` into a vLLM ``LLM``; returns which path worked. Raises RuntimeError."""
    tried = []
    model = _vllm_model(llm)
    if model is not None:
        model.load_weights(weights)
        return "model_runner"
    tried.append("llm.llm_engine.model_executor.driver_worker[.worker].model_runner.model")
    if hasattr(llm, "collective_rpc"):
        def _load(worker, w=weights):  # runs on each worker; in-process here
            worker.model_runner.model.load_weights(w)

        try:
            llm.collective_rpc(_load)
            return "collective_rpc"
        except Exception as e:  # noqa: BLE001 - version-dependent; fall through to the next way
            tried.append(f"llm.collective_rpc ({type(e).__name__}: {e})")
    if hasattr(llm, "apply_model"):
        try:
            llm.apply_model(lambda m: m.load_weights(weights))
            return "apply_model"
        except Exception as e:  # noqa: BLE001
            tried.append(f"llm.apply_model ({type(e).__name__}: {e})")
    version = getattr(importlib.import_module("vllm"), "__version__", "?") if importlib.util.find_spec("vllm") else "?"
    raise RuntimeError(f"cannot push weights into vLLM {version}; tried: " + "; ".join(tried))


class VLLMRolloutEngine:
    """Samples responses with a vLLM ``LLM`` from token ids; same interface as ``HFRolloutEngine``.

    Args:
        model_path: the actor's local model directory (vLLM loads its own copy of the weights).
        tokenizer: the trainer's tokenizer (pad and EOS ids).
        temperature, top_p, top_k, max_new_tokens, do_sample: as ``rollout.*`` (top_k 0 = off;
            do_sample False = greedy).
        dtype: ``actor.dtype`` (vLLM runs in it; weights pushed in another dtype are cast).
        seed: vLLM's sampling seed (``trainer.seed``).
        trust_remote_code: ``actor.trust_remote_code``.
        gpu_memory_utilization: fraction of GPU memory vLLM takes (weights + KV cache).
        max_model_len: longest prompt + response vLLM plans for (default: the model's).
        enforce_eager: skip CUDA graph capture (faster start, weights can change freely).

    Raises:
        ConfigError: vllm is not installed or no CUDA GPU is visible.
    """

    def __init__(self, model_path, tokenizer, *, temperature: float, top_p: float, top_k: int, max_new_tokens: int, do_sample: bool = True,
                 dtype: str = "bfloat16", seed: int = 0, trust_remote_code: bool = False, gpu_memory_utilization: float = 0.35,
                 max_model_len: int | None = None, enforce_eager: bool = True):  # fmt: skip
        check_vllm_available()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process: weights can be pushed
        from vllm import LLM, SamplingParams

        kwargs = dict(model=str(model_path), tokenizer=str(model_path), dtype=dtype, seed=seed, trust_remote_code=trust_remote_code,
                      gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager)  # fmt: skip
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        llm = LLM(**kwargs)
        self._setup(llm, SamplingParams, tokenizer, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, do_sample=do_sample)

    @classmethod
    def from_llm(cls, llm, sampling_params_cls, tokenizer, **sampling) -> VLLMRolloutEngine:
        """An engine around an existing ``LLM`` (or a stand-in with the same methods, for tests)."""
        self = cls.__new__(cls)
        self._setup(llm, sampling_params_cls, tokenizer, **sampling)
        return self

    def _setup(self, llm, sampling_params_cls, tokenizer, *, temperature, top_p, top_k, max_new_tokens, do_sample=True) -> None:
        self.llm = llm
        self.sampling_params_cls = sampling_params_cls
        self.tokenizer = tokenizer
        self.defaults = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, do_sample=do_sample)
        self.eos_ids = [tokenizer.eos_token_id]
        self.last_sync: str | None = None

    def sampling_params(self, **overrides):
        """vLLM ``SamplingParams`` from the engine's settings and HF-style overrides
        (``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``)."""
        unknown = set(overrides) - set(self.defaults)
        if unknown:
            raise TypeError(f"VLLMRolloutEngine.generate: unsupported generation argument(s) {sorted(unknown)}")
        s = {**self.defaults, **{k: v for k, v in overrides.items() if v is not None}}
        greedy = not s["do_sample"]
        kwargs = dict(
            n=1, temperature=0.0 if greedy else float(s["temperature"]), top_p=1.0 if greedy else float(s["top_p"]),
            top_k=-1 if greedy or not s["top_k"] else int(s["top_k"]), max_tokens=int(s["max_new_tokens"]),
            stop_token_ids=list(self.eos_ids),
        )  # fmt: skip
        try:
            return self.sampling_params_cls(**kwargs, detokenize=False)  # the trainer decodes itself
        except TypeError:  # older vLLM without detokenize
            return self.sampling_params_cls(**kwargs)

    def _generate(self, prompts: list[list[int]], params):
        try:
            return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        except TypeError:  # vLLM < 0.4.3 took prompt_token_ids as a keyword
            return self.llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **overrides) -> torch.Tensor:
        """One response per row.

        Args:
            prompt_ids, prompt_mask: (B, P), left-padded (padding is stripped before vLLM sees it).
            overrides: ``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``.
        Returns:
            response_ids (B, T) int64 on ``prompt_ids``' device, T = the longest response (>= 1),
            right-padded with the pad token; a response that stopped ends with its EOS token.
        Raises:
            TypeError: an unsupported override.
        """
        params = self.sampling_params(**overrides)
        prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)]
        outs = self._generate(prompts, params)
        seqs = [self._response(o.outputs[0]) for o in outs]
        T = max(1, max(len(s) for s in seqs))
        out = torch.full((len(seqs), T), self.tokenizer.pad_token_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            if s:
                out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        return out.to(prompt_ids.device)

    def _response(self, completion) -> list[int]:
        """A completion's token ids, with the EOS that stopped it (vLLM versions differ on keeping it)."""
        ids = list(completion.token_ids)
        if getattr(completion, "finish_reason", None) == "stop" and (not ids or ids[-1] not in self.eos_ids):
            reason = getattr(completion, "stop_reason", None)
            if reason is None or reason in self.eos_ids:  # stopped by EOS / an EOS stop id, not by a stop string
                ids.append(self.eos_ids[0] if reason is None else int(reason))
        return ids

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the actor's current weights into vLLM (LoRA merged out of place) and reset vLLM's
        prefix cache. Called by the trainer after every actor update and after a resume/rollback.

        Raises:
            RuntimeError: this vLLM version offers none of the known ways to load weights.
        """
        self.last_sync = _load_into_vllm(self.llm, hf_named_weights(model))
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if callable(reset):
            reset()
