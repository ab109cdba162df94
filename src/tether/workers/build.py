"""The role factory: each role built from its config, once, for the local process and for a Ray rank alike.

:func:`actor_worker`, :func:`reference_worker` and :func:`critic_worker` wrap a loaded model in its role
(``tether.distributed.worker.RankWorker`` calls them on each rank after sharding the model);
:func:`build_local_roles` loads every model of a run in this process and wires the :class:`~tether.workers.roles.Roles`
the loop drives (under ``trainer.backend=ray`` the driver's share: tokenizer, its copy of the policy, rollout
engine, reward; ``tether.placement`` then puts actor, reference and critic on the worker groups).
:func:`actor_spec` is one step's update settings.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from transformers import AutoConfig

from tether.config import ConfigError, TetherConfig
from tether.models import (
    ValueModel,
    apply_lora,
    attention,
    load_causal_lm,
    load_tokenizer,
    patch_lm_head,
    resolve_model_path,
)
from tether.rewards import GoldReward, RewardManager, RewardResult
from tether.rollout import HFRolloutEngine
from tether.rollout import vllm as vllm_engine
from tether.rollout.runner import RolloutRunner
from tether.workers.actor import ActorUpdateSpec, ActorWorker, ReferenceWorker
from tether.workers.critic import CriticWorker
from tether.workers.roles import Roles

log = logging.getLogger("tether")


def actor_spec(
    cfg: TetherConfig, kl_loss_coef: float, *, reuse_logprobs: bool = False, entropy_coef: float | None = None
) -> ActorUpdateSpec:
    """The update's settings for one step: β of the KL loss and, given, α of the entropy bonus (the trainer's
    adaptive one under algo.entropy_target; default algo.entropy_coef)."""
    a, k = cfg.algo, cfg.kl
    entropy_coef = a.entropy_coef if entropy_coef is None else entropy_coef
    return ActorUpdateSpec(
        ppo_epochs=a.ppo_epochs,
        mini_batch_size=a.mini_batch_size,
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        dual_clip_c=a.dual_clip_c,
        loss_agg_mode=a.agg_mode,
        entropy_coef=entropy_coef,
        kl_loss_coef=kl_loss_coef,
        kl_loss_estimator=cfg.kl_loss_estimator,
        kl_loss_agg_mode=k.loss_agg_mode or a.agg_mode,
        log_ratio_clamp=k.log_ratio_clamp,
        value_clamp=k.value_clamp,
        target_kl=cfg.guard.target_kl,
        seed=cfg.trainer.seed,
        norm_constant=float(cfg.rollout.max_new_tokens),
        reuse_logprobs=reuse_logprobs,
        kl_off_policy_correction=k.off_policy_correction,
        bypass_correction=bypass_correction(cfg),
        atomic_update=cfg.guard.atomic_update,
        policy_loss=a.policy_loss,
        policy_loss_hyper=a.policy_loss_hyper(),
    )


def bypass_correction(cfg: TetherConfig) -> dict | None:
    """Keyword arguments of :func:`tether.algos.rollout_correction` for the actor to apply per micro-batch in bypass
    mode (``actor.old_logprobs_source=rollout``: π_old is π_rollout, so the correction measures π_θ against it);
    None when rollout correction is off or the trainer applies it (π_old recomputed: ``batch.is_weights``)."""
    if not cfg.algo.rollout_correction.active or cfg.actor.old_logprobs_source != "rollout":
        return None
    return correction_kwargs(cfg)


def correction_kwargs(cfg: TetherConfig) -> dict:
    """``algo.rollout_correction``'s settings as :func:`tether.algos.rollout_correction` keywords (``batch_normalize``
    aside: only the trainer's whole-batch pass normalises)."""
    rc = cfg.algo.rollout_correction
    return dict(
        level=rc.level,
        mode=rc.mode,
        threshold=rc.threshold,
        lower=rc.lower,
        reject=rc.reject,
        reject_threshold=rc.reject_threshold,
        log_ratio_clamp=cfg.kl.log_ratio_clamp,
    )


