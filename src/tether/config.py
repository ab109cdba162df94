"""Typed configuration: one frozen section per component, YAML files, dotted command-line overrides.

A config is a :class:`TetherConfig` with the sections ``actor``, ``ref``, ``critic``, ``rollout``,
``reward``, ``data``, ``kl``, ``algo``, ``trainer``, ``guard``, ``distill`` and ``agent``. Every field carries a
one-line description (shown by ``tether train --help-config``). Unknown keys are errors with a did-you-mean,
values are validated before any model is loaded, and every key is read somewhere.

Overrides follow the verl / Hydra convention: ``kl.coef=0.1 rollout.n=4 kl.schedule.stages=[[50,0.08],[0,0.03]]``.
The right-hand side is parsed as YAML, so numbers, booleans, lists and ``null`` work as expected.
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from tether.algos import DISTILL_ESTIMATORS, FULL_DISTILL_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSS_AGG
from tether.engines import AUTO, ENGINES, check_engines, chosen, engine_names, section_fields
from tether.rewards.registry import GOLD_FUNCTIONS
from tether.sections import ConfigError, Section
from tether.tasks import EMBEDDED_TASKS, embedded_task

EMBEDDED = "embedded"
#: ``distill.teacher``'s value for the embedded task's exact optimum π*_β (tether.tasks.exact_teacher)
EXACT_TEACHER = "exact"
#: ``rollout.engine``'s values: auto and the registered engines (tether.engines)
EngineName = Literal[engine_names()]


class LoraConfig(Section):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 trains all weights, >0 trains peft LoRA adapters.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scaling = alpha / rank).")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: str | list[str] = Field("all-linear", description="Modules that get adapters (peft syntax).")


class ActorConfig(Section):
    model: str = Field(
        EMBEDDED,
        description="Policy to train: a local Hugging Face model directory, or 'embedded' for the tiny digit-sum "
        "reference.",
    )
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate of the actor.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warm-up, in training steps.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm of the actor (clip_grad_norm_).")
    micro_batch_size: int = Field(
        64, ge=1, description="Responses per forward/backward; gradient accumulation over a mini-batch."
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Size the actor's and reference's micro-batches by tokens instead of micro_batch_size (verl's "
        "dynamic batch size): rows sorted by length, grouped while rows x (longest prompt + longest response) (or, "
        "with padding_free, the valid tokens) stay within this budget; a longer row runs alone. null = "
        "micro_batch_size rows. The loss is the same.",
    )
    padding_free: bool = Field(
        False,
        description="Pack the valid tokens of several sequences into each row of the actor's and reference's forwards "
        "(position ids restart per sequence, attention stays within it; verl's use_remove_padding): no compute on "
        "padding. Needs transformers >= 4.56; not with actor.tp_size > 1.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype of actor, reference and critic."
    )
    trust_remote_code: bool = Field(
        False, description="Allow custom model code from the model directory (off unless you trust it)."
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory in the actor's backward pass.")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Autocast dtype of the actor's, reference's and rollout's forward passes; parameters, gradients "
        "and optimizer stay in actor.dtype (fp32 master weights), the LM head, log-softmax, KL and losses in fp32.",
    )
    lm_head_fp32: bool = Field(
        True,
        description="Under actor.compute_dtype=bfloat16, run the LM head in fp32 (its input cast up; TRL's "
        "cast_lm_head_to_fp32), so logits, log-probs and KL keep fp32 precision; false runs it in bf16 under autocast "
        "like the other matmuls (TRL's default): -12% of the 5.2M bench model's bf16 step (a 2000-token vocabulary), "
        "token log-prob error against fp32 1.4e-3 instead of 1.1e-3 nats "
        "(docs/performance.md#bf16-and-the-kl-metrics). No effect in float32.",
    )
    attn_implementation: str = Field(
        "auto",
        description="Attention kernel of the actor, reference and critic (transformers' attn_implementation; the run "
        "logs its choice). auto = 'tether' on CPU when actor.dtype, actor.compute_dtype or trainer.fsdp.param_dtype is "
        "bfloat16 (or float16) (matmul attention for one-token decode queries and up to 128 keys, 1.1-6x faster than "
        "PyTorch's CPU flash kernel in bf16; sdpa itself, bit for bit, for everything else), else the model's own "
        "(sdpa); model = the model's own; any other name (sdpa, eager, flash_attention_2, ...) is given to "
        "transformers as is (docs/performance.md#attention-actorattn_implementation).",
    )
    reuse_update_logprobs: bool = Field(
        True,
        description="With one PPO epoch and one mini-batch per step, old_logprobs and entropy come from the update's "
        "own forward, detached (ratio exactly 1), not a separate pass; only where nothing needs them before the update "
        "(kl.placement loss/none, kl.estimator not full, no critic, guard.on_max_kl=raise_coef, no dropout in the "
        "actor, algo.top_entropy_quantile=1).",
    )
    old_logprobs_source: Literal["recompute", "rollout"] = Field(
        "recompute",
        description="Where old_logprobs (π_old in the PPO ratio and the KL to the reference) come from: recompute = "
        "the actor's own forward (a no-grad pass, or the update's with actor.reuse_update_logprobs); rollout = the "
        "rollout engine's log-probs of the sampled tokens (vLLM's processed_logprobs, HF generate's own passes), no "
        "actor pass, so the ratio also corrects the engine-trainer mismatch (rollout/logprob_diff_*, "
        "docs/performance.md); policy/entropy is then not measured (NaN).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (peft).")
    share_prompt_prefix: bool = Field(
        True,
        description="Run each distinct prompt of a micro-batch once (a GRPO group's rollout.n responses share one) and "
        "only the response tokens per row, attending to the prompt's expanded KV cache, in the actor's and reference's "
        "log-prob passes and the update (gradients sum over the group). Equal to the ordinary pass up to float "
        "round-off (1e-5 in fp32), and the actor's and reference's passes are bitwise equal when their weights are, so "
        "the KL at π = π_ref is exactly 0 (docs/training.md). Falls back to the ordinary pass where no prompt repeats, "
        "under gradient checkpointing (update only), with sliding-window models, and in Ray worker groups of more than "
        "one rank (FSDP2 needs the same forward calls on every rank) (docs/training.md). Composes with "
        "max_tokens_per_micro_batch (prompts are shared within each token-budget micro-batch). Left unset, it is off "
        "where actor.padding_free or, with a critic, critic.padding_free is on (packed rows hold whole sequences); set "
        "true, that is refused.",
    )
    tp_size: int = Field(
        1,
        ge=1,
        description="trainer.backend=ray: tensor-parallel degree of the worker groups (actor, reference and critic): "
        "each group's ranks form a (dp = ranks / tp_size) x tp_size mesh; attention/MLP projections split "
        "column/row-wise, embedding and LM head over the vocabulary (docs/distributed.md#tensor-parallelism). 1 = "
        "FSDP2 only.",
    )


class RefConfig(Section):
    model: str | None = Field(None, description="Frozen reference policy directory; null = the actor's initial model.")
    reset_every: int = Field(
        0, ge=0, description="Copy the current policy into the reference every N steps (0 = never)."
    )


class DistillConfig(Section):
    teacher: str | None = Field(
        None,
        description="On-policy distillation: the frozen teacher's model directory (it must share the actor's "
        "tokenizer: vocabulary, special tokens, EOS ids); null = off. Adds -distill.coef * KL(π ‖ π_teacher), the "
        "reverse KL (student first), to the objective (docs/distillation.md). 'exact' = on the embedded task, the "
        "exact optimum π*_β ∝ π_ref·exp(r/β) of the task's own reward at β = distill.teacher_beta, enumerated over "
        "responses of up to rollout.max_new_tokens tokens and served token by token (docs/distillation.md#exact). "
        "Placed as the reference: in this process (trainer.backend=local) or sharded on the actor group's ranks (ray; "
        "'exact' stays in the driver, k1 only).",
    )
    teacher_beta: float | None = Field(
        None,
        gt=0,
        description="distill.teacher=exact: β > 0 of the teacher π*_β ∝ π_ref·exp(r/β) (r: the embedded task's own "
        "reward, whatever reward.function is); null = kl.coef (refused when that is 0).",
    )
    coef: float = Field(
        1.0,
        ge=0,
        description="λ: the weight of KL(π ‖ π_teacher) in the objective E[r] - β·KL(π‖π_ref) - λ·KL(π‖π_teacher); "
        "λ times the estimator is subtracted from each response token's reward. Pure distillation: λ > 0 with the "
        "task reward off or 0.",
    )
    estimator: Literal[DISTILL_ESTIMATORS] = Field(
        "k1",
        description="The divergence to the teacher and how it is estimated. k1 = log π_old(a_t) - log π_teacher(a_t) "
        "at the sampled token, a reward (unbiased for KL(π_old ‖ π_teacher) per state under π_old's samples; one "
        "teacher forward per batch). From both models' logits at each visited state, exactly: reverse = "
        "KL(π ‖ π_teacher), forward = KL(π_teacher ‖ π), jsd = GKD's generalised JSD (distill.jsd_beta); each as a "
        "loss term (gradient through the per-state divergence) plus the detached divergence as a reward (the states' "
        "visitation), together the exact gradient of E_{y~π}[Σ_t f(π(·|s_t), π_teacher(·|s_t))] on-policy; one more "
        "teacher forward per micro-batch of the update (docs/distillation.md).",
    )
    jsd_beta: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="distill.estimator=jsd: b in (0, 1), the teacher's weight in the mixture m = b·π_teacher + "
        "(1-b)·π; JSD_b = b·KL(π_teacher ‖ m) + (1-b)·KL(π ‖ m) (Agarwal et al. 2024). b → 0 approaches "
        "b·KL(π_teacher ‖ π) (forward), b → 1 approaches (1-b)·KL(π ‖ π_teacher) (reverse).",
    )
    top_k: int | None = Field(
        None,
        ge=1,
        description="distill.estimator=reverse|forward|jsd: sum over the teacher's k ≥ 2 most likely tokens at each "
        "state only, both distributions renormalised over them (k = 1 is refused: its divergence is 0); null = the "
        "full vocabulary; k ≥ the vocabulary is the full vocabulary (one warning at startup). Biased: it ignores the "
        "student's mass outside the k tokens and the teacher's tail (docs/distillation.md#top-k).",
    )


class CriticConfig(Section):
    model: str | None = Field(
        None,
        description="Critic backbone directory; null = the actor's initial model. Used by algo.adv_estimator=gae only.",
    )
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the critic.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm of the critic.")
    micro_batch_size: int = Field(64, ge=1, description="Responses per critic forward/backward.")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Size the critic's micro-batches by tokens instead of micro_batch_size (as "
        "actor.max_tokens_per_micro_batch).",
    )
    padding_free: bool = Field(
        False, description="Pack the critic's sequences into rows without padding (as actor.padding_free)."
    )
    value_clip: float = Field(0.5, gt=0, description="Clip range of the clipped value loss (PPO2 style).")
    warmup_steps: int = Field(0, ge=0, description="Steps during which only the critic is trained.")


class RolloutConfig(Section):
    engine: EngineName = Field(
        AUTO,
        description="Generation engine (tether.engines): auto = the first of its engines that is installed, usable and "
        "supports the model (vLLM where it runs the model under trainer.backend=local without rollout.async_steps; the "
        "embedded model's head size 16 is not one vLLM's CPU kernels take), else hf; "
        + "; ".join(f"{e.name} = {e.summary}" for e in ENGINES.values())
        + ". A named engine that cannot run is an error. docs/performance.md#generation-hf-generate-against-vllm.",
    )
    mode: Literal["online", "offline"] = Field(
        "online", description="online: sample responses; offline: use the dataset's responses."
    )
    n: int = Field(8, ge=1, description="Responses sampled per prompt (the GRPO/RLOO group size).")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; log-probs, entropy and KL use the same temperature."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    max_new_tokens: int = Field(4, ge=1, description="Maximum response length, tokens.")
    do_sample: bool = Field(True, description="Sample (true) or decode greedily (false).")
    share_prefill: bool = Field(
        True,
        description="HF engine: prefill each distinct prompt once and copy its KV cache to the rows that repeat it "
        "(the rollout.n samples of a prompt), instead of once per row. Same sampled tokens in the tests; the cache is "
        "computed in a smaller batch, so its last bits may differ (<= 4e-6 nats in the sampled log-probs measured).",
    )
    hf_decode: Literal["tether", "generate"] = Field(
        "tether",
        description="HF engine: tether = tether's own decode loop over a preallocated KV cache (the same tokens as "
        "generate for a fixed seed, bit for bit; measured -12% CPU on the 81k bench model, -17% on GSM8K-shaped "
        "prompts, unchanged on the 5.2M model's short prompts; calls it cannot serve exactly fall back to generate); "
        "generate = Hugging Face model.generate with its DynamicCache. docs/performance.md#hf-decode-loop.",
    )
    hf_drop_finished: bool = Field(
        True,
        description="HF engine, hf_decode=tether: stop running the model on rows that have ended (EOS), keeping at "
        "least 8, so a ragged batch does not step finished rows to the longest one's end (-29% CPU of a GSM8K-shaped "
        "batch; sdpa or tether attention only, ignored with another actor.attn_implementation). Sampling still draws "
        "for every row; the same tokens as without it in the tests and over 100 demo steps (bitwise), but a BLAS may "
        "round a smaller batch differently on other hardware (as vLLM's batches do): false keeps every row to the end.",
    )
    hf_sampler: Literal["multinomial", "inverse_cdf"] = Field(
        "multinomial",
        description="HF engine, hf_decode=tether: how a token is drawn from the processed distribution. multinomial = "
        "torch.multinomial, as generate (V exponential draws per row and step); inverse_cdf = one uniform per row and "
        "a search in the cumulative sum: the same distribution, a different random stream (other samples for a seed).",
    )
    engine_temperature: float | None = Field(
        None,
        gt=0,
        description="The engine samples at this temperature (and reports its log-probs at it) while the trainer's "
        "log-probs, ratio and KL stay at rollout.temperature: a known engine-trainer mismatch for stability "
        "experiments (docs/stability.md); null = rollout.temperature. Refused with rollout.do_sample=false (greedy "
        "decoding ignores the temperature).",
    )
    compute_dtype: Literal["float32", "bfloat16"] | None = Field(
        None,
        description="HF engine: the dtype generation runs in (autocast), e.g. bfloat16 beside an fp32 trainer as vLLM "
        "samples in bf16 (the engine-trainer mismatch algo.rollout_correction corrects, docs/stability.md); null = "
        "actor.compute_dtype.",
    )
    async_steps: int = Field(
        0,
        ge=0,
        le=4,
        description="k = 1..4: off-policy overlap: batches are generated k steps ahead (on a snapshot of the policy, "
        "in a background thread; under trainer.backend=ray on the driver while the workers train), the next one during "
        "each step's update, so each batch is k updates stale and its old_logprobs are the generating policy's (the "
        "PPO ratio corrects the staleness, algo.rollout_correction the engine). 0 = generate, then train "
        "(docs/training.md, docs/stability.md).",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="rollout.async_steps > 0: the most updates a batch may be behind the policy that trains on it "
        "(rollout/staleness); null = async_steps. A bound below async_steps: see rollout.staleness_policy; above it, "
        "or set with async_steps=0, it would do nothing and is refused.",
    )
    staleness_policy: Literal["drop", "wait"] = Field(
        "drop",
        description="A batch past rollout.max_staleness: drop = regenerate it at its step from the current weights "
        "(same prompts; rollout/stale_dropped; from step max_staleness + 2 on that is every batch, said at start), "
        "wait = never generate more than max_staleness steps ahead (as AReaL's bounded staleness). Acts only with "
        "rollout.max_staleness below rollout.async_steps: wait is refused otherwise.",
    )


# one settings section per engine that has some (tether.engines: rollout.vllm, ...), owned by its registry entry
RolloutConfig = create_model("RolloutConfig", __base__=RolloutConfig, __module__=__name__, **section_fields())


class RewardConfig(Section):
    function: str | None = Field(
        None,
        description="Reward function 'path/file.py:name' or 'module:name': verl's per-sample "
        "compute_score(data_source, solution_str, ground_truth, extra_info=None) (called per sample, a number or "
        "{'score': x}) or a batch function of four lists (docs/rewards.md#your-own-reward-function); null = built-in "
        "by data_source.",
    )
    model: str | None = Field(
        None, description="Local AutoModelForSequenceClassification directory used as the reward model."
    )
    val_function: str | None = Field(
        None,
        description="Gold reward of validation: 'path/file.py:name' or 'module:name', a function like "
        "reward.function, scoring the same sampled validation responses (val/gold_mean, val/gold_gap; tether eval "
        "too). null = reward.val_model, else the data source's built-in gold (tether.rewards.GOLD_FUNCTIONS), else "
        "none (docs/rewards.md#gold-reward-for-validation).",
    )
    val_model: str | None = Field(
        None,
        description="Gold reward of validation: a local AutoModelForSequenceClassification directory, like "
        "reward.model (exclusive with reward.val_function); null = see reward.val_function.",
    )
    clip: tuple[float, float] | None = Field(
        None, description="Clip scores to [low, high] (a reward model defaults to [-2, 2])."
    )
    normalize: Literal["none", "batch", "running"] = Field("none", description="Score normalisation before advantages.")
    model_batch_size: int = Field(16, ge=1, description="Responses per reward-model forward pass.")
    timeout_s: float | None = Field(
        600.0,
        gt=0,
        description="Seconds a reward function may take per batch; past it the call is abandoned and its unscored "
        "samples count as errors. With a timeout the function runs in a worker thread: code that installs signal "
        "handlers (math_verify's own timeouts) needs null, which runs it on the main thread and waits forever. See "
        "docs/rewards.md.",
    )
    max_failed_steps: int = Field(
        3,
        ge=1,
        description="Stop the run (exit status 3, checkpoint written) after this many consecutive steps that trained "
        "nothing: every sample dropped (the reward raised, timed out, or gave NaN or non-numbers for all of them), or "
        "every token taken out of the loss (algo.mask_truncated, algo.rollout_correction.reject); a run that ends with "
        "every one of its steps so failed also stops with that error. See docs/rewards.md.",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=0,
        description="DAPO's soft overlong penalty: L_cache, the last tokens before rollout.max_new_tokens over which a "
        "training response's score is lowered linearly, from 0 at length max_new_tokens − L_cache to "
        "−reward.overlong_penalty at max_new_tokens (Yu et al. 2025 eq. 13; verl's overlong_buffer.len); added to the "
        "score after reward.clip and reward.normalize, before advantages. Must be < rollout.max_new_tokens. null or 0 "
        "= off (docs/training.md#truncation).",
    )
    overlong_penalty: float = Field(
        1.0,
        gt=0,
        description="reward.overlong_buffer: the penalty at the length limit, in score units (verl's "
        "overlong_buffer.penalty_factor, 1.0).",
    )

    @field_validator("clip")
    @classmethod
    def _clip_order(cls, v):
        if v is not None and not v[0] < v[1]:
            raise ValueError(f"reward.clip must be [low, high] with low < high, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _one_gold(self):
        if self.val_function and self.val_model:
            raise ValueError(
                f"reward.val_function={self.val_function!r} and reward.val_model={self.val_model!r} are both set: the "
                "gold reward of validation is one of them; unset one"
            )
        return self


class OfflineFilterConfig(Section):
    score_min: float | None = Field(
        None, description="rollout.mode=offline: drop rows whose score is below this (or missing); null = no bound."
    )
    score_max: float | None = Field(
        None, description="rollout.mode=offline: drop rows whose score is above this (or missing); null = no bound."
    )
    drop_empty: bool = Field(True, description="rollout.mode=offline: drop rows whose response is empty or whitespace.")
    drop_duplicates: bool = Field(
        False, description="rollout.mode=offline: drop repeated (prompt, response) pairs, keeping the first."
    )

    @model_validator(mode="after")
    def _range(self):
        if self.score_min is not None and self.score_max is not None and self.score_min > self.score_max:
            raise ValueError(
                f"data.filter.score_min ({self.score_min}) must not exceed data.filter.score_max ({self.score_max})"
            )
        return self


class DataConfig(Section):
    train_files: str = Field(
        EMBEDDED,
        description="Training prompts: .jsonl/.json/.parquet in verl's schema, or 'embedded' (digit-sum task).",
    )
    val_files: str | None = Field(
        None, description="Held-out prompts; null = the embedded val split, or a val_fraction split of train."
    )
    val_fraction: float = Field(
        0.0, ge=0, lt=1, description="Fraction of train held out for validation when val_files is null."
    )
    batch_size: int = Field(
        16, ge=1, description="Prompts per training step (responses per step = batch_size * rollout.n)."
    )
    max_prompt_length: int = Field(512, ge=1, description="Maximum prompt length, tokens.")
    skip_invalid: bool = Field(
        False,
        description="Malformed dataset rows: false = stop before training listing them; true = drop and count them.",
    )
    overlong_prompts: Literal["error", "drop"] = Field(
        "error", description="A prompt over max_prompt_length: stop before training (error) or drop it and count it."
    )
    max_dropped_frac: float = Field(
        0.5,
        ge=0,
        le=1,
        description="rollout.mode=offline with data.overlong_responses=drop: stop before training when more than this "
        "fraction of the rows would be dropped for not fitting rollout.max_new_tokens (a length limit that does not "
        "fit the data, not a few long rows).",
    )
    overlong_responses: Literal["truncate", "drop", "error"] = Field(
        "drop",
        description="rollout.mode=offline: a response longer than rollout.max_new_tokens (with its EOS) is cut there "
        "(truncate), dropped and counted (drop), or stops before training (error).",
    )
    filter: OfflineFilterConfig = Field(
        default_factory=OfflineFilterConfig,
        description="rollout.mode=offline: pre-filtering of the fixed pairs (counts logged at start).",
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded by trainer.seed).")
    prompt_key: str = Field("prompt", description="Column holding the prompt.")
    response_key: str | None = Field(None, description="Column holding a fixed response (rollout.mode=offline).")
    score_key: str | None = Field(None, description="Column holding a fixed reward for offline responses.")
    apply_chat_template: bool = Field(
        True, description="Render chat-message prompts with the tokenizer's chat template."
    )
    instruction_suffix: str = Field("", description="Text appended to every prompt's last user message.")
    embedded_task: Literal["digitsum", "digitsum_hack", "digitsum_tool"] = Field(
        "digitsum",
        description="data.train_files=embedded: digitsum (exact correctness), digitsum_hack (the same prompts "
        "trained on a flawed proxy reward that pays short answers a bonus, with exact correctness as the gold reward; "
        "docs/hacking.md), or digitsum_tool (multi-turn: the sum is hidden until a tool call reveals it; sets "
        "agent.environment and agent.max_turns=2 where unset; docs/task.md).",
    )
    embedded_train_size: int = Field(2000, ge=1, description="Prompts in the embedded task's train split.")
    embedded_val_size: int = Field(32, ge=1, description="Prompts in the embedded task's val split.")

    @model_validator(mode="after")
    def _embedded_task_used(self):
        if self.embedded_task != "digitsum" and self.train_files != EMBEDDED:
            raise ValueError(
                f"data.embedded_task={self.embedded_task} has no effect with data.train_files={self.train_files}: it "
                "picks the embedded task's reward and rows (data.train_files=embedded); leave it at digitsum"
            )
        return self


def _spec_file(key: str, spec: str) -> None:
    """A user-code spec (``path.py:name`` or ``module:name``) is well formed and, when it names a file, the file
    exists: checked here, before any model loads; importing it and reading its signature is
    :func:`tether.agents.build_agent`'s, also before weights load."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{key}={spec!r} must look like 'path/to/file.py:name' or 'module:name'")
    if (target.endswith(".py") or "/" in target or "\\" in target) and not Path(target).expanduser().is_file():
        raise ValueError(f"{key}={spec!r}: file {target!r} not found (relative paths are from the current directory)")


