"""The role factory: each role built from its config, once, for the local process and for a Ray rank alike.

Models are assembled by one recipe, :func:`assemble_policy` (and :func:`assemble_critic`), which every placement
runs with every check: this process for its own models, each Ray rank (``tether.distributed.worker.RankWorker``)
before it shards them. :func:`actor_worker`, :func:`reference_worker` and :func:`critic_worker` wrap an assembled
(and, on a rank, sharded) model in its role. :func:`build_driver_share` is what this process holds of a run (all of
it locally; under ``trainer.backend=ray`` the tokenizer, its copy of the policy, the reward);
:func:`build_runner` builds the rollout role whole, its engine by the engine registry (``tether.engines``,
``tether.rollout.registry``); :func:`build_local_roles` wires the :class:`~tether.workers.roles.Roles` of the local
backend. :func:`actor_spec` is one step's update settings.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from peft import set_peft_model_state_dict
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from tether import engines
from tether.agents import AgentSpec, build_agent, plain_observation_problem
from tether.algos import FULL_DISTILL_ESTIMATORS
from tether.config import EXACT_TEACHER, ConfigError, TetherConfig, exact_teacher_beta
from tether.data.loading import load_prompt_rows
from tether.models import (
    DTYPES,
    ValueModel,
    apply_lora,
    attention,
    load_causal_lm,
    load_tokenizer,
    patch_lm_head,
    resolve_model_path,
)
from tether.rewards import GoldReward, RewardManager, RewardResult
from tether.rollout import registry
from tether.rollout.agent import AgentRunner
from tether.rollout.engine import GenerationEngine
from tether.rollout.runner import RolloutRunner
from tether.tasks import embedded_task
from tether.tasks.exact_teacher import ExactTeacher
from tether.tasks.sft import load_reference
from tether.workers.actor import ActorUpdateSpec, ActorWorker, DistillSpec, ReferenceWorker
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
        kl_loss_to_go=k.loss_to_go,
        bypass_correction=bypass_correction(cfg),
        atomic_update=cfg.guard.atomic_update,
        policy_loss=a.policy_loss,
        policy_loss_hyper=a.policy_loss_hyper(),
        distill=distill_spec(cfg),
    )


def distill_spec(cfg: TetherConfig) -> DistillSpec | None:
    """``distill.*`` as the actor's per-state divergence term: None without a teacher or with ``distill.estimator=k1``
    (a reward only)."""
    d = cfg.distill
    if d.teacher is None or d.estimator not in FULL_DISTILL_ESTIMATORS:
        return None
    return DistillSpec(coef=d.coef, estimator=d.estimator, jsd_beta=d.jsd_beta, top_k=d.top_k)


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
            "ref.reset_every needs a separate reference copy; it cannot be combined with actor.lora.rank > 0 (the "
            "reference is the base model with the adapters disabled)"
        )


# ---------------------------------------------------------------------------- the one model-assembly recipe
@dataclass
class PolicyModels:
    """The policy and its reference as :func:`assemble_policy` made them.

    Attributes:
        policy: the policy module (with LoRA adapters when ``actor.lora.rank`` > 0).
        reference: a separate frozen reference module, or None: a LoRA policy's reference is the policy with its
            adapters disabled (``lora``), or this process holds none (``with_reference=False``).
        lora: the policy carries LoRA adapters (its reference is adapters-off).
        tokenizer: the actor's tokenizer.
        paths: ``{config key: model directory}`` of the models that run over whole sequences (``actor.model``, and
            ``ref.model`` when separate), for the start-up context-length check.
    """

    policy: torch.nn.Module
    reference: torch.nn.Module | None
    lora: bool
    tokenizer: Any
    paths: dict[str, Path] = field(default_factory=dict)


def _load_lm(cfg: TetherConfig, path, device: torch.device):
    """A causal LM from ``path`` on ``device``; on the meta device its architecture only (no weights read)."""
    trc = cfg.actor.trust_remote_code
    if device.type == "meta":
        with torch.device("meta"):
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=trc)
            return AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.actor.dtype], trust_remote_code=trc)
    return load_causal_lm(path, dtype=cfg.actor.dtype, trust_remote_code=trc).to(device)


def assemble_policy(
    cfg: TetherConfig,
    device: torch.device,
    *,
    load_device: torch.device | None = None,
    with_reference: bool = True,
    lora_state: dict | None = None,
    gradient_checkpointing: bool = False,
    tokenizer=None,
) -> PolicyModels:
    """The policy and its reference, by one recipe for every placement (this process, each Ray rank): resolve the
    model directories; check what can be checked before loading (a LoRA actor's reference, the tokenizer of a
    separate reference); load; attention (``actor.attn_implementation`` on ``device``); LoRA adapters (the driver's
    ``lora_state`` where given); the reference (adapters off, a copy of the policy, or ``ref.model``); the LM-head
    patch on each (``actor.lm_head_fp32``). Sharding is the placement's, after this.

    Args:
        cfg: the run's config.
        device: the device the models compute on (it decides the attention kernel).
        load_device: where they are loaded (default ``device``): a Ray rank loads on the CPU (rank 0) or the meta
            device (the others) and shards afterwards.
        with_reference: build a separate reference (a LoRA policy's never needs one).
        lora_state: the LoRA adapters' initial weights (every rank starts from the driver's).
        gradient_checkpointing: ``actor.gradient_checkpointing`` on the policy (FSDP2 applies its own on a rank).
        tokenizer: the actor's tokenizer if loaded already.
    Raises:
        ConfigError: a bad model directory, a refused combination, tokenizers that differ (naming the keys).
    """
    load_device = device if load_device is None else load_device
    if device.type == "cpu" and cfg.actor.dtype == "float16":
        raise ConfigError(
            "actor.dtype=float16 does not train on a CPU (half-precision sampling overflows); use float32 or bfloat16"
        )
    trc, lora = cfg.actor.trust_remote_code, cfg.actor.lora.rank > 0
    actor_path = resolve_model_path(cfg.actor.model, "actor.model", task=cfg.data.embedded_task)
    tok = tokenizer or load_tokenizer(actor_path, trust_remote_code=trc, key="actor.model")
    paths = {"actor.model": actor_path}
    ref_path = actor_path
    if lora:
        check_lora_reference(cfg)
    elif cfg.ref.model:
        ref_path = resolve_model_path(cfg.ref.model, "ref.model", task=cfg.data.embedded_task)
        if ref_path != actor_path:
            check_same_tokenizer(tok, ref_path, "ref.model", trust_remote_code=trc)
            paths["ref.model"] = ref_path
    attn = attention.for_config(cfg, device)
    model = attention.set_attn_implementation(_load_lm(cfg, actor_path, load_device), attn)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ref_model = None
    if lora:
        with torch.device("meta") if load_device.type == "meta" else contextlib.nullcontext():
            model = apply_lora(model, cfg.actor.lora)
        if lora_state is not None and load_device.type != "meta":
            set_peft_model_state_dict(model, lora_state)
    elif with_reference:
        if ref_path == actor_path:
            ref_model = copy.deepcopy(model)
        else:
            ref_model = attention.set_attn_implementation(_load_lm(cfg, ref_path, load_device), attn)
        ref_model.requires_grad_(False)
        patch_lm_head(ref_model, fp32=head_fp32(cfg))  # patched after the deepcopy: each head keeps its own forward
    patch_lm_head(model, fp32=head_fp32(cfg))
    return PolicyModels(model, ref_model, lora, tok, paths)


def critic_path(cfg: TetherConfig, tokenizer) -> Path:
    """``critic.model`` (default: the actor's initial model), its tokenizer checked against the actor's.

    Raises:
        ConfigError: a bad directory, or another tokenizer (naming ``critic.model``).
    """
    actor_path = resolve_model_path(cfg.actor.model, "actor.model", task=cfg.data.embedded_task)
    path = (
        resolve_model_path(cfg.critic.model, "critic.model", task=cfg.data.embedded_task)
        if cfg.critic.model
        else actor_path
    )
    if path != actor_path:
        check_same_tokenizer(tokenizer, path, "critic.model", trust_remote_code=cfg.actor.trust_remote_code)
    return path


def assemble_critic(
    cfg: TetherConfig, device: torch.device, *, tokenizer, load_device: torch.device | None = None
) -> ValueModel:
    """The critic by the same recipe: its backbone (``critic.model``, tokenizer checked) with a value head, its
    attention set as the actor's; on the meta device its architecture only (a Ray rank other than 0)."""
    load_device = device if load_device is None else load_device
    trc, dtype = cfg.actor.trust_remote_code, cfg.actor.dtype
    path = critic_path(cfg, tokenizer)
    if load_device.type == "meta":
        with torch.device("meta"):
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=trc)
            backbone = AutoModel.from_config(config, dtype=DTYPES[dtype], trust_remote_code=trc)
            vm = ValueModel(backbone, config.hidden_size).to(DTYPES[dtype])
    else:
        vm = ValueModel.from_pretrained(path, dtype=dtype, trust_remote_code=trc).to(load_device)
    attention.set_attn_implementation(vm.backbone, attention.for_config(cfg, device))
    return vm