def pick_device(name: str) -> torch.device:
    """``trainer.device``: ``auto`` is CUDA when a device is visible, else the CPU.

    Raises:
        ConfigError: ``cuda`` without a CUDA device.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available")
    return torch.device(name)


class OfflineScores:
    """Reward 'function' for offline data with a score column: returns each row's stored score."""

    def __call__(self, rows, prompts, responses):
        raw = torch.tensor([float("nan") if r.score is None else float(r.score) for r in rows])
        valid = torch.isfinite(raw)
        metrics = {
            "reward/dataset_score_count": float(valid.sum()),
            "reward/invalid_count": float((~valid).sum()),
            "reward/nonfinite_count": float((~valid).sum()),
            "reward/raw_mean": float(raw[valid].mean()) if bool(valid.any()) else float("nan"),
        }
        return RewardResult(
            scores=torch.where(valid, raw, 0.0), valid=valid, raw_scores=raw, metrics=metrics, errors=[]
        )

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _share_prefix(cfg: TetherConfig, override: bool | None) -> bool:
    """``actor.share_prompt_prefix``, unless ``override`` says otherwise (a Ray group of several ranks turns it off)."""
    return cfg.actor.share_prompt_prefix if override is None else override


def packing(cfg: TetherConfig, *, share_prompt_prefix: bool | None = None) -> dict:
    """The actor's and reference's micro-batching keywords (``actor.max_tokens_per_micro_batch``,
    ``actor.padding_free``,
    ``actor.share_prompt_prefix``, the last overridable: :func:`_share_prefix`)."""
    return {
        "max_tokens_per_micro_batch": cfg.actor.max_tokens_per_micro_batch,
        "padding_free": cfg.actor.padding_free,
        "share_prompt_prefix": _share_prefix(cfg, share_prompt_prefix),
    }


def actor_worker(cfg: TetherConfig, model, *, share_prompt_prefix: bool | None = None) -> ActorWorker:
    """The actor role over a loaded (and, on a rank, sharded) policy model, from the ``actor`` section."""
    a = cfg.actor
    return ActorWorker(
        model,
        lr=a.lr,
        weight_decay=a.weight_decay,
        betas=a.betas,
        warmup_steps=a.warmup_steps,
        grad_clip=a.grad_clip,
        micro_batch_size=a.micro_batch_size,
        temperature=cfg.rollout.temperature,
        compute_dtype=a.compute_dtype,
        **packing(cfg, share_prompt_prefix=share_prompt_prefix),
    )


def reference_worker(
    cfg: TetherConfig, model=None, *, adapter_host=None, share_prompt_prefix: bool | None = None
) -> ReferenceWorker:
    """The reference role: its own frozen ``model``, or the LoRA policy ``adapter_host`` with its adapters disabled."""
    return ReferenceWorker(
        model,
        adapter_host=adapter_host,
        micro_batch_size=cfg.actor.micro_batch_size,
        temperature=cfg.rollout.temperature,
        compute_dtype=cfg.actor.compute_dtype,
        **packing(cfg, share_prompt_prefix=share_prompt_prefix),
    )


def critic_worker(
    cfg: TetherConfig, value_model: ValueModel, *, share_prompt_prefix: bool | None = None
) -> CriticWorker:
    """The critic role over a loaded (and, on a rank, sharded) value model, from the ``critic`` section."""
    c = cfg.critic
    return CriticWorker(
        value_model,
        lr=c.lr,
        grad_clip=c.grad_clip,
        micro_batch_size=c.micro_batch_size,
        value_clip=c.value_clip,
        norm_constant=float(cfg.rollout.max_new_tokens),
        max_tokens_per_micro_batch=c.max_tokens_per_micro_batch,
        padding_free=c.padding_free,
        share_prompt_prefix=_share_prefix(cfg, share_prompt_prefix),
    )


def head_fp32(cfg: TetherConfig) -> bool:
    """The LM head runs in fp32 under a lower ``actor.compute_dtype`` (``actor.lm_head_fp32``)."""
    return cfg.actor.compute_dtype != "float32" and cfg.actor.lm_head_fp32


def check_lora_reference(cfg: TetherConfig) -> None:
    """A LoRA actor's reference is its base model with the adapters disabled.

    Raises:
        ConfigError: a separate ``ref.model``, or ``ref.reset_every`` (which needs a separate copy).
    """
    if cfg.ref.model is not None:
        raise ConfigError("actor.lora.rank > 0 uses the adapter-disabled actor as the reference; leave ref.model null")
    if cfg.ref.reset_every:
        raise ConfigError(
            "ref.reset_every needs a separate reference copy; it cannot be combined with actor.lora.rank > 0 "
            "(the reference is the base model with the adapters disabled)"
        )


