"""Building the roles from a config: tokenizer, actor, reference, critic, rollout engine, reward."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

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
from tether.workers import ActorWorker, CriticWorker, ReferenceWorker
from tether.workers.actor import ActorUpdateSpec

log = logging.getLogger("tether")


@dataclass
class Roles:
    tokenizer: Any
    actor: ActorWorker
    ref: ReferenceWorker
    critic: CriticWorker | None
    engine: Any  # RolloutRunner
    reward: Any  # RewardManager or OfflineScores
    device: torch.device
    actor_path: Any
    val_reward: Any = None  # scores generated validation responses when `reward` only replays dataset scores
    backend: Any = None  # trainer.backend=ray: the RayBackend whose worker groups run actor, ref and critic
    #: {config key: model directory} of the models that run over whole sequences (the actor, and a separate
    #: ref.model / critic.model where one is used), for the start-up context-length check
    model_paths: dict = field(default_factory=dict)
    gold: Any = None  # GoldReward: validation's gold reward (reward.val_function / val_model, else built-in by data_source)

    def close(self) -> None:
        """Stop the Ray worker groups (and a Ray this run started); nothing for the local backend."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    @staticmethod
    def actor_spec(cfg: TetherConfig, kl_loss_coef: float, guard, *, reuse_logprobs: bool = False, entropy_coef: float | None = None) -> ActorUpdateSpec:
        """The update's settings for one step: β of the KL loss and, given, α of the entropy bonus (the trainer's
        adaptive one under algo.entropy_target; default algo.entropy_coef)."""
        a, k = cfg.algo, cfg.kl
        entropy_coef = a.entropy_coef if entropy_coef is None else entropy_coef
        return ActorUpdateSpec(
            ppo_epochs=a.ppo_epochs, mini_batch_size=a.mini_batch_size, clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
            dual_clip_c=a.dual_clip_c, loss_agg_mode=a.agg_mode, entropy_coef=entropy_coef, kl_loss_coef=kl_loss_coef,
            kl_loss_estimator=cfg.kl_loss_estimator, kl_loss_agg_mode=k.loss_agg_mode or a.agg_mode,
            log_ratio_clamp=k.log_ratio_clamp, value_clamp=k.value_clamp, target_kl=cfg.guard.target_kl, seed=cfg.trainer.seed,
            norm_constant=float(cfg.rollout.max_new_tokens), reuse_logprobs=reuse_logprobs,
            kl_off_policy_correction=k.off_policy_correction, bypass_correction=bypass_correction(cfg), atomic_update=cfg.guard.atomic_update,
            policy_loss=a.policy_loss, policy_loss_hyper=a.policy_loss_hyper(),
        )  # fmt: skip


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
    return dict(level=rc.level, mode=rc.mode, threshold=rc.threshold, lower=rc.lower, reject=rc.reject, reject_threshold=rc.reject_threshold,
                log_ratio_clamp=cfg.kl.log_ratio_clamp)  # fmt: skip


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available")
    return torch.device(name)