class AgentConfig(Section):
    tools: list[str] = Field(
        default_factory=list,
        description="Multi-turn tool use: tools as typed Python functions, each 'path/file.py:name' or "
        "'module:name' (like reward.function); the JSON schema comes from the signature and the Google-style "
        "docstring (docs/agents.md). Empty, with agent.environment null = single-turn (agent off).",
    )
    environment: str | None = Field(
        None,
        description="Multi-turn environment: a class or factory 'path/file.py:Name' or 'module:Name' called once per "
        "trajectory (with the row's extra_info.interaction_kwargs), with reset(row) and step(model_turn) -> "
        "StepResult (docs/agents.md). Exclusive with agent.tools; null = none.",
    )
    environments: dict[str, str] = Field(
        default_factory=dict,
        description="Environments a dataset row picks by name: {name: 'path/file.py:Name' or 'module:Name'}; a row's "
        "extra_info.environment names one, a row without it runs agent.environment (refused before training when "
        "that is null), an unknown name is refused before training naming the row (docs/agents.md). Exclusive with "
        "agent.tools; empty = none.",
    )
    max_turns: int = Field(4, ge=1, description="Agent on: the most model turns per trajectory.")
    max_observation_tokens: int | None = Field(
        256,
        ge=1,
        description="Agent on: the most tokens of content one observation (a turn's tool outputs together) adds; "
        "longer contents are cut; null = no limit.",
    )
    tool_timeout_s: float | None = Field(
        10.0,
        gt=0,
        description="Agent on: seconds one tool call may run; past it the call is abandoned and the model reads a "
        "timeout error (agent/tool_errors); null = no limit.",
    )
    step_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description="Agent on: seconds an environment's constructor and reset together, or one step, may run "
        "(agent.environment/environments; a tool set's calls have agent.tool_timeout_s each); past it the call is "
        "abandoned and the trajectory dropped (agent/env_errors); null = no limit.",
    )
    tool_format: Literal["auto", "qwen", "plain"] = Field(
        "auto",
        description="Agent on: how tool calls are written: qwen (<tool_call>{json}</tool_call> blocks of Qwen2.5/"
        "Qwen3 templates), plain (a line 'CALL name {json}'), auto (qwen when the chat template mentions "
        "<tool_call>, else plain).",
    )
    on_prefix_mismatch: Literal["error", "count", "split"] = Field(
        "error",
        description="Agent on: a turn's context that is not the chat template's tokens for the conversation so far "
        "stops the run naming the sample, turn and token (error), or is counted in agent/prefix_mismatch and trained "
        "on as sampled (count), or (split) closes the sample after the previous model turn and generates the turn "
        "from the template's rendering as a new sample (agent/prefix_splits), each trajectory then scored once, "
        "whole, and its outcome advantage shared by its pieces (docs/agents.md).",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None or bool(self.environments)

    @model_validator(mode="after")
    def _specs(self):
        env = "agent.environment" if self.environment is not None else "agent.environments" if self.environments else ""
        if self.tools and env:
            value = self.environment if self.environment is not None else self.environments
            raise ValueError(
                f"agent.tools={self.tools} and {env}={value!r} are both set: a trajectory runs one environment "
                "(tools make one); set one"
            )
        for i, spec in enumerate(self.tools):
            _spec_file(f"agent.tools[{i}]", spec)
        if self.environment is not None:
            _spec_file("agent.environment", self.environment)
        for name, spec in self.environments.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"agent.environments has the name {name!r}: names are non-empty strings")
            _spec_file(f"agent.environments.{name}", spec)
        if not self.enabled:
            set_here = sorted(
                k
                for k in self.model_fields_set - {"tools", "environment", "environments"}
                if getattr(self, k) != type(self).model_fields[k].default
            )
            if set_here:
                raise ValueError(
                    f"agent.{set_here[0]} has no effect without agent.tools or agent.environment (agent is off); "
                    "set one of them, or leave it unset"
                )
        return self


