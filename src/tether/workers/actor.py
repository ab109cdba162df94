"""The actor (policy + optimizer) and the frozen reference policy."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.algos import (
    agg_loss,
    kl_loss,
    kl_to_go,
    kl_to_go_term,
    policy_loss,
    rollout_correction,
)
from tether.batch import RolloutBatch
from tether.models import response_logprobs
from tether.workers.common import (
    LocalDataParallel,
    MetricAccumulator,
    mini_batches,
    optimizer_step,
)
from tether.workers.packing import MicroBatching, check_padding_free
from tether.workers.persist import keep_lrs, load_module, load_policy, save_module, save_policy

#: what the actor's old-logprob pass measures of the teacher with a :class:`DistillSpec` ((B, T) each, into
#: ``distill_out``): the sampled tokens' log-probs, the optimised per-state divergence f, the full KL(π‖π_T) per state
DISTILL_OUT = ("teacher_logprobs", "divergence", "kl_student_teacher")


@dataclass(frozen=True)
class DistillSpec:
    """``distill.estimator`` ∈ :data:`tether.algos.FULL_DISTILL_ESTIMATORS`: the per-state divergence to the teacher
    (:func:`tether.algos.distill_divergence`) and its weight λ in the actor's loss."""

    coef: float  # λ (distill.coef)
    estimator: str  # reverse, forward or jsd
    jsd_beta: float = 0.5  # distill.jsd_beta
    top_k: int | None = None  # distill.top_k; None = the full vocabulary

    def divergence(self, lay, logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """(b, t) f(π(·|s_t), π_T(·|s_t)) on a micro-batch layout (``tether.workers.packing``), nats."""
        return lay.distill_divergence(
            logits,
            teacher_logits,
            estimator=self.estimator,
            jsd_beta=self.jsd_beta,
            top_k=self.top_k,
            temperature=temperature,
        )


@dataclass(frozen=True)
class ActorUpdateSpec:
    """Everything one actor update needs besides the batch (built by the trainer from the config)."""

    ppo_epochs: int
    mini_batch_size: int
    clip_eps_low: float
    clip_eps_high: float
    dual_clip_c: float
    loss_agg_mode: str
    entropy_coef: float
    kl_loss_coef: float  # β for the loss placement; 0 = no KL loss
    kl_loss_estimator: str
    kl_loss_agg_mode: str
    log_ratio_clamp: float
    value_clamp: float | None  # k3's clamp; None = none
    target_kl: float | None  # early stop on policy/approx_kl (guard.target_kl)
    seed: int
    norm_constant: float  # seq-mean-token-sum-norm divisor: the maximum response length, tokens
    # old_logprobs := the update's own log-probs, detached (ratio exactly 1): one epoch and one mini-batch
    # only, where the old policy is the current one; the update then returns them and the entropy, (B, T)
    # in the batch's row order, as "_old_logprobs" and "_entropy" in its result (actor.reuse_update_logprobs)
    reuse_logprobs: bool = False
    # kl.off_policy_correction: "ratio" = each KL-loss token importance-weighted by π_θ/π_old
    # (tether.algos.off_policy_kl_penalty)
    kl_off_policy_correction: str = "ratio"
    # kl.loss_to_go: the KL-to-go term (tether.algos.kl_to_go_term) beside the per-token KL loss
    kl_loss_to_go: bool = False
    # guard.atomic_update: undo a step of several optimizer updates whole when a later mini-batch turns non-finite
    atomic_update: bool = True
    # bypass mode (actor.old_logprobs_source=rollout with algo.rollout_correction): keyword arguments of
    # tether.algos.rollout_correction, applied per micro-batch to π_θ against π_rollout (= π_old); None = off
    bypass_correction: dict | None = None
    # algo.policy_loss: a tether.algos.POLICY_LOSSES name and its hyper-parameters (None = vanilla's from
    # clip_eps_*/dual_clip_c above)
    policy_loss: str = "vanilla"
    policy_loss_hyper: dict | None = None
    # distill.estimator=reverse|forward|jsd: λ·f(π_θ, π_T) per state enters the loss (the per-state part of ∇D; the
    # reward carries the visitation part); None = no such term (k1, or no teacher)
    distill: DistillSpec | None = None


#: the rollout-correction metrics a bypass-mode update reports (π_θ against π_rollout, over its micro-batches)
_BYPASS_METRICS = (
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/masked_frac",
    "rollout_corr/rejected_frac",
    "rollout_corr/truncated_frac",
)


def _forward_logprobs(
    model,
    batch: RolloutBatch,
    micro: MicroBatching | int,
    temperature: float,
    with_entropy: bool,
    full_kl_ref=None,
    compute_dtype: str = "float32",
    dp=None,
    teacher=None,
    distill: DistillSpec | None = None,
    distill_out: dict | None = None,
):
    """No-grad log-probs (and entropy) for the whole batch, micro-batch by micro-batch (``micro``: a
    :class:`~tether.workers.packing.MicroBatching`, or a row count).

    With ``full_kl_ref`` (a ReferenceWorker) also the exact per-token KL(π‖π_ref) over the vocabulary
    and the reference's log-probs, from one reference forward per micro-batch, so that only one
    micro-batch of (b, t, V) logits of each model is alive. With ``teacher`` (a ReferenceWorker holding
    ``distill.teacher``) and ``distill``, likewise one teacher forward per micro-batch fills ``distill_out``
    with (B, T) tensors: ``teacher_logprobs``, ``divergence`` (``distill``'s f per state) and
    ``kl_student_teacher`` (the full-vocabulary KL(π‖π_T) per state).
    Returns (logprobs (B, T), entropy (B, T) or None, kl_full (B, T) or None, ref_logprobs (B, T) or
    None), nats, in the batch's row order.
    """
    micro = micro if isinstance(micro, MicroBatching) else MicroBatching(micro)
    B, T = batch.response_ids.shape
    with_teacher = teacher is not None and distill is not None
    keep = full_kl_ref is not None or with_teacher
    dev = batch.response_ids.device
    names = ("lp", "ent", "kl", "ref") + (DISTILL_OUT if with_teacher else ())
    outs = {k: torch.zeros(B, T, device=dev) for k in names}
    with torch.no_grad():
        for idx, _, lay in micro.split(batch, dp):
            lp, ent, lg = lay.logprobs(
                model,
                temperature=temperature,
                with_entropy=with_entropy,
                return_logits=keep,
                compute_dtype=compute_dtype,
            )
            got = {"lp": lp, "ent": ent}
            if full_kl_ref is not None:
                ref_lg = full_kl_ref.layout_logits(lay).float()
                got["kl"], got["ref"] = (
                    lay.kl_full(lg.float(), ref_lg, temperature),
                    lay.token_logprobs(ref_lg, temperature),
                )
                del ref_lg
            if with_teacher:
                t_lg = teacher.layout_logits(lay).float()
                got["teacher_logprobs"] = lay.token_logprobs(t_lg, temperature)
                got["divergence"] = distill.divergence(lay, lg.float(), t_lg, temperature)
                got["kl_student_teacher"] = (
                    got["divergence"]
                    if distill.estimator == "reverse" and distill.top_k is None
                    else lay.kl_full(lg.float(), t_lg, temperature)
                )
                del t_lg
            for k, v in got.items():
                if v is not None and len(idx):
                    outs[k][idx.to(dev), : lay.t] = v.float()
    if with_teacher and distill_out is not None:
        distill_out.update({k: outs[k] for k in DISTILL_OUT})
    full = full_kl_ref is not None
    return (
        outs["lp"],
        outs["ent"] if with_entropy else None,
        outs["kl"] if full else None,
        outs["ref"] if full else None,
    )


class ReferenceWorker:
    """The frozen reference π_ref: a separate copy, or the actor's own model with its LoRA adapters disabled."""

    def __init__(
        self,
        model=None,
        *,
        adapter_host=None,
        micro_batch_size: int = 64,
        temperature: float = 1.0,
        compute_dtype: str = "float32",
        max_tokens_per_micro_batch: int | None = None,
        padding_free: bool = False,
        share_prompt_prefix: bool = False,
    ):
        if (model is None) == (adapter_host is None):
            raise ValueError("ReferenceWorker needs exactly one of model or adapter_host")
        self.compute_dtype = compute_dtype
        self.model = model
        self.adapter_host = adapter_host
        self.micro_batch_size = micro_batch_size
        # actor.share_prompt_prefix: each distinct prompt of a micro-batch runs once
        self.share_prompt_prefix = share_prompt_prefix
        self.micro = MicroBatching(micro_batch_size, max_tokens_per_micro_batch, padding_free, share_prompt_prefix)
        # a distributed worker sets tether.distributed.DataParallel (equal micro-batch counts)
        self.dp = LocalDataParallel()
        self.temperature = temperature
        if model is not None:
            model.eval()
            model.requires_grad_(False)

    def as_reference(self):
        """The context in which :attr:`module` is π_ref: the LoRA policy's adapters disabled (a separate copy needs
        none)."""
        if self.adapter_host is not None:
            return self.adapter_host.disable_adapter()
        return contextlib.nullcontext()

    @property
    def module(self):
        """The module whose forward (inside :meth:`as_reference`) is π_ref."""
        return self.model if self.model is not None else self.adapter_host

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """ref_logprobs (B, T), nats."""
        with self.as_reference():
            return _forward_logprobs(
                self.module, batch, self.micro, self.temperature, False, compute_dtype=self.compute_dtype, dp=self.dp
            )[0]

    def logits_for(self, ids: torch.Tensor, mask: torch.Tensor, t: int) -> torch.Tensor:
        with torch.no_grad(), self.as_reference():
            return response_logprobs(
                self.module,
                ids,
                mask,
                t,
                temperature=self.temperature,
                return_logits=True,
                compute_dtype=self.compute_dtype,
            )[2]

    def layout_logits(self, lay) -> torch.Tensor:
        """The reference's logits for a micro-batch layout (``tether.workers.packing``): (b, t, V) padded, (N, V)
        packed."""
        with torch.no_grad(), self.as_reference():
            return lay.logprobs(
                self.module, temperature=self.temperature, return_logits=True, compute_dtype=self.compute_dtype
            )[2]

    def reset_to(self, actor_model) -> None:
        """Copy the actor's weights into the reference (ref.reset_every)."""
        if self.model is None:
            raise ValueError("ref.reset_every is not supported with a LoRA adapter-disabled reference")
        self.model.load_state_dict(actor_model.state_dict())

    def save(self, path: Path) -> None:
        """The reference's weights as ``ref.safetensors`` (``ref.reset_every`` moves them; a LoRA reference has none of
        its own)."""
        save_module(self.model, path, shared_tensors=True)

    def load(self, path: Path) -> None:
        """:meth:`save`'s file.

        Raises:
            CheckpointError: the file is missing.
        """
        load_module(self.model, path, "needed with ref.reset_every > 0", shared_tensors=True)


class ActorWorker:
    """Owns the policy π_θ, its AdamW optimizer and LR schedule; computes log-probs and PPO updates."""

    def __init__(
        self,
        model,
        *,
        lr: float,
        weight_decay: float,
        betas,
        warmup_steps: int,
        grad_clip: float,
        micro_batch_size: int,
        temperature: float,
        compute_dtype: str = "float32",
        max_tokens_per_micro_batch: int | None = None,
        padding_free: bool = False,
        share_prompt_prefix: bool = False,
    ):
        self.model = model
        self.compute_dtype = compute_dtype
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        # actor.share_prompt_prefix: each distinct prompt of a micro-batch runs once
        self.share_prompt_prefix = share_prompt_prefix
        # actor.max_tokens_per_micro_batch, actor.padding_free, actor.share_prompt_prefix (the padded layout's forward)
        self.micro = MicroBatching(micro_batch_size, max_tokens_per_micro_batch, padding_free, share_prompt_prefix)
        if padding_free:
            check_padding_free(model, "actor.padding_free")
        self.temperature = temperature
        self.dp = LocalDataParallel()  # a distributed worker sets tether.distributed.DataParallel
        self._loss_gen = None  # clip_cov's random draws, seeded per update
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0
        )

    def compute_logprobs(
        self,
        batch: RolloutBatch,
        *,
        with_entropy: bool = True,
        full_kl_ref: ReferenceWorker | None = None,
        teacher: ReferenceWorker | None = None,
        distill: DistillSpec | None = None,
        distill_out: dict | None = None,
    ):
        """old_logprobs (B, T), entropy (B, T) and, given ``full_kl_ref``, the exact KL (B, T) to it and its
        ref_logprobs (B, T) from the same reference pass; nats. Given ``teacher`` and ``distill``, the teacher's
        log-probs and per-state divergences from one teacher pass into ``distill_out`` (``_forward_logprobs``)."""
        self.model.eval()
        return _forward_logprobs(
            self.model,
            batch,
            self.micro,
            self.temperature,
            with_entropy,
            full_kl_ref,
            self.compute_dtype,
            dp=self.dp,
            teacher=teacher,
            distill=distill,
            distill_out=distill_out,
        )

    def scale_lr(self, factor: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] *= factor
        self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]

    @property
    def model_as_is(self):
        """The policy module (here the same as ``model``: nothing to pull)."""
        return self.model

    def refresh(self) -> None:
        """Nothing: ``model`` is the trained policy itself."""

    def save(self, out: Path, tokenizer) -> None:
        """The policy as a ``save_pretrained`` directory with the tokenizer (LoRA: the adapters)."""
        save_policy(self.model, tokenizer, out)

    def load(self, directory: Path, checkpoint: Path) -> None:
        """:meth:`save`'s directory into the policy.

        Raises:
            CheckpointError: a missing file or weights that do not match, naming ``checkpoint``.
        """
        load_policy(self.model, directory, checkpoint)

    def optimizer_state(self) -> dict:
        """``{"actor": AdamW state, "actor_sched": LR-schedule state}`` (a part of the checkpoint's optim.pt)."""
        return {"actor": self.optimizer.state_dict(), "actor_sched": self.scheduler.state_dict()}

    def load_optimizer_state(self, state: dict, *, schedule: bool = True) -> None:
        """:meth:`optimizer_state`'s; ``schedule=False`` keeps the current learning rates and LR schedule (a
        rollback)."""
        with contextlib.nullcontext() if schedule else keep_lrs(self.optimizer):
            self.optimizer.load_state_dict(state["actor"])
        if schedule:
            self.scheduler.load_state_dict(state["actor_sched"])

    def update(
        self,
        batch: RolloutBatch,
        spec: ActorUpdateSpec,
        step: int,
        ref: ReferenceWorker | None = None,
        teacher: ReferenceWorker | None = None,
    ) -> dict[str, float]:
        """PPO epochs × mini-batches of the clipped surrogate (+ β·KL loss + λ·divergence to the teacher − entropy
        bonus; the teacher's term with ``spec.distill``, from ``teacher``'s logits per micro-batch).

        Gradients are accumulated over micro-batches; ``agg_loss`` gets the mini-batch's token and
        sequence counts so the accumulated loss equals the mini-batch loss exactly. A mini-batch whose
        loss or gradient norm is not finite is not applied (``guard/nonfinite_skip``). When
        ``spec.target_kl`` is set and a mini-batch's approx KL to the rollout policy (measured before
        its update) exceeds it, that mini-batch and the remaining epochs and mini-batches are not
        applied (``guard/early_stop``; Spinning Up's PPO early stop).
        """
        self.model.train()
        acc = MetricAccumulator()
        gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
        # clip_cov's random draws: seeded per step and rank, so a run and its resume draw the same tokens
        self._loss_gen = (
            torch.Generator().manual_seed((spec.seed * 1_000_003 + step) * 7919 + self.dp.rank)
            if spec.policy_loss == "clip_cov"
            else None
        )
        skipped = updates = 0
        early_stop = False
        if spec.reuse_logprobs:
            if spec.ppo_epochs != 1 or spec.mini_batch_size < len(batch):
                raise ValueError(
                    f"reuse_logprobs needs one epoch and one mini-batch per step (ppo_epochs={spec.ppo_epochs}, "
                    f"mini_batch_size={spec.mini_batch_size} < {len(batch)} responses): otherwise the old policy is "
                    "not the current one"
                )
            # filled micro-batch by micro-batch, returned (not written into ``batch``, which a remote role only holds a
            # copy of)
            measured = {"old_logprobs": torch.zeros_like(batch.response_mask, dtype=torch.float32)}
            measured["entropy"] = torch.zeros_like(measured["old_logprobs"])
        # guard.atomic_update: a step of several optimizer updates is undone whole when a later one turns non-finite
        saved = (
            self._snapshot()
            if spec.atomic_update and spec.ppo_epochs * math.ceil(len(batch) / spec.mini_batch_size) > 1
            else None
        )
        for _ in range(spec.ppo_epochs):
            for rows, mini in mini_batches(batch, spec.mini_batch_size, gen, with_index=True):
                # the batch rows of this rank's shard, in its order (the shard's padding rows have none)
                out = (measured, rows[self.dp.shard_rows(mini)]) if spec.reuse_logprobs else None
                metrics, loss_finite = self._mini_batch_step(self.dp.shard(mini), spec, ref, out=out, teacher=teacher)
                metrics, loss_finite = self.dp.reduce(metrics, loss_finite)  # the same decision on every rank
                if spec.target_kl is not None and metrics.get("policy/approx_kl", 0.0) > spec.target_kl:
                    # Spinning Up's early stop: the policy is already too far from the rollout policy,
                    # so neither this mini-batch's update nor the remaining ones are applied
                    self.optimizer.zero_grad(set_to_none=True)
                    acc.add({k: v for k, v in metrics.items() if math.isfinite(v)})
                    early_stop = True
                    break
                if loss_finite:
                    grad_norm, applied = optimizer_step(self.model, self.optimizer, self.scheduler, self.grad_clip)
                else:  # one micro-batch's loss is non-finite: drop the whole mini-batch, finite parts included
                    self.optimizer.zero_grad(set_to_none=True)
                    grad_norm, applied = float("nan"), False
                skipped += int(not applied)
                updates += int(applied)
                metrics["policy/grad_norm"] = grad_norm if math.isfinite(grad_norm) else float("nan")
                acc.add({k: v for k, v in metrics.items() if math.isfinite(v)})
            if early_stop:
                break
        out = acc.mean()
        # part of the step was applied before a mini-batch turned non-finite
        if saved is not None and skipped and updates:
            self._restore(saved)
            out["guard/undone_updates"] = float(updates)
            skipped, updates = skipped + updates, 0
        out["policy/updates"] = float(updates)
        out["guard/nonfinite_skip"] = float(skipped)
        out["guard/nonfinite_weights"] = self._nonfinite_weights() if updates else 0.0
        out["guard/early_stop"] = float(early_stop)
        out["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        if spec.reuse_logprobs:  # each rank measured its own rows: every rank's, in the batch's order
            out["_old_logprobs"], out["_entropy"] = (
                self.dp.merge_rows(measured["old_logprobs"]),
                self.dp.merge_rows(measured["entropy"]),
            )
        return out

    def _snapshot(self) -> dict:
        """Host copies of the trainable weights and their AdamW state (this rank's shards) and the LR schedule's
        state: 3x the trainable parameters in host memory while the step runs (guard.atomic_update)."""

        def host(x):
            local = x.to_local() if hasattr(x, "to_local") else x  # a DTensor shard: this rank's part
            return local.detach().to("cpu", copy=True) if isinstance(local, torch.Tensor) else x

        params = [p for p in self.model.parameters() if p.requires_grad]
        with torch.no_grad():
            weights = [host(p) for p in params]
            state = [{k: host(v) for k, v in self.optimizer.state.get(p, {}).items()} for p in params]
        return {
            "weights": weights,
            "state": state,
            "scheduler": self.scheduler.state_dict(),
            "lrs": [g["lr"] for g in self.optimizer.param_groups],
        }

    def _restore(self, saved: dict) -> None:
        """Put :meth:`_snapshot`'s values back in place (the step's applied updates undone; tensors keep their type,
        DTensor shards included)."""

        def local(x):
            return x.to_local() if hasattr(x, "to_local") else x

        params = [p for p in self.model.parameters() if p.requires_grad]
        with torch.no_grad():
            for p, w, st in zip(params, saved["weights"], saved["state"], strict=True):
                local(p).copy_(w)
                if not st:  # the step created this parameter's state: the next update starts it afresh
                    self.optimizer.state.pop(p, None)
                    continue
                for k, v in st.items():
                    cur = self.optimizer.state[p][k]
                    if isinstance(cur, torch.Tensor):
                        local(cur).copy_(v)
                    else:
                        self.optimizer.state[p][k] = v
        self.scheduler.load_state_dict(saved["scheduler"])
        for g, lr in zip(self.optimizer.param_groups, saved["lrs"], strict=True):  # what the undone scheduler steps set
            g["lr"] = lr

    def _nonfinite_weights(self) -> float:
        """Non-finite entries of the trainable weights after an update, over every rank (each counts its shards)."""
        with torch.no_grad():
            n = sum(
                int((~torch.isfinite(p.to_local() if hasattr(p, "to_local") else p)).sum())
                for p in self.model.parameters()
                if p.requires_grad
            )
        counts, _ = self.dp.reduce({"n": float(n)}, True)
        return counts["n"]

    def _mini_batch_step(
        self, mini: RolloutBatch, spec: ActorUpdateSpec, ref: ReferenceWorker | None, out=None, teacher=None
    ):
        """Forward/backward of one mini-batch, micro-batch by micro-batch; returns (metric sums, all losses finite).

        With ``out = (measured, rows)`` (``spec.reuse_logprobs``) each micro-batch's own log-probs, detached,
        are its old log-probs, and they and the entropy are written to ``measured["old_logprobs"]`` and
        ``measured["entropy"]`` (B, T) at ``rows``, the batch rows of ``mini``'s real rows (its trailing
        data-parallel padding rows are not written).
        """
        # the whole mini-batch's, over all ranks, less the tokens rollout correction rejected (batch.loss_mask)
        total_tokens, total_seqs = self.dp.loss_counts(mini, mini.update_mask)
        sums: dict[str, float] = {}
        finite = True
        need_logits = spec.kl_loss_coef > 0 and spec.kl_loss_estimator == "full"
        if spec.distill is not None and teacher is None:
            raise ValueError(f"distill.estimator={spec.distill.estimator} needs the teacher's logits: pass teacher=")
        need_student_logits = need_logits or spec.distill is not None
        # spec.entropy_coef is this step's α (algo.entropy_target moves it between steps): at α = 0 the bonus has no
        # gradient
        with_entropy = spec.entropy_coef > 0 or out is not None

        def add(key: str, value: float) -> None:
            sums[key] = sums.get(key, 0.0) + value

        # tether.workers.packing: row-count or token-budget, padded or packed
        for idx, mb, lay in self.micro.split(mini, self.dp):
            t = lay.t
            lp, ent, logits = lay.logprobs(
                self.model,
                temperature=self.temperature,
                with_entropy=with_entropy,
                return_logits=need_student_logits,
                compute_dtype=self.compute_dtype,
            )
            rmask = mb.update_mask[:, :t]
            if out is not None:
                old = lp.detach()
                measured, rows = out
                keep = idx < len(rows)  # the shard's trailing data-parallel padding rows have no batch row
                if bool(keep.any()):
                    at = rows[idx[keep]].to(old.device)
                    measured["old_logprobs"][at, :t] = old[keep.to(old.device)].float()
                    measured["entropy"][at, :t] = ent.detach()[keep.to(old.device)].float()
            else:
                old = mb.old_logprobs[:, :t]
            # rollout correction: the trainer's weights π_old/π_rollout (batch.is_weights), or in bypass mode the 0/1
            # mask/rejection factors of π_θ against π_rollout = π_old, measured on this micro-batch
            weights = mb.is_weights[:, :t] if mb.is_weights is not None else None
            corr_metrics: dict[str, float] = {}
            if spec.bypass_correction is not None and bool(rmask.any()):
                weights, _, corr_metrics = rollout_correction(
                    lp.detach(), old, rmask, apply_truncation=False, **spec.bypass_correction
                )
            kl_weights = weights  # the KL term keeps every token: the entropy mask weighs the policy loss only
            # algo.top_entropy_quantile: the step's highest-entropy tokens (batch.entropy_mask)
            if mb.entropy_mask is not None:
                keep = mb.entropy_mask[:, :t].to(device=lp.device, dtype=torch.float32)
                weights = keep if weights is None else weights * keep
            hyper = spec.policy_loss_hyper
            if hyper is None:
                hyper = dict(
                    clip_eps_low=spec.clip_eps_low, clip_eps_high=spec.clip_eps_high, dual_clip_c=spec.dual_clip_c
                )
            pg_loss, pg_metrics = policy_loss(
                spec.policy_loss,
                lp,
                old,
                mb.advantages[:, :t],
                rmask,
                agg_mode=spec.loss_agg_mode,
                total_tokens=total_tokens,
                total_seqs=total_seqs,
                norm_constant=spec.norm_constant,
                log_ratio_clamp=spec.log_ratio_clamp,
                weights=weights,
                generator=self._loss_gen,
                **hyper,
            )
            loss = pg_loss
            if spec.kl_loss_coef > 0:
                if need_logits:  # the exact KL at each visited state: no token to reweight
                    kl = lay.kl_full(logits, ref.layout_logits(lay), temperature=self.temperature)
                    if spec.kl_loss_to_go:  # the later states' exact KLs, E[k1_u | s_u], as the KL to go
                        kl = kl + kl_to_go_term(
                            lp,
                            kl_to_go(kl.detach(), rmask),
                            rmask,
                            old_logprobs=old if spec.kl_off_policy_correction == "ratio" else None,
                            is_log_ratio_clamp=spec.log_ratio_clamp,
                        )
                    kl_term = agg_loss(
                        kl,
                        rmask,
                        spec.kl_loss_agg_mode,
                        total_tokens=total_tokens,
                        total_seqs=total_seqs,
                        norm_constant=spec.norm_constant,
                    )
                else:  # importance-weighted by π_θ/π_old (kl.off_policy_correction=ratio) and the rollout weights
                    kl_term, _ = kl_loss(
                        lp,
                        mb.ref_logprobs[:, :t],
                        rmask,
                        spec.kl_loss_estimator,
                        old_logprobs=old if spec.kl_off_policy_correction == "ratio" else None,
                        weights=kl_weights,
                        agg_mode=spec.kl_loss_agg_mode,
                        total_tokens=total_tokens,
                        total_seqs=total_seqs,
                        norm_constant=spec.norm_constant,
                        log_ratio_clamp=spec.log_ratio_clamp,
                        value_clamp=spec.value_clamp,
                        is_log_ratio_clamp=spec.log_ratio_clamp,
                        to_go=spec.kl_loss_to_go,
                    )
                loss = loss + spec.kl_loss_coef * kl_term
                add("actor/kl_loss", float(kl_term.detach()))
            if spec.distill is not None:
                # the per-state part of ∇D: f(π_θ(·|s_t), π_T(·|s_t)) at the visited states, aggregated as the policy
                # loss is so that it and the reward's visitation part are weighted alike (tether.algos.distill)
                f = spec.distill.divergence(lay, logits, teacher.layout_logits(lay), self.temperature)
                d_term = agg_loss(
                    f,
                    rmask,
                    spec.loss_agg_mode,
                    total_tokens=total_tokens,
                    total_seqs=total_seqs,
                    norm_constant=spec.norm_constant,
                )
                loss = loss + spec.distill.coef * d_term
                add("actor/distill_loss", float(d_term.detach()))
            if spec.entropy_coef > 0:
                loss = loss - spec.entropy_coef * agg_loss(
                    ent,
                    rmask,
                    spec.loss_agg_mode,
                    total_tokens=total_tokens,
                    total_seqs=total_seqs,
                    norm_constant=spec.norm_constant,
                )
            if not torch.isfinite(loss):
                finite = False
                self.dp.skip_backward(loss)  # a sharded rank still joins the backward's collectives
                continue
            loss.backward()
            # partial losses sum to the mini-batch loss; fractions are weighted by the micro-batch's token share
            add("policy/pg_loss", float(pg_loss.detach()))
            add("policy/loss", float(loss.detach()))
            share = float(rmask.sum()) / max(total_tokens, 1.0)
            # clipfrac, approx_kl and the mode's own (seq-ratio spread, covariance selection)
            for key, value in pg_metrics.items():
                if key != "policy/pg_loss":
                    add(key, value * share)
            for key in _BYPASS_METRICS:  # bypass mode: π_θ against the engine, token-share weighted over the update
                if key in corr_metrics:
                    add(key, corr_metrics[key] * share)
        return sums, finite