def top_k_vocab_note(cfg: TetherConfig, tokenizer) -> str | None:
    """One line when ``distill.top_k`` is at least the vocabulary size (``len(tokenizer)``): the top k is then every
    token, the full divergence (as ``distill.top_k=null``), not a truncation; None otherwise."""
    k, vocab = cfg.distill.top_k, len(tokenizer)
    if cfg.distill.teacher is None or k is None or k < vocab:
        return None
    return (
        f"distill.top_k={k} is at least the vocabulary's {vocab} tokens: it is the full vocabulary, as "
        "distill.top_k=null"
    )


def teacher_path(cfg: TetherConfig, tokenizer) -> Path | None:
    """``distill.teacher``'s directory, its tokenizer checked against the actor's (vocabulary, special tokens, EOS
    ids) before any weights load; None when distillation is off.

    Raises:
        ConfigError: one line naming ``distill.teacher``: a missing directory or another tokenizer.
    """
    if note := top_k_vocab_note(cfg, tokenizer):
        log.warning(note)
    if cfg.distill.teacher in (None, EXACT_TEACHER):  # exact: a lookup table of the shipped reference's π*_β
        return None
    actor_path = resolve_model_path(cfg.actor.model, "actor.model", task=cfg.data.embedded_task)
    path = resolve_model_path(cfg.distill.teacher, "distill.teacher", task=cfg.data.embedded_task)
    if path != actor_path:
        check_same_tokenizer(
            tokenizer,
            path,
            "distill.teacher",
            trust_remote_code=cfg.actor.trust_remote_code,
            actor_path=actor_path,
            who="the teacher",
        )
    return path