class ScheduleConfig(Section):
    kind: Literal["piecewise", "linear", "cosine"] = Field("piecewise", description="Shape of a scheduled β.")
    stages: list[tuple[int, float]] = Field(
        default_factory=lambda: [(50, 0.08), (0, 0.03)],
        description="piecewise: [[steps, β], ...]; the last stage holds forever.",
    )
    final_coef: float = Field(0.0, ge=0, description="linear/cosine: β at total_steps.")
    total_steps: int = Field(100, ge=1, description="linear/cosine: steps from kl.coef to final_coef.")


class KLConfig(Section):
    placement: Literal["reward", "loss", "both", "none"] = Field(
        "reward", description="Where β·KL enters: shaped token rewards, the actor loss, both, or nowhere."
    )
    estimator: str = Field(
        "k1",
        description="KL estimator: k1|kl, abs, k2|mse, k3|low_var_kl, full, or a straight-through variant k1+, k3+, "
        "...",
    )
    loss_estimator: str | None = Field(None, description="Estimator for the loss placement; null = kl.estimator.")
    loss_agg_mode: (
        Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
        | None
    ) = Field(
        None,
        description="Aggregation of the KL loss; null = algo.loss_agg_mode (or, when that is null, the policy loss's "
        "own).",
    )
    coef: float = Field(0.05, ge=0, description="β: the initial (or fixed) KL coefficient.")
    controller: Literal["fixed", "adaptive", "band", "exponential", "scheduled"] = Field(
        "fixed", description="How β changes over training."
    )
    target: float = Field(0.02, gt=0, description="adaptive/exponential: target KL, nats per token (kl/ref_mean).")
    horizon: int = Field(10000, gt=0, description="adaptive: horizon, in responses (Ziegler et al. 2019).")
    high: float = Field(0.1, gt=0, description="band: above this KL (nats/token) β is multiplied by up.")
    low: float = Field(0.01, ge=0, description="band: below this KL (nats/token) β is multiplied by down.")
    up: float = Field(1.2, gt=1, description="band: factor applied above kl.high.")
    down: float = Field(0.8, gt=0, lt=1, description="band: factor applied below kl.low.")
    lr: float = Field(0.1, gt=0, description="exponential: learning rate of log-space dual ascent on β.")
    beta_min: float | None = Field(None, ge=0, description="Lower bound on β for every controller.")
    beta_max: float | None = Field(None, ge=0, description="Upper bound on β for every controller.")
    schedule: ScheduleConfig = Field(
        default_factory=ScheduleConfig, description="scheduled controller: the β schedule."
    )
    log_ratio_clamp: float = Field(
        20.0,
        gt=0,
        description="Inside k3 only, |log π − log π_ref| is clamped to this before exp (verl's default); k1/abs/k2 and "
        "the `+` gradients use the exact log-ratio.",
    )
    value_clamp: float | None = Field(
        10.0,
        gt=0,
        description="k3 values are clamped to ±this (verl's default 10); a clamped token gets no gradient, which "
        "biases k3 where π_ref/π_θ > 13.6 or π_θ/π_ref > 6e4 (docs/api.md); null = no clamp, exact.",
    )
    off_policy_correction: Literal["ratio", "none"] = Field(
        "ratio",
        description="KL in the loss when the tokens were sampled by π_old ≠ π_θ (every mini-batch after the first, PPO "
        "epochs, async and engine-sampled batches): ratio = each token's term importance-weighted by π_θ/π_old "
        "(differentiable for k1/k3/abs, detached for k2 and the `+` variants; log-ratio clamped at kl.log_ratio_clamp "
        "like the policy ratio), so its expected gradient is ∇KL(π_θ‖π_ref) exactly for k1, k3, k2 and every `+` "
        "(on-policy too, where plain k3's is ∇KL(π_ref‖π_θ)); none = the plain estimator (verl's use_kl_loss). "
        "docs/training.md#kl-off-policy.",
    )
    loss_to_go: bool = Field(
        False,
        description="KL in the loss: add the KL-to-go term, each model token's score function times the detached KL "
        "of the later model tokens (across turns), so that the loss's expected gradient at θ = θ_old is that of the "
        "trajectory's KL(π_θ‖π_ref), not only of each token's own (Tang & Munos 2025). Zero in value. Needs "
        "kl.placement loss or both; exact with off_policy_correction=ratio, k2 or a `+` estimator, or full. "
        "docs/kl-regularization.md#kl-to-go.",
    )

    @field_validator("estimator", "loss_estimator")
    @classmethod
    def _known_estimator(cls, v):
        if v is None:
            return v

        if v not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {v!r}; valid: {', '.join(KL_ESTIMATORS)}")
        return v

    @model_validator(mode="after")
    def _band(self):
        if self.low >= self.high:
            raise ValueError(f"kl.low ({self.low}) must be below kl.high ({self.high})")
        if self.beta_min is not None and self.beta_max is not None and self.beta_min > self.beta_max:
            raise ValueError(f"kl.beta_min ({self.beta_min}) must not exceed kl.beta_max ({self.beta_max})")
        if self.loss_to_go and self.placement not in ("loss", "both"):
            raise ValueError(
                f"kl.loss_to_go=true adds a term to the KL loss, and kl.placement={self.placement} has none; set "
                "kl.placement=loss (or both), or kl.loss_to_go=false (KL in the reward carries the KL to go already)"
            )
        return self


class RolloutCorrectionConfig(Section):
    level: Literal["none", "token", "sequence", "geometric"] = Field(
        "none",
        description="Importance weight π_old/π_rollout for the engine-trainer gap, multiplying each token's policy "
        "loss and KL term: none = off; token = per token; sequence = the product of the token ratios over the response "
        "(exact sequence likelihood ratio); geometric = their geometric mean (length-normalised). Needs the engine's "
        "log-probs (HF and vLLM give them).",
    )
    mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="truncate = TIS, min(w, threshold); mask = MIS/IcePop, w where lower <= w <= threshold, else 0. "
        "With actor.old_logprobs_source=rollout (π_old = π_rollout) the weights are measured against π_θ per "
        "micro-batch and only mask applies (as 0/1): the PPO clip already bounds that ratio (verl's bypass mode); "
        "truncate then only measures (rollout_corr/*), said at start.",
    )
    threshold: float = Field(
        2.0,
        gt=0,
        description="Upper bound of the weight (verl's rollout_is_threshold); at least 1 under mode=truncate (below 1 "
        "it would cap every weight, about 1, and only shrink the loss).",
    )
    lower: float | None = Field(None, gt=0, description="mode=mask: lower bound of the weight; null = 1/threshold.")
    reject: Literal[
        "none",
        "token_k1",
        "token_k2",
        "token_k3",
        "seq_sum_k1",
        "seq_sum_k2",
        "seq_sum_k3",
        "seq_mean_k1",
        "seq_mean_k2",
        "seq_mean_k3",
        "seq_max_k2",
        "seq_max_k3",
    ] = Field(
        "none",
        description="Reject divergent samples from the loss (weight 0, out of the token counts) by an estimate of "
        "KL(π_rollout‖π_old) from the sampled tokens, k1 = log π_rollout/π_old, k2 = ½k1², k3: per token, or the "
        "sum/mean/max over a response (verl's rollout_rs names).",
    )
    reject_threshold: float | None = Field(
        None,
        gt=0,
        description="Rejection bound, nats (|k1| for the k1 criteria); required with reject. verl's k1 ratio bound T "
        "is log T here.",
    )
    batch_normalize: bool = Field(
        False,
        description="Divide the weights by their batch mean over kept tokens (token) or responses (sequence levels).",
    )

    @model_validator(mode="after")
    def _bounds(self):
        if self.reject != "none" and self.reject_threshold is None:
            raise ValueError(f"reject={self.reject} needs reject_threshold (nats), e.g. 0.5")
        if self.reject == "none" and self.reject_threshold is not None:
            raise ValueError(
                f"reject_threshold={self.reject_threshold} has no effect with reject=none: name a reject criterion or "
                "leave it null"
            )
        if self.lower is not None and self.lower > self.threshold:
            raise ValueError(f"lower ({self.lower}) must not exceed threshold ({self.threshold})")
        if self.level != "none" and self.mode == "mask" and self.lower is None and self.threshold < 1:
            raise ValueError(
                f"mode=mask with threshold={self.threshold} below 1 needs lower (<= threshold): the default "
                "1/threshold is above it"
            )
        if self.level != "none" and self.mode == "truncate" and self.threshold < 1:
            raise ValueError(
                f"threshold={self.threshold} below 1 with mode=truncate caps the weights at {self.threshold} (min(w, "
                f"{self.threshold}), and w is about 1): every token's loss is scaled down, a smaller learning rate "
                "rather than a correction; use a threshold >= 1 (verl's 2), or mode=mask with lower"
            )
        if self.lower is not None and (self.mode != "mask" or self.level == "none"):
            raise ValueError(
                f"lower={self.lower} is used by mode=mask with a level only: set level and mode=mask, or leave lower "
                "null"
            )
        if self.level == "none":  # the weight's own settings do nothing without a weight
            unused = [
                f"{k}={getattr(self, k)}"
                for k, default in (("mode", "truncate"), ("threshold", 2.0), ("batch_normalize", False))
                if getattr(self, k) != default
            ]
            if unused:
                raise ValueError(
                    f"{', '.join(unused)} has no effect with level=none (no importance weight): set level=token, "
                    "sequence or geometric, or leave them at their defaults"
                )
        return self

    @property
    def active(self) -> bool:
        """Whether anything is corrected (a level or a rejection criterion)."""
        return self.level != "none" or self.reject != "none"


