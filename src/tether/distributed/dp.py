"""Splitting a batch across data-parallel ranks by tokens, and the workers' data-parallel hooks.

A rank's FSDP2 model all-gathers its parameters in every forward, so every rank must run the same
number of forwards (and backwards): shards are padded to the same number of rows with copies of a
row whose ``response_mask`` is 0 (no loss, no count, no gradient), and the padding is dropped again
before results leave the rank.
"""

from __future__ import annotations

import torch

from tether.algos import loss_normalizers
from tether.batch import RolloutBatch

PAD_KEY = "dp_padding"  # RolloutBatch.extra: how many trailing rows of a shard are padding


def row_tokens(batch: RolloutBatch) -> torch.Tensor:
    """(B,) the tokens a forward over each row processes: real prompt tokens + counted response tokens."""
    return batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)


def balanced_partition(tokens: list[int], n: int) -> list[list[int]]:
    """Row indices for each of ``n`` ranks, balanced by token count rather than row count.

    Greedy longest-processing-time: rows in decreasing token order go to the rank with the fewest
    tokens so far (ties: fewer rows, then the lower rank), so the heaviest rank carries at most 4/3
    of the optimum (Graham 1969). Deterministic; each rank's indices are in increasing order, so a
    rank sees its rows in the batch's order.
    """
    if n < 1:
        raise ValueError(f"need at least one rank, got {n}")
    loads = [0] * n
    parts: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        r = min(range(n), key=lambda r: (loads[r], len(parts[r]), r))
        parts[r].append(i)
        loads[r] += int(tokens[i])
    return [sorted(p) for p in parts]


def pad_rows(batch: RolloutBatch, idx: list[int], rows: int, filler: int = 0) -> RolloutBatch:
    """``batch.select(idx)`` padded to ``rows`` rows with copies of row ``filler`` whose response_mask is 0.

    The shard's ``extra`` is its own dict with ``extra[PAD_KEY]`` = the number of padding rows.
    """
    pad = rows - len(idx)
    shard = batch.select(list(idx) + [filler] * pad)
    if pad:
        shard.response_mask = shard.response_mask.clone()
        shard.response_mask[len(idx) :] = 0
    shard.extra = dict(batch.extra) | {PAD_KEY: pad}
    return shard


def split_batch(batch: RolloutBatch, n: int) -> tuple[list[RolloutBatch], list[list[int]]]:
    """The batch as ``n`` token-balanced shards of equal row count (padded), and each shard's real rows."""
    parts = balanced_partition(row_tokens(batch).tolist(), n)
    rows = max(1, max(len(p) for p in parts))
    return [pad_rows(batch, p, rows) for p in parts], parts


def gather_rows(outputs: list[torch.Tensor], parts: list[list[int]]) -> torch.Tensor:
    """Per-rank outputs (rows_r, ...) back in the batch's original row order (padding rows dropped)."""
    n = sum(len(p) for p in parts)
    first = outputs[0]
    out = first.new_zeros((n, *first.shape[1:]))
    for o, p in zip(outputs, parts, strict=True):
        if p:
            out[torch.as_tensor(p)] = o[: len(p)].to(out.dtype)
    return out


def real_rows(shard: RolloutBatch) -> int:
    """Rows of a shard that are not padding."""
    return len(shard) - int(shard.extra.get(PAD_KEY, 0))


class DataParallel:
    """The data-parallel hooks of a worker in a process group (see ``tether.workers.common.LocalDataParallel``).

    Every rank receives the whole batch for an update and draws the same mini-batch permutation, so
    the mini-batches are those of a single process; :meth:`shard` takes this rank's token-balanced
    share of each, :meth:`loss_counts` all-reduces the valid tokens N and sequences S of the real
    rows before the backward (FSDP sums the gradients: ``apply_fsdp``), and :meth:`reduce` sums the
    mini-batch's metrics (each rank's is its share of the global value) and agrees on finiteness.
    """

    def __init__(self, rank: int, world_size: int, group=None):
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def shard(self, mini: RolloutBatch) -> RolloutBatch:
        shards, _ = split_batch(mini, self.world_size)
        return shards[self.rank]

    def shard_rows(self, mini: RolloutBatch) -> list[int]:
        """Positions in ``mini`` of :meth:`shard`'s real rows, in the shard's order (its padding rows follow them)."""
        return balanced_partition(row_tokens(mini).tolist(), self.world_size)[self.rank]

    def merge_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, ...) filled by each rank at its own rows (zeros elsewhere): the whole tensor, on every rank.

        An all-reduce sum over the data-parallel group, exact because every row is non-zero on one
        rank only (the rows are partitioned; tp ranks of one dp rank hold the same rows and are not
        summed). ``x`` must be on a device the group's backend reduces (CPU for gloo)."""
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=self.group)
        return x

    def loss_counts(self, mini: RolloutBatch, mask: torch.Tensor | None = None) -> tuple[float, float]:
        import torch.distributed as dist

        tokens, seqs = loss_normalizers((mini.response_mask if mask is None else mask)[: real_rows(mini)])
        t = torch.tensor([float(tokens), float(seqs)], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t[0]), float(t[1])

    def skip_backward(self, loss: torch.Tensor) -> None:
        """A non-finite loss on this rank: run the backward anyway (of 0·loss, whose gradients are
        discarded with the dropped mini-batch), or the other ranks would wait forever in its
        reduce-scatters."""
        (loss * 0.0).backward()

    def micro_batch_count(self, n: int) -> int:
        """The largest micro-batch count over the ranks (a rank with fewer runs empty micro-batches)."""
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    def reduce(self, metrics: dict[str, float], finite: bool) -> tuple[dict[str, float], bool]:
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (metrics, bool(finite)), group=self.group)
        keys = sorted({k for m, _ in gathered for k in m})
        return {k: sum(m.get(k, 0.0) for m, _ in gathered) for k in keys}, all(f for _, f in gathered)
