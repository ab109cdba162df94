"""The critic: V(s_t) for GAE, trained with the clipped value loss."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from tether.algos import ppo_value_loss
from tether.batch import RolloutBatch
from tether.models import ValueModel
from tether.workers.common import (
    LocalDataParallel,
    MetricAccumulator,
    mini_batches,
    optimizer_step,
)
from tether.workers.packing import MicroBatching, check_padding_free
from tether.workers.persist import keep_lrs, load_module, save_module


class CriticWorker:
    """Owns the value model and its optimizer."""

    def __init__(
        self,
        model: ValueModel,
        *,
        lr: float,
        grad_clip: float,
        micro_batch_size: int,
        value_clip: float,
        norm_constant: float,
        max_tokens_per_micro_batch: int | None = None,
        padding_free: bool = False,
        share_prompt_prefix: bool = False,
    ):
        self.model = model
        self.norm_constant = norm_constant  # seq-mean-token-sum-norm divisor (the maximum response length)
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        # actor.share_prompt_prefix: each distinct prompt of a micro-batch runs once
        self.share_prompt_prefix = share_prompt_prefix
        # critic.max_tokens_per_micro_batch, critic.padding_free, actor.share_prompt_prefix (the padded layout's
        # forward)
        self.micro = MicroBatching(micro_batch_size, max_tokens_per_micro_batch, padding_free, share_prompt_prefix)
        if padding_free:
            check_padding_free(model, "critic.padding_free")
        self.value_clip = value_clip
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        self.scheduler = None
        self.dp = LocalDataParallel()  # a distributed worker sets tether.distributed.DataParallel

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """(B, T) V(s_t) under the current critic, 0 on masked positions."""
        self.model.eval()
        out = torch.zeros(batch.response_ids.shape, device=batch.response_ids.device)
        with torch.no_grad():
            for idx, _, lay in self.micro.split(batch, self.dp):
                if len(idx):
                    out[idx.to(out.device), : lay.t] = lay.values(self.model)
        return out * batch.response_mask

    def scale_lr(self, factor: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] *= factor

    def save(self, path: Path) -> None:
        """The value model's weights as ``critic.safetensors``."""
        save_module(self.model, path)

    def load(self, path: Path) -> None:
        """:meth:`save`'s file.

        Raises:
            CheckpointError: the file is missing.
        """
        load_module(self.model, path, "was it saved without algo.adv_estimator=gae?")

    def optimizer_state(self) -> dict:
        """``{"critic": AdamW state}`` (a part of the checkpoint's optim.pt)."""
        return {"critic": self.optimizer.state_dict()}

    def load_optimizer_state(self, state: dict, *, schedule: bool = True) -> None:
        """:meth:`optimizer_state`'s; ``schedule=False`` keeps the current learning rate (a rollback)."""
        with contextlib.nullcontext() if schedule else keep_lrs(self.optimizer):
            self.optimizer.load_state_dict(state["critic"])

    def update(
        self, batch: RolloutBatch, *, ppo_epochs: int, mini_batch_size: int, agg_mode: str, seed: int, step: int
    ) -> dict[str, float]:
        """Clipped value-loss regression of V onto the GAE returns; non-finite updates are dropped."""
        self.model.train()
        acc = MetricAccumulator()
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 7)
        skipped = 0
        for _ in range(ppo_epochs):
            for mini in mini_batches(batch, mini_batch_size, gen):
                mini = self.dp.shard(mini)  # this rank's rows (all of them locally)
                # the whole mini-batch's, over all ranks, of the model's tokens (an observation is not an action)
                total_tokens, total_seqs = self.dp.loss_counts(mini, mini.action_mask)
                sums = {"value/loss": 0.0, "value/clipfrac": 0.0}
                finite = True
                for _, mb, lay in self.micro.split(mini, self.dp):  # tether.workers.packing
                    t = lay.t
                    v = lay.values(self.model)
                    rmask = mb.action_mask[:, :t]
                    loss, m = ppo_value_loss(
                        v,
                        mb.values[:, :t],
                        mb.returns[:, :t],
                        rmask,
                        clip_range=self.value_clip,
                        agg_mode=agg_mode,
                        total_tokens=total_tokens,
                        total_seqs=total_seqs,
                        norm_constant=self.norm_constant,
                    )
                    if not torch.isfinite(loss):
                        finite = False
                        self.dp.skip_backward(loss)  # a sharded rank still joins the backward's collectives
                        continue
                    loss.backward()
                    sums["value/loss"] += float(loss.detach())
                    sums["value/clipfrac"] += m["value/clipfrac"] * float(rmask.sum()) / max(total_tokens, 1.0)
                sums, finite = self.dp.reduce(sums, finite)  # the same decision on every rank
                if finite:
                    grad_norm, applied = optimizer_step(self.model, self.optimizer, self.scheduler, self.grad_clip)
                else:  # one micro-batch's loss is non-finite: drop the whole mini-batch, as the actor does
                    self.optimizer.zero_grad(set_to_none=True)
                    grad_norm, applied = float("nan"), False
                sums["value/grad_norm"] = grad_norm
                skipped += int(not applied)
                acc.add({k: v for k, v in sums.items() if math.isfinite(v)})
        return acc.mean() | {"guard/value_nonfinite_skip": float(skipped)}