def exact_teacher(cfg: TetherConfig) -> torch.nn.Module:
    """``distill.teacher=exact``: π*_β of the embedded task's own reward (β = ``distill.teacher_beta``, else
    ``kl.coef``) over every response of up to ``rollout.max_new_tokens`` tokens, for each distinct prompt of the run's
    train and val data, as a frozen :class:`~tether.tasks.exact_teacher.LookupLM` (``tether.tasks.exact_teacher``).
    It enumerates the shipped reference once per prompt (about 0.2 s each)."""
    train, val = load_prompt_rows(cfg.data, cfg.trainer.seed)
    prompts = list(dict.fromkeys(r.prompt for r in train + val))
    reference, tok = load_reference()
    beta = exact_teacher_beta(cfg)
    teacher = ExactTeacher(
        reference,
        tok,
        prompts,
        beta,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        reward_fn=embedded_task(cfg.data.embedded_task).compute_score,
    )
    log.info(
        "distill.teacher=exact: π*_β of data.embedded_task=%s's reward at β=%g over %d prompts (%d states)",
        cfg.data.embedded_task,
        beta,
        len(prompts),
        len(teacher.table),
    )
    return teacher.model()


def assemble_teacher(
    cfg: TetherConfig, device: torch.device, path: Path, *, load_device: torch.device | None = None
) -> torch.nn.Module:
    """The frozen teacher by the reference's recipe: loaded from ``path`` (``actor.dtype``) onto ``load_device``
    (default ``device``; a Ray rank other than 0: the meta device, its architecture only, sharded and filled from
    rank 0 afterwards), attention as the actor's on ``device``, no LoRA, no gradients, the LM-head patch
    (``actor.lm_head_fp32``). Its role is :func:`reference_worker` over it."""
    load_device = device if load_device is None else load_device
    model = attention.set_attn_implementation(_load_lm(cfg, path, load_device), attention.for_config(cfg, device))
    model.requires_grad_(False)
    patch_lm_head(model, fp32=head_fp32(cfg))
    return model


