"""Helpers shared by the workers: batching, optimizer steps with finiteness checks."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator

import torch

from tether.algos import loss_normalizers
from tether.batch import RolloutBatch


def mini_batches(batch: RolloutBatch, size: int, generator: torch.Generator, *, with_index: bool = False) -> Iterator:
    """Shuffled mini-batches of ``size`` responses (the last may be smaller); with ``with_index``,
    (row indices (b,) into ``batch``, mini-batch) pairs."""
    perm = torch.randperm(len(batch), generator=generator)
    for start in range(0, len(batch), size):
        rows = perm[start : start + size]
        yield (rows, batch.select(rows)) if with_index else batch.select(rows)


def micro_batches(batch: RolloutBatch, size: int) -> Iterator[RolloutBatch]:
    """Consecutive micro-batches of ``size`` responses, for gradient accumulation or no-grad passes."""
    for start in range(0, len(batch), size):
        yield batch.select(list(range(start, min(start + size, len(batch)))))


def trim(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """input_ids, attention_mask (B, P+T') and T' with trailing all-padding response columns removed."""
    lengths = batch.response_mask.sum(-1)
    t = int(lengths.max().item()) if len(lengths) else 0
    t = max(t, 1)
    ids = torch.cat([batch.prompt_ids, batch.response_ids[:, :t]], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask[:, :t]], dim=1)
    return ids, mask, t


def pad_to(x: torch.Tensor, t: int, value: float = 0.0) -> torch.Tensor:
    """Right-pad (B, T') to (B, t)."""
    if x.shape[1] == t:
        return x
    return torch.nn.functional.pad(x, (0, t - x.shape[1]), value=value)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` (L2) that also takes DTensor gradients on different device
    meshes, as tensor parallelism + FSDP2 leave them: the split projections on the 2-D (dp_shard, tp)
    mesh, the replicated norms on the 1-D dp_shard mesh. The norm is computed per mesh (each reduced
    over its own mesh: every element counted once), then combined, ‖g‖ = √(Σ_mesh ‖g_mesh‖²); every
    rank enters the same reductions in the same (parameter) order. Returns the norm before clipping
    (a float, the same on every rank); gradients are scaled in place by min(1, max_norm / (‖g‖ + 1e-6)).
    """
    grads = [p.grad for p in params if p.grad is not None]
    groups: list[tuple[object, list[torch.Tensor]]] = []  # (device mesh or None, its gradients), first-seen order
    for g in grads:
        mesh = getattr(g, "device_mesh", None)
        for m, gs in groups:
            if m == mesh:
                gs.append(g)
                break
        else:
            groups.append((mesh, [g]))
    if len(groups) <= 1:  # one mesh (FSDP2 only) or plain tensors: torch's own
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    norms = []
    for _, gs in groups:
        n = torch.nn.utils.get_total_norm(gs, 2.0)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)  # reduced over that mesh
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's clip_grads_with_norm_
    for g in grads:  # on the local shards: a plain-tensor factor times a DTensor is not scaled reliably
        (g.to_local() if hasattr(g, "to_local") else g).mul_(coef.to(g.device))
    return float(total)


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, max_norm: float
) -> tuple[float, bool]:
    """Clip gradients and step, unless the gradient norm is non-finite (then the update is dropped).

    Returns:
        (grad_norm before clipping, whether the step was applied).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = clip_grad_norm(params, max_norm)
    applied = math.isfinite(grad_norm)
    if applied:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, applied


class LocalDataParallel:
    """The data-parallel hooks of a worker that runs alone (world size 1): every one is the identity.

    A distributed worker replaces ``worker.dp`` with ``tether.distributed.DataParallel``, whose hooks
    take this rank's share of each mini-batch, all-reduce the loss normalisers (N valid tokens, S
    sequences) across ranks before the backward, and reduce the mini-batch's metrics; the actor's and
    critic's math does not change.
    """

    world_size = 1
    rank = 0

    def shard(self, mini: RolloutBatch) -> RolloutBatch:
        """This rank's rows of a mini-batch (all of them)."""
        return mini

    def shard_rows(self, mini: RolloutBatch) -> list[int]:
        """Positions in ``mini`` of the real rows of :meth:`shard`'s result, in the shard's order (all of them)."""
        return list(range(len(mini)))

    def merge_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A per-row tensor (B, ...) this rank filled at its own rows, zeros elsewhere, completed with
        every rank's rows (unchanged here: this rank has them all)."""
        return x

    def loss_counts(self, mini: RolloutBatch, mask: torch.Tensor | None = None) -> tuple[float, float]:
        """(total_tokens, total_seqs) of the mini-batch for ``agg_loss``, tokens and responses, counted on ``mask``
        (B, T) (default ``mini.response_mask``; the actor passes ``mini.update_mask``, less rejected tokens)."""
        tokens, seqs = loss_normalizers(mini.response_mask if mask is None else mask)
        return float(tokens), float(seqs)

    def reduce(self, metrics: dict[str, float], finite: bool) -> tuple[dict[str, float], bool]:
        """The mini-batch's metrics and loss finiteness over all ranks (unchanged here)."""
        return metrics, finite

    def skip_backward(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss is not finite and its backward is skipped (the mini-batch is dropped)."""

    def micro_batch_count(self, n: int) -> int:
        """The number of micro-batches every rank runs, given this rank's ``n`` (token-budget
        micro-batches differ in count by rank; FSDP2 needs the same on all): ``n`` here."""
        return n


class MetricAccumulator:
    """Averages metric dicts over mini-batches."""

    def __init__(self):
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.sums[k] += float(v)
            self.counts[k] += 1

    def mean(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}