class GSPOConfig(Section):
    clip_eps_low: float = Field(
        3e-4,
        gt=0,
        lt=1,
        description="algo.policy_loss=gspo|gspo_token: the sequence ratio's lower clip ε_low (GSPO paper: 3e-4).",
    )
    clip_eps_high: float = Field(
        4e-4,
        gt=0,
        description="algo.policy_loss=gspo|gspo_token: the sequence ratio's upper clip ε_high (GSPO paper: 4e-4).",
    )


class GMPOConfig(Section):
    clip_eps_low: float = Field(
        0.4,
        gt=0,
        description="algo.policy_loss=gmpo: lower clip of each token's log-ratio, in log space (GMPO paper: 0.4, i.e. "
        "e^-0.4; verl's geo_mean reuses its clip_ratio 0.2).",
    )
    clip_eps_high: float = Field(
        0.4,
        gt=0,
        description="algo.policy_loss=gmpo: upper clip of each token's log-ratio, in log space (GMPO paper: 0.4).",
    )


class CISPOConfig(Section):
    clip_eps_low: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="algo.policy_loss=cispo: lower bound 1 - ε_low of the detached IS weight; null = none (the "
        "MiniMax-M1 paper's choice; verl bounds it at 0.8).",
    )
    clip_eps_high: float = Field(
        0.2,
        gt=0,
        description="algo.policy_loss=cispo: the IS weight is capped at 1 + ε_high (verl's 0.2; the paper tunes it).",
    )


class SAPOConfig(Section):
    tau_pos: float = Field(
        1.0,
        gt=0,
        description="algo.policy_loss=sapo: gate temperature τ for tokens with A > 0 (SAPO paper and verl: 1.0).",
    )
    tau_neg: float = Field(
        1.05,
        gt=0,
        description="algo.policy_loss=sapo: gate temperature τ for tokens with A <= 0 (SAPO paper and verl: 1.05).",
    )


class ClipCovConfig(Section):
    ratio: float = Field(
        2e-4,
        gt=0,
        le=1,
        description="algo.policy_loss=clip_cov: fraction r of the micro-batch's tokens whose gradient is detached (at "
        "least 1), drawn among the high-covariance ones (paper and verl: 2e-4).",
    )
    lb: float = Field(
        1.0,
        description="algo.policy_loss=clip_cov: lower bound of the covariance term (A - mean A)(log π - mean log π) of "
        "a drawable token (paper and verl: 1).",
    )
    ub: float = Field(
        5.0, description="algo.policy_loss=clip_cov: upper bound of that covariance term (paper and verl: 5)."
    )

    @model_validator(mode="after")
    def _order(self):
        if not self.lb < self.ub:
            raise ValueError(f"clip_cov.lb ({self.lb}) must be below clip_cov.ub ({self.ub})")
        return self


class KLCovConfig(Section):
    ratio: float = Field(
        2e-4,
        gt=0,
        le=1,
        description="algo.policy_loss=kl_cov: fraction k of the micro-batch's tokens (at least 1), those with the "
        "largest covariance term, that get the |log r| penalty (verl: 2e-4; the paper tunes it per model, 2e-3 at 7B).",
    )
    coef: float = Field(
        0.1,
        ge=0,
        description="algo.policy_loss=kl_cov: coefficient of the |log π/π_old| penalty on the selected tokens (verl's "
        "ppo_kl_coef 0.1).",
    )


class DPPOConfig(Section):
    delta_low: float = Field(
        0.2,
        gt=0,
        description="Divergence bound δ for tokens with A <= 0 whose probability fell: binary TV in algo.dppo_tv "
        "(default 0.2), binary KL in nats in algo.dppo_kl (default 0.05); each mode reads its own section.",
    )
    delta_high: float = Field(
        0.2,
        gt=0,
        description="Divergence bound δ for tokens with A > 0 whose probability rose (algo.dppo_tv: TV, default 0.2; "
        "algo.dppo_kl: nats, default 0.05).",
    )
    is_cap: float = Field(
        20.0,
        ge=1,
        description="Cap C of the detached importance ratio (truncated IS; the DPPO paper recommends a large one; "
        "verl's falls back to 20 but its actor config sets clip_ratio_c=3).",
    )


def _dppo_kl_defaults() -> DPPOConfig:
    return DPPOConfig(delta_low=0.05, delta_high=0.05)


#: algo.policy_loss's hyper-parameter sections and the modes that read them (the rest refuse a non-default one)
POLICY_LOSS_SECTIONS = {
    "gspo": ("gspo", "gspo_token"),
    "gmpo": ("gmpo",),
    "cispo": ("cispo",),
    "sapo": ("sapo",),
    "clip_cov": ("clip_cov",),
    "kl_cov": ("kl_cov",),
    "dppo_tv": ("dppo_tv",),
    "dppo_kl": ("dppo_kl",),
}


class AlgoConfig(Section):
    adv_estimator: Literal["gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = (
        Field("grpo", description="Advantage estimator: gae (PPO with a critic) or a critic-free one.")
    )
    gamma: float = Field(1.0, ge=0, le=1, description="γ: discount per token.")
    lam: float = Field(0.95, ge=0, le=1, description="λ: GAE trace decay.")
    norm_by_std: Literal["group", "batch", "none"] = Field(
        "group",
        description="grpo: divide the centred score by the group std, the batch std, or none (Dr. GRPO); TRL's "
        "scale_rewards. true/false = group/none.",
    )
    clip_eps_low: float = Field(0.2, gt=0, lt=1, description="ε_low of the clipped surrogate.")
    clip_eps_high: float = Field(0.2, gt=0, description="ε_high of the clipped surrogate (clip-higher, DAPO).")
    dual_clip_c: float = Field(3.0, gt=1, description="Dual-clip bound c for negative advantages (Ye et al. 2020).")
    policy_loss: Literal[
        "vanilla", "gspo", "gspo_token", "gmpo", "cispo", "sapo", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "gpg"
    ] = Field(
        "vanilla",
        description="Policy loss (tether.algos.policy_loss; docs/training.md#policy-losses): vanilla = PPO clip "
        "(algo.clip_eps_*, algo.dual_clip_c); gspo / gspo_token = sequence-level ratio (algo.gspo.*); gmpo = "
        "geometric-mean ratio (algo.gmpo.*); cispo = capped detached IS weight (algo.cispo.*); sapo = soft gate "
        "(algo.sapo.*); clip_cov / kl_cov = PPO clip / plain ratio with the high-covariance tokens detached / "
        "penalised (algo.clip_cov.*, algo.kl_cov.*); dppo_tv / dppo_kl = binary-divergence trust region "
        "(algo.dppo_tv.*, algo.dppo_kl.*); gpg = no surrogate, -A log π (no ratio to π_old: refused with "
        "algo.ppo_epochs > 1 or rollout.async_steps > 0).",
    )
    gspo: GSPOConfig = Field(
        default_factory=GSPOConfig, description="algo.policy_loss=gspo|gspo_token hyper-parameters."
    )
    gmpo: GMPOConfig = Field(default_factory=GMPOConfig, description="algo.policy_loss=gmpo hyper-parameters.")
    cispo: CISPOConfig = Field(default_factory=CISPOConfig, description="algo.policy_loss=cispo hyper-parameters.")
    sapo: SAPOConfig = Field(default_factory=SAPOConfig, description="algo.policy_loss=sapo hyper-parameters.")
    clip_cov: ClipCovConfig = Field(
        default_factory=ClipCovConfig,
        description="algo.policy_loss=clip_cov hyper-parameters (its clip is algo.clip_eps_low/high).",
    )
    kl_cov: KLCovConfig = Field(default_factory=KLCovConfig, description="algo.policy_loss=kl_cov hyper-parameters.")
    dppo_tv: DPPOConfig = Field(
        default_factory=DPPOConfig, description="algo.policy_loss=dppo_tv hyper-parameters (δ in probability)."
    )
    dppo_kl: DPPOConfig = Field(
        default_factory=_dppo_kl_defaults,
        description="algo.policy_loss=dppo_kl hyper-parameters (δ in nats; default 0.05).",
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    mini_batch_size: int = Field(64, ge=1, description="Responses per optimizer step.")
    loss_agg_mode: (
        Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
        | None
    ) = Field(
        None,
        description="How the per-token loss is averaged (policy, entropy bonus, value loss, and the KL loss unless "
        "kl.loss_agg_mode); null = the policy loss's own: token-mean, seq-mean-token-mean for gspo, gspo_token, gmpo "
        "and sapo (their papers').",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="Entropy bonus coefficient α in the actor loss (loss − α·agg(entropy)); with algo.entropy_target, "
        "the adaptive α's starting value. actor/entropy_coef logs the α of each step.",
    )
    entropy_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive entropy bonus: the entropy to hold, nats per token (policy/entropy: π_old's entropy at "
        "the sampled positions, averaged per response then over responses). After each step α ← clip(α + "
        "algo.entropy_coef_lr·(target − policy/entropy), 0, algo.entropy_coef_max) (dual ascent), starting at "
        "algo.entropy_coef; α is saved in checkpoints. null = α stays algo.entropy_coef. Not with "
        "actor.old_logprobs_source=rollout (no entropy measured) (docs/training.md#entropy-control).",
    )
    entropy_coef_lr: float = Field(
        0.01,
        gt=0,
        description="algo.entropy_target: the dual-ascent step, α per nat of entropy error per step (an entropy 0.1 "
        "nats below the target raises α by 0.001 per step).",
    )
    entropy_coef_max: float = Field(
        0.1,
        gt=0,
        description="algo.entropy_target: the upper bound of α, so that an unreachable target cannot grow the bonus "
        "without limit (at 0.1 the bonus of 1 nat per token is a tenth of a unit advantage's surrogate).",
    )
    top_entropy_quantile: float = Field(
        1.0,
        gt=0,
        le=1,
        description="ρ: only the highest-entropy fraction ρ of a step's counted tokens get a policy-loss gradient "
        "(threshold: the 1 − ρ quantile of π_old's entropy over the whole batch, ties kept); the KL and entropy terms "
        "keep every token and the loss's denominators do not change (Wang et al. 2025, arXiv 2506.01939: 0.2; TRL's "
        "top_entropy_quantile). 1.0 = every token. Logs actor/entropy_mask_frac. Not with "
        "actor.old_logprobs_source=rollout (no entropy measured); turns off actor.reuse_update_logprobs (the entropy "
        "is needed before the update).",
    )
    mask_truncated: bool = Field(
        False,
        description="A response cut at rollout.max_new_tokens without EOS gets no gradient: it leaves the actor's loss "
        "(policy, KL and entropy terms) and its token counts, as a rejected sample (DAPO's overlong filtering; TRL's "
        "mask_truncated_completions); advantages, the critic and the metrics still see it. Logs actor/masked_truncated "
        "(response/truncated_frac: their share).",
    )
    filter_groups: bool = Field(
        False,
        description="DAPO dynamic sampling: drop prompts whose sampled rewards are all equal (zero advantage) and draw "
        "more prompts until data.batch_size prompts differ.",
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="Correction for the gap between the engine that samples and the policy that trains "
        "(TIS/MIS/rejection; metrics rollout_corr/*; docs/training.md#rollout-correction).",
    )
    filter_groups_max_draws: int = Field(
        10,
        ge=1,
        description="algo.filter_groups: at most this many rollout rounds of data.batch_size prompts per step (verl's "
        "DAPO recipe: 10); then train on what was found.",
    )

    @field_validator("norm_by_std", mode="before")
    @classmethod
    def _norm_by_std_booleans(cls, v):
        # configs written before the choice existed say true (group std) / false (Dr. GRPO)
        if v is True:
            return "group"
        if v is False:
            return "none"
        return v

    @model_validator(mode="after")
    def _policy_loss_keys(self):
        """A hyper-parameter of a policy loss that is not the selected one would do nothing: refused, naming it."""
        used = {
            "vanilla": {"clip_eps_low", "clip_eps_high", "dual_clip_c"},
            "clip_cov": {"clip_eps_low", "clip_eps_high"},
        }.get(self.policy_loss, set())
        for key in ("clip_eps_low", "clip_eps_high", "dual_clip_c"):
            if key not in used and getattr(self, key) != type(self).model_fields[key].default:
                raise ValueError(
                    f"algo.{key}={getattr(self, key)} has no effect with algo.policy_loss={self.policy_loss} (read by "
                    f"{'vanilla and clip_cov' if key != 'dual_clip_c' else 'vanilla'}): leave it at its "
                    f"default{self._own_keys_hint()}"
                )
        for section, modes in POLICY_LOSS_SECTIONS.items():
            value = getattr(self, section)
            default = type(self).model_fields[section].default_factory()
            if self.policy_loss not in modes and value != default:
                changed = [
                    f"algo.{section}.{k}={getattr(value, k)}"
                    for k in type(value).model_fields
                    if getattr(value, k) != getattr(default, k)
                ]
                raise ValueError(
                    f"{', '.join(changed)} has no effect with algo.policy_loss={self.policy_loss} (read by "
                    f"{' and '.join(modes)}){self._own_keys_hint()}"
                )
        return self

    def _own_keys_hint(self) -> str:
        own = [s for s, modes in POLICY_LOSS_SECTIONS.items() if self.policy_loss in modes]
        return f"; {self.policy_loss}'s own settings are algo.{own[0]}.*" if own else ""

    @property
    def agg_mode(self) -> str:
        """``loss_agg_mode``, or the policy loss's own aggregation when it is null."""
        return self.loss_agg_mode or POLICY_LOSS_AGG[self.policy_loss]

    def policy_loss_hyper(self) -> dict:
        """The selected policy loss's hyper-parameters as :func:`tether.algos.policy_loss` keywords."""
        name = self.policy_loss
        if name == "vanilla":
            return {
                "clip_eps_low": self.clip_eps_low,
                "clip_eps_high": self.clip_eps_high,
                "dual_clip_c": self.dual_clip_c,
            }
        if name == "clip_cov":
            c = self.clip_cov
            return {
                "clip_eps_low": self.clip_eps_low,
                "clip_eps_high": self.clip_eps_high,
                "clip_cov_ratio": c.ratio,
                "clip_cov_lb": c.lb,
                "clip_cov_ub": c.ub,
            }
        if name == "kl_cov":
            return {"kl_cov_ratio": self.kl_cov.ratio, "kl_cov_coef": self.kl_cov.coef}
        if name == "gpg":
            return {}
        section = next(s for s, modes in POLICY_LOSS_SECTIONS.items() if name in modes)
        return getattr(self, section).model_dump()


class FSDPConfig(Section):
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="trainer.backend=ray: dtype FSDP2 gathers parameters in for compute (bfloat16 with "
        "actor.dtype=float32 = fp32 master weights and AdamW state); null = actor.dtype.",
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="trainer.backend=ray: dtype of FSDP2's gradient reduce-scatter."
    )
    cpu_offload: bool = Field(
        False,
        description="trainer.backend=ray: keep sharded parameters, gradients and optimizer state on the CPU (FSDP2 "
        "CPUOffloadPolicy).",
    )
    activation_checkpointing: bool = Field(
        False, description="trainer.backend=ray: recompute each transformer block's activations in the backward."
    )
    reshard_after_forward: bool = Field(
        True,
        description="trainer.backend=ray: free gathered parameters after each block's forward (ZeRO-3); false keeps "
        "them to the backward.",
    )