def build_local_roles(cfg: TetherConfig) -> Roles:
    """Load every model of this process once and wire the roles (:class:`LocalPlacement`). Under ``trainer.backend=ray``
    this is the driver's share (``tether.placement.build_roles`` then moves actor, reference and critic onto the worker
    groups): the driver's copy of the policy, a reference only for exact/* validation (:func:`driver_holds_ref`), no
    critic.

    Raises:
        ConfigError: a bad model directory, tokenizers that differ, a refused combination (naming the keys).
    """
    device = pick_device(cfg.trainer.device)
    if device.type == "cpu" and cfg.actor.dtype == "float16":
        raise ConfigError(
            "actor.dtype=float16 does not train on a CPU (half-precision sampling overflows); use float32 or bfloat16"
        )
    trc = cfg.actor.trust_remote_code
    actor_path = resolve_model_path(cfg.actor.model, "actor.model")
    if cfg.rollout.engine == "vllm":
        # no vllm, or a head size its kernels refuse: fail before any model loads
        vllm_engine.check_vllm_engine(actor_path, "actor.model", cfg.actor.model)
    elif cfg.rollout.engine == "auto":
        log.info(
            "rollout.engine=auto: %s (%s)",
            *vllm_engine.resolve_engine(
                "auto",
                actor_path,
                backend=cfg.trainer.backend,
                async_steps=cfg.rollout.async_steps,
                value=cfg.actor.model,
            ),
        )
    tok = load_tokenizer(actor_path, trust_remote_code=trc, key="actor.model")
    model_paths = {"actor.model": actor_path}
    attn = attention.for_config(cfg, device)
    log.info(
        "actor.attn_implementation=%s: %s",
        cfg.actor.attn_implementation,
        attn or "the model's own (config.json's, else sdpa)",
    )
    model = attention.set_attn_implementation(
        load_causal_lm(actor_path, dtype=cfg.actor.dtype, trust_remote_code=trc).to(device), attn
    )
    if cfg.actor.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.actor.lora.rank > 0:
        check_lora_reference(cfg)
        model = apply_lora(model, cfg.actor.lora)
        ref = reference_worker(cfg, adapter_host=model)
    else:
        ref_path = resolve_model_path(cfg.ref.model, "ref.model") if cfg.ref.model else actor_path
        if ref_path != actor_path:
            check_same_tokenizer(tok, ref_path, "ref.model", trust_remote_code=trc)
            model_paths["ref.model"] = ref_path
        ref = None
        if driver_holds_ref(cfg):
            if ref_path == actor_path:
                ref_model = copy.deepcopy(model)
            else:
                ref_model = load_causal_lm(ref_path, dtype=cfg.actor.dtype, trust_remote_code=trc).to(device)
                attention.set_attn_implementation(ref_model, attn)
            patch_lm_head(ref_model, fp32=head_fp32(cfg))  # patched after the deepcopy: each head keeps its own forward
            ref = reference_worker(cfg, ref_model)
    patch_lm_head(model, fp32=head_fp32(cfg))
    actor = actor_worker(cfg, model)
    critic = None
    if cfg.algo.adv_estimator == "gae":
        critic_path = resolve_model_path(cfg.critic.model, "critic.model") if cfg.critic.model else actor_path
        if critic_path != actor_path:
            check_same_tokenizer(tok, critic_path, "critic.model", trust_remote_code=trc)
            model_paths["critic.model"] = critic_path
        if cfg.trainer.backend == "ray":  # the critic lives on the workers only; the RNG advances as it would here
            ValueModel.make_head(AutoConfig.from_pretrained(str(critic_path), trust_remote_code=trc).hidden_size)
        else:
            vm = ValueModel.from_pretrained(critic_path, dtype=cfg.actor.dtype, trust_remote_code=trc).to(device)
            attention.set_attn_implementation(vm.backbone, attn)
            critic = critic_worker(cfg, vm)
    engine = build_engine(cfg, model, tok, actor_path)
    runner = RolloutRunner(
        engine,
        tok,
        device,
        mode=cfg.rollout.mode,
        max_new_tokens=cfg.rollout.max_new_tokens,
        eos_token_ids=generation_eos_ids(model),
    )
    reward, val_reward = build_reward(cfg, device)
    gold = build_gold(cfg, device)
    return Roles(
        tok, actor, ref, critic, runner, reward, device, actor_path, val_reward, model_paths=model_paths, gold=gold
    )