# ---------------------------------------------------------------------------- this process's share of a run
@dataclass
class DriverShare:
    """What this process holds of a run: all of it under ``trainer.backend=local``; under ``ray`` the tokenizer, a
    copy of the policy (generation, validation), a reference only for exact/* validation (:func:`driver_holds_ref`),
    no critic, the reward and the resolved rollout engine's name (the placement then builds the rest)."""

    tokenizer: Any
    device: torch.device
    actor: ActorWorker
    ref: ReferenceWorker | None
    critic: CriticWorker | None
    actor_path: Path
    model_paths: dict[str, Path]
    engine_name: str
    reward: Any
    val_reward: Any
    gold: Any
    teacher: ReferenceWorker | None = None
    agent: AgentSpec | None = None

    @property
    def eos_token_ids(self) -> list[int]:
        return generation_eos_ids(self.actor.model_as_is)


def resolve_engine(cfg: TetherConfig, actor_path) -> str:
    """``rollout.engine`` resolved (:func:`tether.rollout.registry.resolve`), and a named engine checked
    (:func:`tether.rollout.registry.check_usable`): before any model loads.

    Raises:
        ConfigError: the named engine cannot run here (vLLM not installed, a head size its CPU kernels lack, ...).
    """
    name, why = registry.resolve(
        cfg.rollout.engine,
        actor_path,
        on_ray=cfg.trainer.backend == "ray",
        async_steps=cfg.rollout.async_steps,
        agent=cfg.agent.enabled,
        value=cfg.actor.model,
    )
    if engines.chosen(cfg) is None:
        log.info("rollout.engine=auto: %s (%s)", name, why)
    else:
        registry.check_usable(name, actor_path, value=cfg.actor.model)
    return name


def build_driver_share(cfg: TetherConfig) -> DriverShare:
    """Load this process's rewards (first: a bad reward function fails before any model loads) and its models once
    (:func:`assemble_policy`, :func:`assemble_critic`).

    Raises:
        ConfigError: a bad model directory, tokenizers that differ, an engine that cannot run, a refused
            combination (naming the keys), before the first model loads where it can be.
    """
    device = pick_device(cfg.trainer.device)
    actor_path = resolve_model_path(cfg.actor.model, "actor.model", task=cfg.data.embedded_task)
    engine_name = resolve_engine(cfg, actor_path)  # no vllm, or a head size its kernels refuse: before any model loads
    # a missing file or a bad signature of reward.function / reward.val_function: before any model loads
    reward, val_reward = build_reward(cfg, device)
    agent = build_agent(cfg.agent)  # agent.tools / agent.environment imported and their signatures read: before weights
    gold = build_gold(cfg, device)
    local = cfg.trainer.backend == "local"
    tok = load_tokenizer(actor_path, trust_remote_code=cfg.actor.trust_remote_code, key="actor.model")
    check_observations(cfg, agent, tok)  # observations the tokenizer cannot encode: refused before weights load
    teacher_dir = teacher_path(cfg, tok)  # a missing teacher or another tokenizer: before any model loads
    models = assemble_policy(
        cfg,
        device,
        with_reference=driver_holds_ref(cfg),
        gradient_checkpointing=cfg.actor.gradient_checkpointing,
        tokenizer=tok,
    )
    attn = attention.for_config(cfg, device)
    log.info(
        "actor.attn_implementation=%s: %s",
        cfg.actor.attn_implementation,
        attn or "the model's own (config.json's, else sdpa)",
    )
    if models.lora:
        ref = reference_worker(cfg, adapter_host=models.policy)
    else:
        ref = reference_worker(cfg, models.reference) if models.reference is not None else None
    actor = actor_worker(cfg, models.policy)
    critic, paths = None, dict(models.paths)
    if cfg.algo.adv_estimator == "gae":
        path = critic_path(cfg, models.tokenizer)
        if path != actor_path:
            paths["critic.model"] = path
        if local:
            critic = critic_worker(cfg, assemble_critic(cfg, device, tokenizer=models.tokenizer))
        else:  # the critic lives on the workers only; the RNG advances as it would here
            hidden = AutoConfig.from_pretrained(str(path), trust_remote_code=cfg.actor.trust_remote_code).hidden_size
            ValueModel.make_head(hidden)
    teacher = None
    if cfg.distill.teacher == EXACT_TEACHER:  # a lookup table: no prompt sharing (it has no KV cache)
        teacher = reference_worker(cfg, exact_teacher(cfg), share_prompt_prefix=False)
    if teacher_dir is not None:  # distill.teacher: under trainer.backend=ray the actor group's ranks hold it
        paths["distill.teacher"] = teacher_dir
        if local:
            teacher = reference_worker(cfg, assemble_teacher(cfg, device, teacher_dir))
    return DriverShare(
        models.tokenizer,
        device,
        actor,
        ref,
        critic,
        actor_path,
        paths,
        engine_name,
        reward,
        val_reward,
        gold,
        teacher,
        agent,
    )