class TrainerConfig(Section):
    total_steps: int = Field(300, ge=1, description="Training steps (one rollout batch each).")
    save_freq: int = Field(100, ge=0, description="Checkpoint every N steps and at the end (0 = only at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept besides the best by validation score.")
    output_dir: str = Field("runs/{time}", description="Run directory; '{time}' is replaced by a timestamp.")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")
    resume: str = Field(
        "auto",
        description="auto (latest complete checkpoint in output_dir), off (a fresh start; refused on an output_dir "
        "that holds an earlier run), or a checkpoint path.",
    )
    stop_grace_s: float | None = Field(
        120.0,
        gt=0,
        description="After a SIGTERM/SIGINT the step in progress may run this many seconds more to finish and be "
        "checkpointed; past it (a reward that never returns, a hung collective) it is abandoned and the run exits with "
        "the last complete checkpoint (docs/checkpoints.md). null = wait for the step however long it takes.",
    )
    wait_notice_s: float | None = Field(
        60.0,
        gt=0,
        description="A phase of a step (rollout, reward, update, validation, checkpoint, ...) still running after this "
        "many seconds logs 'step N: still waiting for <the phase, its reward and timeout> (S s)', again every as many "
        "seconds, so a reward that hangs or a stalled worker is never silent. null = no such lines.",
    )
    val_freq: int = Field(50, ge=0, description="Validate every N steps (0 = never).")
    val_n: int = Field(
        4, ge=1, description="Samples per validation prompt: mean@n, pass@k and maj@k for k = 1, 2, 4, ... <= n."
    )
    val_max_prompts: int | None = Field(
        None,
        ge=1,
        description="Validate on at most this many prompts: a fixed subset drawn once with trainer.seed, the same at "
        "every validation (null = all).",
    )
    log_rollouts: int = Field(
        0,
        ge=0,
        description="Write token-level rollout records (prompt, response, per-token log-probs, reference log-probs, "
        "KL, entropy, advantages, masks, reward) of trainer.log_rollouts_k responses every N steps to "
        "RUN_DIR/rollouts/*.parquet, read by tether view (docs/viewer.md); 0 = never.",
    )
    log_rollouts_k: int = Field(
        8, ge=1, description="Responses recorded per recorded step, chosen reproducibly from (trainer.seed, step)."
    )
    log_rollouts_max_mb: float = Field(
        512.0, gt=0, description="Size bound of RUN_DIR/rollouts, MiB: the oldest steps' files are deleted first."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where models run.")
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"], description="Metric sinks (jsonl is always written)."
    )
    project: str = Field("tether", description="Project name for wandb/mlflow.")
    progress: bool = Field(True, description="Show a progress bar.")
    report: bool = Field(True, description="Write plots and summary.md at the end of the run.")
    threads: int = Field(
        0,
        ge=0,
        description="torch CPU threads; 0 = auto: 1 for the embedded tiny model (threading overhead dominates), "
        "torch's default otherwise.",
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="local: every role in this process; ray: actor, reference and critic as Ray actors with FSDP2 "
        "(docs/distributed.md).",
    )
    n_workers: int = Field(
        1,
        ge=1,
        description="trainer.backend=ray: data-parallel workers (FSDP2 ranks) per worker group; with GPUs, nnodes * "
        "n_gpus_per_node when left at 1.",
    )
    ray_address: str | None = Field(
        None,
        description="trainer.backend=ray: cluster to attach to ('auto', 'ray://host:10001', host:port); null starts a "
        "local Ray that tether shuts down at the end.",
    )
    nnodes: int = Field(1, ge=1, description="trainer.backend=ray: nodes the worker groups span.")
    n_gpus_per_node: int = Field(
        0, ge=0, description="trainer.backend=ray: GPUs per node for the workers; 0 = CPU workers (gloo)."
    )
    placement: Literal["colocate", "split"] = Field(
        "colocate",
        description="trainer.backend=ray: colocate = actor, reference, critic and vLLM replicas share each worker's "
        "device; split = the critic gets its own worker group and devices, and vLLM replicas their own bundles.",
    )
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig, description="FSDP2 sharding of the Ray backend's workers.")

    @field_validator("output_dir")
    @classmethod
    def _output_dir_not_empty(cls, v):
        if not v.strip():
            raise ValueError("trainer.output_dir must name a directory (default runs/{time})")
        return v

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_words(cls, v):
        # YAML reads a bare off/on as booleans
        if v is False:
            return "off"
        if v is True:
            return "auto"
        return v


class GuardConfig(Section):
    target_kl: float | None = Field(
        0.1,
        gt=0,
        description="Stop the remaining PPO epochs/mini-batches when policy/approx_kl exceeds this (null = off).",
    )
    max_kl: float = Field(
        1.0, gt=0, description="Per-token KL to the reference (kl/ref_mean) above which on_max_kl acts."
    )
    on_max_kl: Literal["raise_coef", "skip", "stop"] = Field(
        "raise_coef", description="What exceeding guard.max_kl does."
    )
    coef_factor: float = Field(
        2.0, gt=1, description="raise_coef / rollback: β is multiplied by this (raise_coef: the run's β, floor too)."
    )
    on_nonfinite: Literal["skip", "stop"] = Field(
        "skip", description="A non-finite loss/grad-norm/KL: skip the update or stop the run."
    )
    atomic_update: bool = Field(
        True,
        description="A step of several optimizer updates (mini-batches x PPO epochs) whose later mini-batch turns "
        "non-finite is undone whole (weights, AdamW state, LR schedule), never left half applied; costs a host copy of "
        "3x the trainable parameters (per rank) during each such step. false = only the non-finite mini-batch is "
        "skipped.",
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description="Stop (exit 3, no checkpoint of the broken weights) after this many steps in a row that skipped a "
        "non-finite mini-batch update; an update that leaves non-finite weights stops at once.",
    )
    rollback_drop: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Roll back when the val score falls more than this fraction below the last stable checkpoint's (0 "
        "= off; below 1, since a fall of the whole score or more never happens to a score >= 0).",
    )
    rollback_metric: str = Field(
        "auto",
        description="Validation metric rollback and the best checkpoint watch; auto = the training reward's: "
        "exact/score_mean on the embedded task (no sampling noise; reward.function's score where set), else "
        "val/score_mean; gold = val/gold_mean, the gold reward's (reward.val_function / "
        "reward.val_model, or the data source's built-in gold; refused without one).",
    )
    rollback_z: float = Field(
        2.0,
        ge=0,
        description="A drop must also exceed this many standard errors of the difference of two validations "
        "(val/score_sem), so sampling noise alone never rolls back; 0 = off.",
    )
    rollback_lr_factor: float = Field(
        0.5, gt=0, le=1, description="Multiply the learning rates by this after a rollback."
    )
    max_rollbacks: int = Field(
        3,
        ge=0,
        description="Stop after this many rollbacks, with a message naming each one's step, checkpoint restored and β.",
    )
    on_hacking: Literal["warn", "rollback", "stop"] = Field(
        "warn",
        description="What a live reward-hacking warning (the doctor's hacking_gold or hacking_proxy check; "
        "hacking_kl_focus only warns, docs/hacking.md) does: warn = log it; rollback = restore the last checkpoint "
        "before the warning's step whose "
        "validated gold is within guard.rollback_drop of the best gold so far, the reference's included (without a "
        "gold reward: the last stable one by guard.rollback_metric; never the flagged step's own), multiply β by "
        "guard.coef_factor (at least guard.hacking_coef, escalating) and the learning rates by "
        "guard.rollback_lr_factor, counted against guard.max_rollbacks (a step whose validation already rolled back is "
        "not rolled back twice); needs 0 < trainer.save_freq < trainer.total_steps; stop = checkpoint and stop (exit "
        "3).",
    )
    hacking_coef: float = Field(
        0.05,
        gt=0,
        description="guard.on_hacking=rollback: β is at least this after the first hacking rollback (multiplying a β "
        "of 0 by guard.coef_factor leaves it 0), and at least this × guard.coef_factor^n after the (n+1)-th (β = 0: "
        "0.05, 0.1, 0.2, ...).",
    )

    _rollback_metric = field_validator("rollback_metric")(classmethod(lambda cls, v: _check_rollback_metric(v)))

    @model_validator(mode="after")
    def _hacking_coef_used(self):
        if self.hacking_coef != 0.05 and self.on_hacking != "rollback":
            raise ValueError(
                f"guard.hacking_coef={self.hacking_coef} has no effect with guard.on_hacking={self.on_hacking}: set "
                "guard.on_hacking=rollback or leave it at 0.05"
            )
        return self