def build_reward(cfg: TetherConfig, device) -> tuple[Any, Any]:
    """(the training reward, validation's reward or None): a dataset's stored scores (``rollout.mode=offline`` with
    ``data.score_key`` and no reward function or model), validation then scoring by data source; else a
    :class:`~tether.rewards.RewardManager` of ``reward.function`` / ``reward.model`` / the built-in rewards."""
    if cfg.rollout.mode == "offline" and cfg.data.score_key and not (cfg.reward.function or cfg.reward.model):
        return OfflineScores(), RewardManager(clip=cfg.reward.clip, timeout_s=cfg.reward.timeout_s)
    reward_model = str(resolve_model_path(cfg.reward.model, "reward.model")) if cfg.reward.model else None
    reward = RewardManager(
        function=cfg.reward.function,
        reward_model=reward_model,
        clip=cfg.reward.clip,
        normalize=cfg.reward.normalize,
        model_batch_size=cfg.reward.model_batch_size,
        device=str(device),
        timeout_s=cfg.reward.timeout_s,
    )
    return reward, None


def build_gold(cfg: TetherConfig, device) -> Any:
    """Validation's gold reward (:class:`tether.rewards.GoldReward`): ``reward.val_function`` or ``reward.val_model``,
    else the built-in gold of each row's data source (where one is registered). Loaded at start-up, so a bad
    function or model fails before training (naming its key)."""
    model = str(resolve_model_path(cfg.reward.val_model, "reward.val_model")) if cfg.reward.val_model else None
    return GoldReward(
        cfg.reward.val_function,
        model,
        timeout_s=cfg.reward.timeout_s,
        device=str(device),
        model_batch_size=cfg.reward.model_batch_size,
    )


def driver_holds_ref(cfg: TetherConfig) -> bool:
    """Whether this process loads a separate reference model: always in the local backend; with
    trainer.backend=ray only for the embedded task's exact/* validation metrics (the workers hold
    the reference that training uses)."""
    return cfg.trainer.backend == "local" or (cfg.exact_evaluation_applies and cfg.trainer.val_freq > 0)


def build_engine(cfg: TetherConfig, model, tok, actor_path):
    r = cfg.rollout
    engine = r.engine
    if engine == "auto":
        engine = vllm_engine.resolve_engine(
            "auto", actor_path, backend=cfg.trainer.backend, async_steps=cfg.rollout.async_steps
        )[0]
    if engine == "vllm" and cfg.trainer.backend == "ray":
        return None  # vLLM replicas as Ray actors, set by tether.distributed.ray_backend.build_ray_roles
    if engine == "vllm":
        return vllm_engine.VLLMRolloutEngine(
            actor_path,
            tok,
            temperature=r.engine_temperature or r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            do_sample=r.do_sample,
            dtype=cfg.actor.dtype,
            seed=cfg.trainer.seed,
            trust_remote_code=cfg.actor.trust_remote_code,
            gpu_memory_utilization=r.vllm.gpu_memory_utilization,
            kv_cache_gib=r.vllm.kv_cache_gib,
            max_model_len=r.vllm.max_model_len,
            eos_token_ids=generation_eos_ids(model),
        )
    return HFRolloutEngine(
        model,
        tok,
        temperature=r.engine_temperature or r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        do_sample=r.do_sample,
        eos_token_ids=generation_eos_ids(model),
        compute_dtype=r.compute_dtype or cfg.actor.compute_dtype,
        # the sampled tokens' own log-probs: old_logprobs_source=rollout takes them as π_old, rollout correction weighs
        # against them
        returns_logprobs=cfg.actor.old_logprobs_source == "rollout" or cfg.algo.rollout_correction.active,
        share_prefill=r.share_prefill,
        hf_decode=r.hf_decode,
        drop_finished=r.hf_drop_finished,
        sampler=r.hf_sampler,
    )


def check_same_tokenizer(actor_tok, path, key: str, *, trust_remote_code: bool = False) -> None:
    """The reference and the critic read the actor's token ids: their tokenizer must be the actor's.

    Raises:
        ConfigError: naming ``key`` when the vocabularies differ (a KL between models that number
            tokens differently would be meaningless, and a smaller vocabulary would index out of range).
    """
    other = load_tokenizer(path, trust_remote_code=trust_remote_code, key=key)
    a, b = actor_tok.get_vocab(), other.get_vocab()
    if a != b:
        diff = sum(1 for t, i in a.items() if b.get(t) != i)
        raise ConfigError(
            f"{key}={str(path)!r} has a different tokenizer from actor.model (vocabulary {len(b)} vs {len(a)} tokens, "
            f"{diff} of the actor's tokens numbered differently); the reference and critic must share the actor's "
            "tokenizer"
        )


def generation_eos_ids(model) -> list[int]:
    """The EOS ids of a model's ``generation_config`` (an int or a list; [] when unset)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