def build_engine(
    cfg: TetherConfig, model, tok, model_path, *, name: str | None = None, on_ray: bool = False
) -> GenerationEngine:
    """The rollout engine in this process over the policy ``model`` (``name``, else ``rollout.engine`` resolved as
    on the local backend, or as under Ray with ``on_ray``).

    Raises:
        ConfigError: the engine cannot run here.
    """
    if name is None:
        name, _ = registry.resolve(
            cfg.rollout.engine, model_path, on_ray=on_ray, async_steps=cfg.rollout.async_steps, agent=cfg.agent.enabled
        )
    return registry.build_engine(
        name, cfg, model=model, tokenizer=tok, model_path=model_path, eos_token_ids=generation_eos_ids(model)
    )


def check_observations(cfg: TetherConfig, agent: AgentSpec | None, tok) -> None:
    """With the agent on and a tokenizer without a chat template, an observation (written in the plain wrapper,
    docs/agents.md) must encode: else every trajectory would fail at its first observation and be dropped.

    Raises:
        ConfigError: one line naming the agent key, the tokenizer's problem and what to do.
    """
    if agent is None or not (problem := plain_observation_problem(tok)):
        return
    a = cfg.agent
    key, value = (
        ("agent.tools", a.tools)
        if a.tools
        else ("agent.environment", a.environment)
        if a.environment
        else ("agent.environments", a.environments)
    )
    raise ConfigError(
        f"{key}={value}: the tokenizer of actor.model={cfg.actor.model} has no chat template and cannot encode an "
        f"observation ({problem}); use a model whose tokenizer has a chat template (or encodes the plain "
        "'<observation>' wrapper); the embedded multi-turn task (data.embedded_task=digitsum_tool) runs its own "
        "environment"
    )


def build_runner(cfg: TetherConfig, share: DriverShare, engine: GenerationEngine | None = None) -> RolloutRunner:
    """The rollout role, whole: ``engine`` (vLLM replicas, built by the placement) or the resolved engine built here
    over this process's policy, the run's sampling settings (with the sampled tokens' log-probs where they are
    used: :func:`tether.rollout.registry.wants_logprobs`), ``rollout.mode`` and the model's EOS ids; with
    ``agent.tools`` / ``agent.environment`` an :class:`~tether.rollout.agent.AgentRunner` (multi-turn)."""
    if engine is None:
        engine = build_engine(cfg, share.actor.model, share.tokenizer, share.actor_path, name=share.engine_name)
    params = replace(registry.sampling_params(cfg), logprobs=registry.wants_logprobs(cfg, engine))
    if share.agent is not None:  # agent.tools / agent.environment: the multi-turn loop (docs/agents.md)
        return AgentRunner(
            engine, share.tokenizer, share.device, params=params, agent=share.agent, eos_token_ids=share.eos_token_ids
        )
    return RolloutRunner(
        engine, share.tokenizer, share.device, params=params, mode=cfg.rollout.mode, eos_token_ids=share.eos_token_ids
    )


def build_local_roles(cfg: TetherConfig) -> Roles:
    """Every role of a run in this process (:class:`~tether.workers.roles.LocalPlacement`).

    Raises:
        ConfigError: a bad model directory, tokenizers that differ, a refused combination (naming the keys).
    """
    share = build_driver_share(cfg)
    return Roles(
        share.tokenizer,
        share.actor,
        share.ref,
        share.critic,
        build_runner(cfg, share),
        share.reward,
        share.device,
        share.actor_path,
        share.val_reward,
        model_paths=share.model_paths,
        gold=share.gold,
        teacher=share.teacher,
    )