def _check_rollback_metric(v: str) -> str:
    if v not in ("auto", "gold") and not v.startswith(("val/", "exact/")):
        raise ValueError("guard.rollback_metric must be auto, gold or a validation metric (val/... or exact/...)")
    return v


def no_gold_message(sources) -> str:
    """Why ``guard.rollback_metric=gold`` cannot run: no gold reward for the validation data ``sources``."""
    shown = ", ".join(repr(s) for s in sources) or "none"
    return (
        "guard.rollback_metric=gold watches val/gold_mean, but validation has no gold reward: reward.val_function and "
        f"reward.val_model are unset, and the validation data source(s) {shown} have no built-in gold "
        "(tether.rewards.GOLD_FUNCTIONS). Set reward.val_function=path/file.py:name (or reward.val_model=DIR), or "
        "choose another guard.rollback_metric (docs/rewards.md#gold-reward-for-validation)"
    )


def _check_gold_rollback(cfg) -> None:
    """``guard.rollback_metric=gold`` without reward.val_function / reward.val_model on the embedded task, whose
    validation data sources are known before any file is read: refused when none of them has a built-in gold.
    With data files, the sources are known once they are read: ``tether.trainer.startup.check_gold`` refuses it
    then, before training."""
    if cfg.guard.rollback_metric != "gold" or cfg.reward.val_function or cfg.reward.val_model:
        return
    d = cfg.data
    if d.train_files != EMBEDDED or d.val_files not in (None, EMBEDDED):
        return

    # the val split's records
    val = embedded_task(d.embedded_task).make_dataset("val", d.embedded_val_size, seed=cfg.trainer.seed)
    sources = list(dict.fromkeys(r.get("data_source", "unknown") for r in val))
    if not any(s in GOLD_FUNCTIONS for s in sources):
        raise ValueError(no_gold_message(sources))


def _check_distributed(cfg) -> None:
    """The Ray backend's degrees, checked in one place before anything starts."""
    t = cfg.trainer
    if t.nnodes > 1 and not t.n_gpus_per_node and t.n_workers % t.nnodes:
        raise ValueError(
            f"trainer.n_workers={t.n_workers} must be a multiple of trainer.nnodes={t.nnodes} (the same number of "
            "ranks on every node)"
        )
    if t.n_gpus_per_node and t.n_workers not in (1, t.nnodes * t.n_gpus_per_node):
        raise ValueError(
            f"trainer.n_workers={t.n_workers} must equal trainer.nnodes * trainer.n_gpus_per_node = "
            f"{t.nnodes * t.n_gpus_per_node} (one worker per GPU)"
        )
    if t.n_gpus_per_node == 0 and t.device == "cuda":
        raise ValueError("trainer.device=cuda with trainer.backend=ray needs trainer.n_gpus_per_node >= 1")
    n = t.nnodes * t.n_gpus_per_node if t.n_gpus_per_node and t.n_workers == 1 else t.n_workers
    if n % cfg.actor.tp_size:
        raise ValueError(
            f"actor.tp_size={cfg.actor.tp_size} must divide the worker group's {n} ranks (trainer.n_workers, or nnodes "
            "* n_gpus_per_node)"
        )
    if cfg.actor.tp_size > 1 and cfg.actor.lora.rank > 0:
        raise ValueError(
            "actor.tp_size > 1 with LoRA (actor.lora.rank > 0) is not supported: peft's adapter layers are not split "
            "by tensor parallelism"
        )


def _check_entropy_and_truncation(cfg) -> None:
    """algo.entropy_target, algo.top_entropy_quantile, reward.overlong_buffer: bad combinations, and keys that would do
    nothing."""
    a, r = cfg.algo, cfg.reward
    if a.entropy_target is None:
        unused = [
            f"algo.{k}={getattr(a, k)}"
            for k in ("entropy_coef_lr", "entropy_coef_max")
            if getattr(a, k) != AlgoConfig.model_fields[k].default
        ]
        if unused:
            raise ValueError(
                f"{', '.join(unused)} has no effect without algo.entropy_target (α stays algo.entropy_coef): set "
                "algo.entropy_target (nats per token) or leave them at their defaults"
            )
    elif a.entropy_coef > a.entropy_coef_max:
        raise ValueError(
            f"algo.entropy_coef={a.entropy_coef} (the adaptive α's start) must not exceed "
            f"algo.entropy_coef_max={a.entropy_coef_max}"
        )
    needs_entropy = (
        [(f"algo.entropy_target={a.entropy_target}", "algo.entropy_target null")]
        if a.entropy_target is not None
        else []
    )
    needs_entropy += (
        [(f"algo.top_entropy_quantile={a.top_entropy_quantile}", "algo.top_entropy_quantile at 1")]
        if a.top_entropy_quantile < 1
        else []
    )
    if needs_entropy and cfg.actor.old_logprobs_source == "rollout":
        setting, off = needs_entropy[0]
        raise ValueError(
            f"{setting} needs π_old's entropy, which actor.old_logprobs_source=rollout does not measure (no actor pass "
            f"before the update); use actor.old_logprobs_source=recompute, or leave {off}"
        )
    if r.overlong_buffer and r.overlong_buffer >= cfg.rollout.max_new_tokens:
        raise ValueError(
            f"reward.overlong_buffer={r.overlong_buffer} must be below "
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} (the penalty ramps over the last overlong_buffer "
            "tokens before the limit)"
        )
    if not r.overlong_buffer and r.overlong_penalty != RewardConfig.model_fields["overlong_penalty"].default:
        raise ValueError(
            f"reward.overlong_penalty={r.overlong_penalty} has no effect without reward.overlong_buffer: set "
            "reward.overlong_buffer (tokens) or leave reward.overlong_penalty at its default"
        )


def _check_async(cfg) -> None:
    """rollout.async_steps needs something to generate, with the HF engine, one draw per step and per-token
    log-probs."""
    clash = {
        "rollout.mode=offline": cfg.rollout.mode == "offline",  # nothing is generated
        # the engine holds its own weights: a snapshot is not wired
        f"rollout.engine={cfg.rollout.engine}": not getattr(chosen(cfg), "snapshot_async", True),
        "algo.filter_groups=true": cfg.algo.filter_groups,  # how many draws a step takes depends on their rewards
        "kl.estimator=full": cfg.kl.estimator == "full",  # needs the behaviour policy's logits beside the reference's
        "kl.loss_estimator=full": cfg.kl.loss_estimator == "full",
        # the reward's per-state divergence needs the behaviour policy's logits beside the teacher's
        f"distill.estimator={cfg.distill.estimator}": (
            cfg.distill.teacher is not None and cfg.distill.estimator in FULL_DISTILL_ESTIMATORS
        ),
    }
    bad = [k for k, v in clash.items() if v]
    if bad:
        raise ValueError(
            f"rollout.async_steps={cfg.rollout.async_steps} cannot be combined with {', '.join(bad)} "
            "(docs/training.md, docs/performance.md); set rollout.async_steps=0"
        )


def _check_staleness(cfg) -> None:
    """rollout.max_staleness and rollout.staleness_policy act only on batches generated ahead, and only where the
    bound is below rollout.async_steps (every batch is exactly async_steps updates old): set where they can do nothing,
    refused naming them. (A bound below async_steps under drop runs, said at start:
    :func:`tether.trainer.startup.warn_partly_inert_settings`.)"""
    r = cfg.rollout
    k, bound, policy = r.async_steps, r.max_staleness, r.staleness_policy
    default_policy = RolloutConfig.model_fields["staleness_policy"].default
    if not k:
        given = (("max_staleness", bound, None), ("staleness_policy", policy, default_policy))
        unused = [f"rollout.{key}={v}" for key, v, d in given if v != d]
        if unused:
            raise ValueError(
                f"{' and '.join(unused)} {'have' if len(unused) > 1 else 'has'} no effect with rollout.async_steps=0 "
                "(every batch is generated by the policy that trains on it); set rollout.async_steps or leave "
                + ("them at their defaults" if len(unused) > 1 else "it at its default")
            )
        return
    if bound is not None and bound > k:
        raise ValueError(
            f"rollout.max_staleness={bound} has no effect above rollout.async_steps={k} (no batch is more than "
            f"async_steps updates old); set it to at most {k}, or leave it null (= async_steps)"
        )
    if policy != default_policy and (bound is None or bound >= k):
        raise ValueError(
            f"rollout.staleness_policy={policy} has no effect unless rollout.max_staleness is below "
            f"rollout.async_steps={k} (every batch is exactly async_steps updates old); set rollout.max_staleness "
            f"below {k}, or leave rollout.staleness_policy at {default_policy}"
        )


def _check_gpg(cfg) -> None:
    """``algo.policy_loss=gpg`` (−A·log π_θ) ignores π_old, so it is the policy gradient only on the policy's own
    samples: more PPO epochs or batches generated ahead train it on an older policy's samples with nothing correcting
    them; refused, naming the key."""
    if cfg.algo.policy_loss != "gpg":
        return
    off = [
        f"{key}={v}"
        for key, v in (("algo.ppo_epochs", cfg.algo.ppo_epochs), ("rollout.async_steps", cfg.rollout.async_steps))
        if v > (1 if key == "algo.ppo_epochs" else 0)
    ]
    if off:
        raise ValueError(
            f"algo.policy_loss=gpg with {' and '.join(off)}: gpg's loss −A·log π_θ has no ratio to π_old, so it is the "
            "policy gradient only on-policy and nothing corrects samples of an older policy; use a ratio-based loss "
            "(vanilla, cispo, ...) or set algo.ppo_epochs=1 and rollout.async_steps=0"
        )