class OfflineScores:
    """Reward 'function' for offline data with a score column: returns each row's stored score."""

    def __call__(self, rows, prompts, responses):
        from tether.rewards import RewardResult

        raw = torch.tensor([float("nan") if r.score is None else float(r.score) for r in rows])
        valid = torch.isfinite(raw)
        metrics = {
            "reward/dataset_score_count": float(valid.sum()),
            "reward/invalid_count": float((~valid).sum()),
            "reward/nonfinite_count": float((~valid).sum()),
            "reward/raw_mean": float(raw[valid].mean()) if bool(valid.any()) else float("nan"),
        }
        return RewardResult(scores=torch.where(valid, raw, 0.0), valid=valid, raw_scores=raw, metrics=metrics, errors=[])

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def build_roles(cfg: TetherConfig) -> Roles:
    """Load every model once and wire the roles. Raises ConfigError for a bad model directory."""
    from tether.rewards import RewardManager
    from tether.trainer.rollout import RolloutRunner

    if cfg.trainer.backend == "ray":
        from tether.distributed.ray_backend import check_ray_installed

        check_ray_installed()  # a one-line error naming the extra, before any model loads
        if cfg.trainer.ray_address:  # a cluster that does not answer: one line in seconds, not Ray's 14 minutes of retries
            from tether.distributed.ray_backend import probe_ray_address

            probe_ray_address(cfg.trainer.ray_address)
    device = pick_device(cfg.trainer.device)
    if device.type == "cpu" and cfg.actor.dtype == "float16":
        raise ConfigError("actor.dtype=float16 does not train on a CPU (half-precision sampling overflows); use float32 or bfloat16")
    trc = cfg.actor.trust_remote_code
    actor_path = resolve_model_path(cfg.actor.model, "actor.model")
    if cfg.rollout.engine == "vllm":
        from tether.rollout.vllm import check_vllm_engine

        check_vllm_engine(actor_path, "actor.model", cfg.actor.model)  # no vllm, or a head size its kernels refuse: fail before any model loads
    elif cfg.rollout.engine == "auto":
        from tether.rollout.vllm import resolve_engine

        log.info("rollout.engine=auto: %s (%s)", *resolve_engine("auto", actor_path, backend=cfg.trainer.backend, async_steps=cfg.rollout.async_steps, value=cfg.actor.model))
    if cfg.trainer.backend == "ray" and cfg.actor.tp_size > 1:
        check_tp_heads(cfg, actor_path)  # before any model loads or Ray starts (the workers would find it after both)
    tok = load_tokenizer(actor_path, trust_remote_code=trc, key="actor.model")
    model_paths = {"actor.model": actor_path}
    attn = attention.for_config(cfg, device)
    log.info("actor.attn_implementation=%s: %s", cfg.actor.attn_implementation, attn or "the model's own (config.json's, else sdpa)")
    model = attention.set_attn_implementation(load_causal_lm(actor_path, dtype=cfg.actor.dtype, trust_remote_code=trc).to(device), attn)
    if cfg.actor.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    cdt = cfg.actor.compute_dtype
    head_fp32 = cdt != "float32" and cfg.actor.lm_head_fp32
    temp = cfg.rollout.temperature
    packing = {
        "max_tokens_per_micro_batch": cfg.actor.max_tokens_per_micro_batch, "padding_free": cfg.actor.padding_free,
        "share_prompt_prefix": cfg.actor.share_prompt_prefix,
    }  # fmt: skip
    if cfg.actor.lora.rank > 0:
        if cfg.ref.model is not None:
            raise ConfigError("actor.lora.rank > 0 uses the adapter-disabled actor as the reference; leave ref.model null")
        if cfg.ref.reset_every:
            raise ConfigError("ref.reset_every needs a separate reference copy; it cannot be combined with actor.lora.rank > 0 "
                              "(the reference is the base model with the adapters disabled)")
        model = apply_lora(model, cfg.actor.lora)
        ref = ReferenceWorker(adapter_host=model, micro_batch_size=cfg.actor.micro_batch_size, temperature=temp, compute_dtype=cdt, **packing)
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
            patch_lm_head(ref_model, fp32=head_fp32)  # patched after the deepcopy: each head keeps its own forward
            ref = ReferenceWorker(ref_model, micro_batch_size=cfg.actor.micro_batch_size, temperature=temp, compute_dtype=cdt, **packing)
    patch_lm_head(model, fp32=head_fp32)
    actor = ActorWorker(
        model, lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay, betas=cfg.actor.betas, warmup_steps=cfg.actor.warmup_steps,
        grad_clip=cfg.actor.grad_clip, micro_batch_size=cfg.actor.micro_batch_size, temperature=temp, compute_dtype=cdt, **packing,
    )  # fmt: skip
    critic = None
    if cfg.algo.adv_estimator == "gae":
        critic_path = resolve_model_path(cfg.critic.model, "critic.model") if cfg.critic.model else actor_path
        if critic_path != actor_path:
            check_same_tokenizer(tok, critic_path, "critic.model", trust_remote_code=trc)
            model_paths["critic.model"] = critic_path
        if cfg.trainer.backend == "ray":  # the critic lives on the workers only; the RNG advances as it would here
            from transformers import AutoConfig

            ValueModel.make_head(AutoConfig.from_pretrained(str(critic_path), trust_remote_code=trc).hidden_size)
        else:
            vm = ValueModel.from_pretrained(critic_path, dtype=cfg.actor.dtype, trust_remote_code=trc).to(device)
            attention.set_attn_implementation(vm.backbone, attn)
            critic = CriticWorker(
                vm, lr=cfg.critic.lr, grad_clip=cfg.critic.grad_clip, micro_batch_size=cfg.critic.micro_batch_size,
                value_clip=cfg.critic.value_clip, norm_constant=float(cfg.rollout.max_new_tokens),
                max_tokens_per_micro_batch=cfg.critic.max_tokens_per_micro_batch, padding_free=cfg.critic.padding_free,
                share_prompt_prefix=cfg.actor.share_prompt_prefix,
            )  # fmt: skip
    engine = _build_engine(cfg, model, tok, actor_path)
    runner = RolloutRunner(engine, tok, device, mode=cfg.rollout.mode, max_new_tokens=cfg.rollout.max_new_tokens, eos_token_ids=generation_eos_ids(model))
    val_reward = None
    if cfg.rollout.mode == "offline" and cfg.data.score_key and not (cfg.reward.function or cfg.reward.model):
        reward = OfflineScores()
        val_reward = RewardManager(clip=cfg.reward.clip, timeout_s=cfg.reward.timeout_s)  # validation generates: built-in rewards by data_source
    else:
        reward_model = str(resolve_model_path(cfg.reward.model, "reward.model")) if cfg.reward.model else None
        reward = RewardManager(
            function=cfg.reward.function, reward_model=reward_model, clip=cfg.reward.clip, normalize=cfg.reward.normalize,
            model_batch_size=cfg.reward.model_batch_size, device=str(device), timeout_s=cfg.reward.timeout_s,
        )  # fmt: skip
    gold = build_gold(cfg, device)
    roles = Roles(tok, actor, ref, critic, runner, reward, device, actor_path, val_reward, model_paths=model_paths, gold=gold)
    if cfg.trainer.backend == "ray":
        from tether.distributed.ray_backend import build_ray_roles

        return build_ray_roles(cfg, roles)  # actor, ref, critic run on Ray worker groups; the rest stays here
    return roles