def build_reward(cfg: TetherConfig, device) -> tuple[Any, Any]:
    """(the training reward, validation's reward or None): a dataset's stored scores (``rollout.mode=offline`` with
    ``data.score_key`` and no reward function or model), validation then scoring by data source; else a
    :class:`~tether.rewards.RewardManager` of ``reward.function`` / ``reward.model`` / the built-in rewards."""
    if cfg.rollout.mode == "offline" and cfg.data.score_key and not (cfg.reward.function or cfg.reward.model):
        return OfflineScores(), RewardManager(clip=cfg.reward.clip, timeout_s=cfg.reward.timeout_s)
    reward_model = (
        str(resolve_model_path(cfg.reward.model, "reward.model", task=cfg.data.embedded_task))
        if cfg.reward.model
        else None
    )
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
    model = (
        str(resolve_model_path(cfg.reward.val_model, "reward.val_model", task=cfg.data.embedded_task))
        if cfg.reward.val_model
        else None
    )
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


def check_same_tokenizer(
    actor_tok,
    path,
    key: str,
    *,
    trust_remote_code: bool = False,
    actor_path=None,
    who: str = "the reference and critic",
) -> None:
    """The reference, the critic and the teacher read the actor's token ids: their tokenizer must be the actor's.
    Reads tokenizer files and ``generation_config.json`` / ``config.json`` only, never weights.

    Args:
        actor_tok: the actor's tokenizer.
        path: the other model's directory.
        key: its config key, named in the error.
        actor_path: the actor's directory; given, the special tokens (name → token and id) and the EOS ids (the
            tokenizer's and the generation config's, :func:`directory_eos_ids`) must match too (``distill.teacher``:
            a teacher that ends responses on another token scores every EOS the student samples as unlikely).
        who: the models that must share it, for the message.
    Raises:
        ConfigError: one line naming ``key`` when the vocabularies differ (a KL between models that number
            tokens differently would be meaningless, and a smaller vocabulary would index out of range), or, with
            ``actor_path``, the special tokens or EOS ids.
    """
    other = load_tokenizer(path, trust_remote_code=trust_remote_code, key=key)
    a, b = actor_tok.get_vocab(), other.get_vocab()
    if a != b:
        diff = sum(1 for t, i in a.items() if b.get(t) != i)
        raise ConfigError(
            f"{key}={str(path)!r} has a different tokenizer from actor.model (vocabulary {len(b)} vs {len(a)} tokens, "
            f"{diff} of the actor's tokens numbered differently); {who} must share the actor's tokenizer"
        )
    if actor_path is None:
        return
    mine, theirs = _special_tokens(actor_tok), _special_tokens(other)
    if mine != theirs:
        diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        shown = ", ".join(f"{k}: {theirs.get(k)} vs {mine.get(k)}" for k in diff)
        raise ConfigError(
            f"{key}={str(path)!r} has other special tokens than actor.model ({shown}); {who} must share the actor's "
            "tokenizer"
        )
    mine_eos, theirs_eos = directory_eos_ids(actor_path, actor_tok), directory_eos_ids(path, other)
    if mine_eos != theirs_eos:
        raise ConfigError(
            f"{key}={str(path)!r} ends responses on EOS ids {sorted(theirs_eos)}, actor.model on {sorted(mine_eos)} "
            f"(tokenizer and generation_config.json); {who} must share the actor's EOS"
        )


def _special_tokens(tok) -> dict[str, tuple[str, int]]:
    """A tokenizer's special tokens: {name (bos_token, eos_token, ...): (token, id)}."""
    return {
        name: (str(token), int(tok.convert_tokens_to_ids(str(token))))
        for name, token in tok.special_tokens_map.items()
        if isinstance(token, str)
    }


def directory_eos_ids(path, tok) -> set[int]:
    """The EOS ids a model directory ends responses on: its tokenizer's, and ``generation_config.json``'s (else
    ``config.json``'s) ``eos_token_id`` (an int or a list). Reads the JSON files only."""
    ids = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                ids |= {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
                break
    return ids


def generation_eos_ids(model) -> list[int]:
    """The EOS ids of a model's ``generation_config`` (an int or a list; [] when unset)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