def _check_distill(cfg) -> None:
    """``distill.*``: keys that do nothing without a teacher or with another estimator, and what on-policy
    distillation cannot run with yet."""
    d = cfg.distill
    fields = DistillConfig.model_fields
    if d.teacher is None:
        for key in ("coef", "estimator", "jsd_beta", "top_k", "teacher_beta"):
            if getattr(d, key) != fields[key].default:
                raise ValueError(
                    f"distill.{key}={getattr(d, key)} has no effect without distill.teacher (distillation is off); set "
                    f"distill.teacher=DIR or leave distill.{key} at its default"
                )
        return
    if d.teacher == EXACT_TEACHER:
        _check_exact_teacher(cfg)
    elif d.teacher_beta is not None:
        raise ValueError(
            f"distill.teacher_beta={d.teacher_beta} is β of distill.teacher=exact and has no effect with "
            f"distill.teacher={d.teacher}; set distill.teacher=exact or distill.teacher_beta=null"
        )
    if d.jsd_beta != fields["jsd_beta"].default and d.estimator != "jsd":
        raise ValueError(
            f"distill.jsd_beta={d.jsd_beta} has no effect with distill.estimator={d.estimator}; set "
            "distill.estimator=jsd or leave distill.jsd_beta at its default"
        )
    if d.top_k == 1:
        raise ValueError(
            "distill.top_k=1: renormalised over one token both distributions are 1, so the divergence is 0 and "
            "distillation trains nothing; set distill.top_k to at least 2, or null (the full vocabulary)"
        )
    if d.top_k is not None and d.estimator not in FULL_DISTILL_ESTIMATORS:
        raise ValueError(
            f"distill.top_k={d.top_k} needs the teacher's logits, and distill.estimator={d.estimator} uses the sampled "
            f"token's log-probs only; set distill.estimator to one of {', '.join(FULL_DISTILL_ESTIMATORS)} or "
            "distill.top_k=null"
        )
    if d.estimator in FULL_DISTILL_ESTIMATORS and cfg.actor.old_logprobs_source == "rollout":
        raise ValueError(
            f"actor.old_logprobs_source=rollout: distill.estimator={d.estimator} needs the actor's logits at each "
            "visited state; use actor.old_logprobs_source=recompute or distill.estimator=k1"
        )
    if cfg.trainer.backend == "ray" and d.teacher == EXACT_TEACHER and d.estimator in FULL_DISTILL_ESTIMATORS:
        raise ValueError(
            f"distill.teacher=exact with distill.estimator={d.estimator} and trainer.backend=ray: the exact teacher is "
            "a lookup table in the driver, and this estimator needs its logits on the actor's ranks; use "
            "distill.estimator=k1, trainer.backend=local, or a model directory as distill.teacher "
            "(docs/distillation.md)"
        )
    if cfg.rollout.mode == "offline":
        raise ValueError(
            "distill.teacher needs the student's own samples (on-policy distillation), and rollout.mode=offline trains "
            "on a dataset's responses; use rollout.mode=online or set distill.teacher=null"
        )


def exact_teacher_beta(cfg) -> float:
    """β of ``distill.teacher=exact``'s π*_β: ``distill.teacher_beta``, else ``kl.coef``."""
    d = cfg.distill
    return d.teacher_beta if d.teacher_beta is not None else cfg.kl.coef


def _check_exact_teacher(cfg) -> None:
    """``distill.teacher=exact``: the embedded task's enumerable space, its shipped reference, and β > 0."""
    if not cfg.exact_evaluation_applies:
        raise ValueError(
            "distill.teacher=exact is the embedded task's exact optimum and needs its enumerable responses: "
            "data.train_files=embedded sampled with rollout.top_p=1, rollout.top_k=0, rollout.do_sample=true"
        )
    if getattr(EMBEDDED_TASKS[cfg.data.embedded_task], "AGENT", None):
        raise ValueError(
            f"distill.teacher=exact is a single-turn teacher (π*_β over one response) and "
            f"data.embedded_task={cfg.data.embedded_task} is multi-turn; use data.embedded_task=digitsum or "
            "digitsum_hack, or a model directory as distill.teacher"
        )
    if cfg.actor.model != EMBEDDED or cfg.ref.model is not None:
        raise ValueError(
            "distill.teacher=exact is π*_β ∝ π_ref·exp(r/β) of the shipped reference: set actor.model=embedded and "
            "ref.model=null"
        )
    if not exact_teacher_beta(cfg) > 0:
        raise ValueError(
            "distill.teacher=exact needs β > 0 (π*_0 is a hard argmax): distill.teacher_beta is null and kl.coef=0; "
            "set distill.teacher_beta=B, e.g. 0.05"
        )


class TetherConfig(Section):
    actor: ActorConfig = Field(default_factory=ActorConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)

    @model_validator(mode="before")
    @classmethod
    def _share_prompt_prefix_gives_way(cls, data):
        """actor.share_prompt_prefix, on by default, is off where it is left unset and a packed layout is asked
        for (actor.padding_free, or critic.padding_free with a critic: packed rows hold whole sequences, with no
        prompt cache to share); set true explicitly beside one, :meth:`_cross_checks` refuses the pair."""
        actor = data.get("actor", {}) if isinstance(data, dict) else None
        given = actor.model_fields_set if isinstance(actor, BaseModel) else actor
        if given is None or not hasattr(given, "__contains__") or "share_prompt_prefix" in given:
            return data

        from pydantic import TypeAdapter  # here, not in the module's import line that every branch edits

        def on(section: str, key: str, default):
            value = data.get(section, {})
            value = value.get(key, default) if isinstance(value, dict) else getattr(value, key, default)
            try:
                return TypeAdapter(type(default)).validate_python(value)
            except ValidationError:
                return default  # a bad value: the field's own validation names it

        gae = on("algo", "adv_estimator", AlgoConfig.model_fields["adv_estimator"].default) == "gae"
        if on("actor", "padding_free", False) or (gae and on("critic", "padding_free", False)):
            off = (
                actor.model_copy(update={"share_prompt_prefix": False})
                if isinstance(actor, BaseModel)
                else {**actor, "share_prompt_prefix": False}
            )
            data = {**data, "actor": off}
        return data

    def _agent_combinations(self) -> None:
        """What the multi-turn loop (agent.tools / agent.environment) does not run with yet: refused, naming the key."""
        if not self.agent.enabled:
            return
        a = self.agent
        on = "agent.tools" if a.tools else "agent.environment" if a.environment else "agent.environments"
        refused = [
            ("rollout.mode", self.rollout.mode, self.rollout.mode == "offline", "online"),
        ]
        if self.rollout.engine not in (AUTO, *(e.name for e in ENGINES.values() if e.multi_turn)):
            ok = " or ".join([*(e.name for e in ENGINES.values() if e.multi_turn), AUTO])
            refused.append(("rollout.engine", self.rollout.engine, True, ok))
        for key, value, bad, fix in refused:
            if bad:
                raise ValueError(
                    f"{key}={value} does not run with {on} yet (the multi-turn agent loop, docs/agents.md); set "
                    f"{key}={fix}, or leave {on} unset"
                )
        if self.agent.on_prefix_mismatch == "split":  # a trajectory's pieces are rows: what cannot carry that yet
            split_refused = [
                (
                    "algo.adv_estimator",
                    self.algo.adv_estimator,
                    self.algo.adv_estimator in ("gae", "reinforce_plus_plus"),
                    "grpo",
                ),
                ("rollout.async_steps", self.rollout.async_steps, self.rollout.async_steps > 0, "0"),
                ("algo.filter_groups", self.algo.filter_groups, self.algo.filter_groups, "false"),
                ("kl.loss_to_go", self.kl.loss_to_go, self.kl.loss_to_go, "false"),
                # not tested against local with pieces (test_ray_agent_equals_local runs whole trajectories)
                ("trainer.backend", self.trainer.backend, self.trainer.backend == "ray", "local"),
            ]
            for key, value, bad, fix in split_refused:
                if bad:
                    raise ValueError(
                        f"{key}={value} does not run with agent.on_prefix_mismatch=split yet (a trajectory's pieces "
                        f"are rows of their own, docs/agents.md); set {key}={fix}, or agent.on_prefix_mismatch=count"
                    )

    @model_validator(mode="before")
    @classmethod
    def _embedded_task_agent(cls, data):
        """An embedded task that runs in the turn loop (its module's ``AGENT``: data.embedded_task=digitsum_tool)
        fills the agent keys left unset (agent.environment, agent.max_turns), with data.train_files=embedded and no
        agent.tools; a key the user set is kept."""
        if not isinstance(data, dict):
            return data

        def get(section, key, default):
            v = data.get(section, {})
            return v.get(key, default) if isinstance(v, dict) else getattr(v, key, default)

        task = get("data", "embedded_task", "digitsum")
        if get("data", "train_files", EMBEDDED) != EMBEDDED or task not in EMBEDDED_TASKS:
            return data
        defaults = getattr(EMBEDDED_TASKS[task], "AGENT", None)
        agent = data.get("agent", {})
        if not defaults:
            return data
        if get("agent", "tools", None):  # the task's reward is its environment's: tools would train on nothing
            raise ValueError(
                f"data.embedded_task={task} runs its own environment ({defaults['environment']}) and agent.tools "
                "would replace it; leave agent.tools unset, or train your tools on another dataset"
            )
        if isinstance(agent, BaseModel):
            given = agent.model_fields_set
            fill = {k: v for k, v in defaults.items() if k not in given}
            agent = AgentConfig(**(agent.model_dump(include=given) | fill))
        else:
            agent = {**defaults, **agent}
        return {**data, "agent": agent}

    @model_validator(mode="after")
    def _cross_checks(self):
        if self.algo.adv_estimator in {"grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"} and self.rollout.n < 2:
            raise ValueError(
                f"algo.adv_estimator={self.algo.adv_estimator} needs rollout.n >= 2 (a group), got {self.rollout.n}"
            )
        if self.algo.filter_groups and self.rollout.mode == "online" and self.rollout.n < 2:
            raise ValueError(
                "algo.filter_groups needs rollout.n >= 2 (rewards that can differ within a prompt's group), got "
                f"{self.rollout.n}"
            )
        if self.rollout.mode == "offline" and self.data.response_key is None:
            raise ValueError("rollout.mode=offline needs data.response_key (the column holding the responses)")
        t = self.trainer
        if self.guard.on_hacking == "rollback" and (not t.save_freq or t.save_freq >= t.total_steps):
            raise ValueError(
                f"guard.on_hacking=rollback needs checkpoints to return to, and trainer.save_freq={t.save_freq} writes "
                f"one only at the end (trainer.total_steps={t.total_steps}): set trainer.save_freq below it (no larger "
                "than the time hacking takes to show, e.g. 10 with trainer.val_freq=10) or guard.on_hacking=warn|stop"
            )
        if self.guard.on_hacking == "rollback" and not t.val_freq:
            raise ValueError(
                "guard.on_hacking=rollback chooses the checkpoint to return to by its validations, and "
                "trainer.val_freq=0 runs none: set trainer.val_freq (e.g. 10, with trainer.save_freq=10) or "
                "guard.on_hacking=warn|stop"
            )
        if self.trainer.backend == "ray":
            _check_distributed(self)
        elif self.actor.tp_size > 1:
            raise ValueError(
                f"actor.tp_size={self.actor.tp_size} needs trainer.backend=ray (the local backend runs every role in "
                "one process)"
            )
        if self.trainer.backend != "ray":  # Ray's keys do nothing on the local backend: refused, not ignored
            t = self.trainer
            for key, value, default in (
                ("n_workers", t.n_workers, 1),
                ("nnodes", t.nnodes, 1),
                ("n_gpus_per_node", t.n_gpus_per_node, 0),
                ("placement", t.placement, "colocate"),
                ("ray_address", t.ray_address, None),
            ):
                if value != default:
                    raise ValueError(
                        f"trainer.{key}={value} needs trainer.backend=ray (the local backend runs every role in this "
                        f"process); set trainer.backend=ray or leave trainer.{key} at its default ({default})"
                    )
        self._agent_combinations()
        check_engines(self)  # each engine's settings against the rest (tether.engines)
        if self.actor.tp_size > 1 and (self.actor.padding_free or self.critic.padding_free):
            raise ValueError(
                f"actor.padding_free / critic.padding_free do not support actor.tp_size={self.actor.tp_size} "
                "(vocabulary-parallel logits are not gathered per packed position); use actor.tp_size=1 or "
                "padding_free=false"
            )
        if self.actor.share_prompt_prefix:
            packed = [
                k
                for k, on in (
                    ("actor.padding_free", self.actor.padding_free),
                    ("critic.padding_free", self.critic.padding_free and self.algo.adv_estimator == "gae"),
                )
                if on
            ]
            if packed:
                raise ValueError(
                    f"actor.share_prompt_prefix=true cannot be combined with {packed[0]}=true (packed rows hold whole "
                    "sequences, with no prompt KV cache to share); set one of them to false (left unset, "
                    "share_prompt_prefix is off then)"
                )
        if self.algo.adv_estimator == "gae" and self.critic.warmup_steps >= self.trainer.total_steps:
            raise ValueError(
                f"critic.warmup_steps={self.critic.warmup_steps} >= trainer.total_steps={self.trainer.total_steps}: "
                "only the critic would be trained, never the actor (lower critic.warmup_steps)"
            )
        if self.rollout.async_steps:
            _check_async(self)
        _check_staleness(self)
        _check_gpg(self)
        f = self.data.filter
        if (
            self.rollout.mode == "offline"
            and (f.score_min is not None or f.score_max is not None)
            and self.data.score_key is None
        ):
            raise ValueError(
                "data.filter.score_min/score_max filter on the dataset's scores: set data.score_key (the column "
                "holding them)"
            )
        if (
            self.actor.old_logprobs_source == "rollout"
            and not self.rollout.do_sample
            and self.rollout.temperature != 1.0
        ):
            raise ValueError(
                "actor.old_logprobs_source=rollout with rollout.do_sample=false: greedy decoding's log-probs are the "
                f"untempered ones (vLLM reports no others), not the rollout.temperature={self.rollout.temperature} "
                "ones the trainer's ratio and KL use; use actor.old_logprobs_source=recompute or rollout.temperature=1"
            )
        if self.rollout.engine_temperature is not None and not self.rollout.do_sample:
            raise ValueError(
                f"rollout.engine_temperature={self.rollout.engine_temperature} has no effect with "
                "rollout.do_sample=false (greedy decoding picks the most likely token at any temperature and reports "
                "untempered log-probs); set rollout.do_sample=true or leave rollout.engine_temperature null"
            )
        if self.rollout.hf_sampler != "multinomial" and self.rollout.hf_decode != "tether":
            raise ValueError(
                f"rollout.hf_sampler={self.rollout.hf_sampler} needs rollout.hf_decode=tether (model.generate samples "
                "with torch.multinomial); set rollout.hf_decode=tether or rollout.hf_sampler=multinomial"
            )
        if self.actor.old_logprobs_source == "rollout" and (
            self.rollout.mode == "offline" or self.kl.estimator == "full"
        ):
            why = (
                "rollout.mode=offline has no rollout engine"
                if self.rollout.mode == "offline"
                else "kl.estimator=full needs the actor's logits"
            )
            raise ValueError(f"actor.old_logprobs_source=rollout: {why}; use actor.old_logprobs_source=recompute")
        if self.algo.rollout_correction.batch_normalize and self.actor.old_logprobs_source == "rollout":
            raise ValueError(
                "algo.rollout_correction.batch_normalize has no effect with actor.old_logprobs_source=rollout (bypass "
                "mode: the weights are 0/1 mask and rejection factors); set it false"
            )
        if self.rollout.mode == "offline":
            for key in ("engine_temperature", "compute_dtype"):
                if getattr(self.rollout, key) is not None:
                    raise ValueError(
                        f"rollout.{key}={getattr(self.rollout, key)} has no effect with rollout.mode=offline (nothing "
                        "is generated for training)"
                    )
        if self.algo.rollout_correction.active and self.rollout.mode == "offline":
            raise ValueError(
                "algo.rollout_correction needs sampled responses with the engine's log-probs: rollout.mode=offline has "
                "none; set algo.rollout_correction.level=none and algo.rollout_correction.reject=none"
            )
        _check_entropy_and_truncation(self)
        _check_gold_rollback(self)
        _check_distill(self)
        if self.kl.estimator == "full" and self.kl.placement in ("reward", "both") and self.kl.loss_estimator is None:
            pass  # full KL in the reward is exact and allowed
        return self

    @property
    def kl_loss_estimator(self) -> str:
        return self.kl.loss_estimator or self.kl.estimator

    @property
    def exact_evaluation_applies(self) -> bool:
        """Whether exact/* metrics apply: the embedded task's data (every response can be enumerated) sampled at plain
        temperature (no top-p / top-k, ``rollout.do_sample``). Decided here, once, for validation during training,
        ``tether eval`` and the sweep's final exact evaluation."""
        r = self.rollout
        return self.data.train_files == EMBEDDED and r.top_p == 1.0 and r.top_k == 0 and r.do_sample

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