def build_gold(cfg: TetherConfig, device) -> Any:
    """Validation's gold reward (:class:`tether.rewards.GoldReward`): ``reward.val_function`` or ``reward.val_model``,
    else the built-in gold of each row's data source (where one is registered). Loaded at start-up, so a bad
    function or model fails before training (naming its key)."""
    from tether.rewards import GoldReward

    model = str(resolve_model_path(cfg.reward.val_model, "reward.val_model")) if cfg.reward.val_model else None
    return GoldReward(cfg.reward.val_function, model, timeout_s=cfg.reward.timeout_s, device=str(device),
                      model_batch_size=cfg.reward.model_batch_size)  # fmt: skip


def policy_as_is(actor):
    """The actor role's model for its config and parameter shapes only: under trainer.backend=ray
    with vLLM replicas the driver's copy as it is, without pulling the updated weights
    (``tether.distributed.ray_backend.RemoteActor``); else ``actor.model``."""
    return actor.model_as_is if hasattr(actor, "model_as_is") else actor.model


def driver_holds_ref(cfg: TetherConfig) -> bool:
    """Whether this process loads a separate reference model: always in the local backend; with
    trainer.backend=ray only for the embedded task's exact/* validation metrics (the workers hold
    the reference that training uses)."""
    from tether.trainer.stats import exact_evaluation_applies

    return cfg.trainer.backend == "local" or (exact_evaluation_applies(cfg) and cfg.trainer.val_freq > 0)


def _build_engine(cfg: TetherConfig, model, tok, actor_path):
    r = cfg.rollout
    engine = r.engine
    if engine == "auto":
        from tether.rollout.vllm import resolve_engine

        engine = resolve_engine("auto", actor_path, backend=cfg.trainer.backend, async_steps=cfg.rollout.async_steps)[0]
    if engine == "vllm" and cfg.trainer.backend == "ray":
        return None  # vLLM replicas as Ray actors, set by tether.distributed.ray_backend.build_ray_roles
    if engine == "vllm":
        from tether.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(
            actor_path, tok, temperature=r.engine_temperature or r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens, do_sample=r.do_sample,
            dtype=cfg.actor.dtype, seed=cfg.trainer.seed, trust_remote_code=cfg.actor.trust_remote_code,
            gpu_memory_utilization=r.vllm.gpu_memory_utilization, kv_cache_gib=r.vllm.kv_cache_gib, max_model_len=r.vllm.max_model_len,
            eos_token_ids=generation_eos_ids(model),
        )  # fmt: skip
    from tether.rollout import HFRolloutEngine

    return HFRolloutEngine(
        model, tok, temperature=r.engine_temperature or r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
        do_sample=r.do_sample, eos_token_ids=generation_eos_ids(model), compute_dtype=r.compute_dtype or cfg.actor.compute_dtype,
        # the sampled tokens' own log-probs: old_logprobs_source=rollout takes them as π_old, rollout correction weighs against them
        returns_logprobs=cfg.actor.old_logprobs_source == "rollout" or cfg.algo.rollout_correction.active, share_prefill=r.share_prefill,
        hf_decode=r.hf_decode, drop_finished=r.hf_drop_finished, sampler=r.hf_sampler,
    )  # fmt: skip


def check_tp_heads(cfg: TetherConfig, actor_path) -> None:
    """``actor.tp_size`` must split the attention and KV heads of every model the worker groups shard (the actor,
    and a separate ``ref.model`` / ``critic.model``), read from their config.json before anything loads.

    Raises:
        ConfigError: naming ``actor.tp_size``, the model's key and the count it does not divide.
    """
    from transformers import AutoConfig

    from tether.distributed.parallel import ParallelDims

    dims = ParallelDims.from_world(cfg.actor.tp_size, cfg.actor.tp_size)
    models = {"actor.model": actor_path}
    for key, value in (("ref.model", cfg.ref.model), ("critic.model", cfg.critic.model if cfg.algo.adv_estimator == "gae" else None)):
        if value is not None:
            models[key] = resolve_model_path(value, key)
    for key, path in models.items():
        try:
            dims.check_model(AutoConfig.from_pretrained(path, trust_remote_code=cfg.actor.trust_remote_code))
        except ConfigError as e:
            raise ConfigError(f"{e} ({key}={path})") from None


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
            f"{diff} of the actor's tokens numbered differently); the reference and critic must share the actor's tokenizer"
        )


def generation_eos_ids(model) -> list[int]:
    """The EOS ids of a model's ``generation_config`` (an int or a list; [] when unset)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