# ----------------------------------------------------------------------------------------------
# Loading, overrides, errors


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        keys.append(prefix + name)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_known_keys(ann, prefix + name + "."))
    return keys


def _did_you_mean(key: str) -> str:
    close = [
        k
        for k in difflib.get_close_matches(key, _known_keys(TetherConfig), n=3, cutoff=0.6)
        if not key.startswith(k + ".")
    ]  # 'guard' is no suggestion for 'guard.zzz'
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in _known_keys(TetherConfig) if k.rsplit(".", 1)[-1] == leaf][:3]
    if close:
        return f" (did you mean {' or '.join(close)}?)"
    # nothing close: list what the section holds (the sections themselves for a top-level key)
    section, _, _ = key.rpartition(".")
    prefix = section + "." if section else ""
    here = [k[len(prefix) :] for k in _known_keys(TetherConfig) if k.startswith(prefix) and "." not in k[len(prefix) :]]
    if not here:
        return ""
    return f" ({'keys of ' + section if section else 'sections'}: {', '.join(here)})"


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key.sub=value`` and parse the value as YAML. Raises ConfigError on a missing '='."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. kl.coef=0.1)")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        if not isinstance(node.get(p, {}), dict):
            raise ConfigError(f"cannot set {key}: {p} is not a section")
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config key {loc!r}{_did_you_mean(loc)}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        got_s = "" if isinstance(got, dict) else f" (got {got!r})"
        # a section-level check names its field first ("lr must be ..."): report the full key
        first = msg.split(" ", 1)[0]
        if isinstance(got, dict) and first in got and not msg.startswith(f"{loc}."):
            lines.append(f"{loc}.{msg}" if loc else msg)
        elif msg.startswith(f"{loc}") and loc:
            lines.append(msg + got_s)
        else:
            lines.append(f"{loc or 'config'}: {msg}{got_s}")
    return "invalid config:\n  " + "\n  ".join(lines)


def build_config(tree: dict | None = None) -> TetherConfig:
    """Validate a nested dict into a TetherConfig. Raises ConfigError naming every bad key."""
    try:
        return TetherConfig.model_validate(tree or {})
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TetherConfig:
    """Read a YAML config (optional), apply dotted overrides, validate.

    An override that is the path of a YAML file (``configs/smoke.yaml``, no ``=``) is layered in place:
    its keys replace the ones before it, section by section, as if each were given as ``key=value``.

    Raises:
        ConfigError: a file is missing or not a YAML mapping, an override is malformed, a key is
            unknown (with a did-you-mean) or a value is out of range (naming the key).
    """
    tree: dict = _read_tree(path) if path is not None else {}
    for item in overrides:
        if "=" not in item and item.endswith((".yaml", ".yml")):
            _merge(tree, _read_tree(item))
            continue
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    return build_config(tree)


def _read_tree(path: str | Path) -> dict:
    """A config file's mapping of sections (paths in it checked as :func:`_check_file_relative_paths` says)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
    _check_file_relative_paths(loaded, p)
    return loaded


def _merge(tree: dict, layer: dict) -> None:
    """``layer``'s keys into ``tree``, nested mappings merged key by key, anything else replaced."""
    for k, v in layer.items():
        if isinstance(v, dict) and isinstance(tree.get(k), dict):
            _merge(tree[k], v)
        else:
            tree[k] = copy.deepcopy(v)


#: Config keys that hold a local path (``reward.function``, ``reward.val_function``, ``agent.tools`` (each item),
#: ``agent.environment``, each value of ``agent.environments``: the file part of ``file.py:name``).
PATH_KEYS = (
    "actor.model",
    "ref.model",
    "critic.model",
    "reward.function",
    "reward.model",
    "reward.val_function",
    "reward.val_model",
    "data.train_files",
    "data.val_files",
    "agent.tools",
    "agent.environment",
    "agent.environments",
)


def _path_values(tree: dict, key: str):
    """``(holder, slot, value)`` of each string at ``key`` of a config mapping (each item of a list, as
    ``agent.tools``; each value of a mapping, as ``agent.environments``): ``holder[slot] = ...`` replaces it."""
    section, _, name = key.partition(".")
    holder = tree.get(section)
    value = holder.get(name) if isinstance(holder, dict) else None
    if isinstance(value, str):
        yield holder, name, value
    elif isinstance(value, list):
        yield from ((value, i, v) for i, v in enumerate(value) if isinstance(v, str))
    elif isinstance(value, dict):
        yield from ((value, k, v) for k, v in value.items() if isinstance(v, str))


def _path_part(key: str, value: str) -> str | None:
    if key in ("reward.function", "reward.val_function", "agent.tools", "agent.environment", "agent.environments"):
        target = value.rpartition(":")[0]
        return target if target.endswith(".py") or "/" in target or "\\" in target else None
    return None if value == EMBEDDED else value


def _check_file_relative_paths(tree: dict, config_path: Path) -> None:
    """One rule for relative paths: they are taken from the current directory, in a config file as on
    the command line (so ``configs/gsm8k.yaml`` names ``data/gsm8k/train.parquet`` from the project
    root). A relative path in the file that is missing from the current directory but present next
    to the config file is an error that says so, instead of a "not found" later.

    Raises:
        ConfigError: naming the key, the path as written and the path to write.
    """
    base = config_path.parent
    if base.resolve() == Path.cwd().resolve():
        return
    for key, value in ((k, v) for k in PATH_KEYS for _, _, v in _path_values(tree, k)):
        part = _path_part(key, value)
        if not part or Path(part).expanduser().is_absolute() or Path(part).exists():
            continue
        if (base / part).exists():
            fixed = value.replace(part, str(base / part), 1)
            raise ConfigError(
                f"{key}: {part!r} in {config_path} is not in the current directory ({Path.cwd()}) but is next to the "
                "config file. Relative paths are taken from the current directory, in a config file as on the command "
                f"line: write {fixed!r} or an absolute path"
            )


def resolve_local_paths(tree: dict) -> dict:
    """A copy of a config mapping whose relative local paths (:data:`PATH_KEYS`: model directories,
    data files, the file of ``reward.function``) are absolute, taken from the current directory as
    when the run loaded them. Values that name nothing here (``embedded``, a ``module:name``
    reward, a path that does not exist) are kept as written."""
    out = copy.deepcopy(tree)
    for key, holder, slot, value in ((k, *h) for k in PATH_KEYS for h in _path_values(out, k)):
        part = _path_part(key, value)
        if not part or not Path(part).expanduser().exists():
            continue
        full = os.path.abspath(Path(part).expanduser())
        holder[slot] = full + value[len(part) :] if value.startswith(part) else full
    return out


def config_to_yaml(cfg: TetherConfig) -> str:
    """The run's ``config.yaml``: every key, local paths made absolute (:func:`resolve_local_paths`),
    so ``tether eval RUN`` or a resume works from any directory."""
    return yaml.safe_dump(resolve_local_paths(cfg.to_dict()), sort_keys=False)


def _choices(annotation) -> list:
    """The allowed values of a Literal field (also inside ``X | None`` or a list), else []."""
    from typing import get_args, get_origin

    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    for arg in get_args(annotation):
        found = _choices(arg)
        if found:
            return found
    return []


def describe_config() -> str:
    """Every key with its default and description, for ``tether train --help-config``."""
    lines = []

    def walk(model: type[BaseModel], inst: BaseModel, prefix: str):
        for name, field in model.model_fields.items():
            ann = field.annotation
            val = getattr(inst, name)
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, val, prefix + name + ".")
            else:
                choices = _choices(ann)
                extra = f" [{' | '.join(map(str, choices))}]" if choices else ""
                lines.append(f"{prefix + name:32s} {val!r:>22}  {field.description or ''}{extra}")

    walk(TetherConfig, TetherConfig(), "")
    return "\n".join(lines)
