"""Log-probs, entropy and the exact KL on vocabulary shards, without gathering the (B, T, V) logits.

Under tensor parallelism (:func:`tether.distributed.parallel.apply_tp`) the LM head's logits are a
DTensor sharded on the vocabulary: each of the tp ranks holds (B, T, V / tp). The log-softmax over
the whole vocabulary is rebuilt from per-shard reductions (Megatron-LM's vocabulary-parallel
cross-entropy, Shoeybi et al. 2019, §3): all-reduce the max over tp ranks (for stability; it cancels
exactly), then the sum of exp; the target token's logit comes from the one rank whose shard holds it
(zero on the others, summed). Entropy and KL(π‖π_ref) are sums over the vocabulary, so each rank sums
its shard and the partial sums are all-reduced.

Autograd follows Megatron's conjugate pair: :class:`_ReduceFromShards` (forward all-reduce, backward
identity) where per-shard partial sums become a replicated value, :class:`_CopyToShards` (forward
identity, backward all-reduce) where a replicated value re-enters per-shard computation. Every tp rank
computes the same (replicated) loss, and the gradient each rank gets for its logit shard is that
shard's slice of the full gradient.

The functions here take either plain tensors (then they are :mod:`tether.algos`' own) or vocabulary-
sharded DTensors, so callers need not know how the model is laid out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from tether import algos


class _ReduceFromShards(torch.autograd.Function):
    """Sum over the tp group; the backward passes the (replicated) gradient through unchanged."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToShards(torch.autograd.Function):
    """Identity; the backward sums the per-shard gradients over the tp group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def is_vocab_sharded(logits) -> bool:
    """Whether ``logits`` is a DTensor sharded on its last (vocabulary) dimension over a 1-D mesh."""
    return isinstance(logits, DTensor) and tuple(logits.placements) == (Shard(logits.ndim - 1),)


def _shard_of(logits: DTensor) -> tuple[torch.Tensor, object, int]:
    """(local logits (..., V_r), the tp process group, the first vocabulary id of this shard).

    DTensor's ``Shard`` splits as ``torch.chunk`` does: ranks hold ⌈V / tp⌉ ids each, the last ones
    fewer when tp does not divide V (the embedded model's V = 15 over tp = 2: 8 + 7).
    """
    mesh = logits.device_mesh
    chunk = -(-logits.shape[-1] // mesh.size())
    return logits.to_local(), mesh.get_group(), min(mesh.get_local_rank() * chunk, logits.shape[-1])


def _lse(z: torch.Tensor, group) -> torch.Tensor:
    """(N,) log Σ_v exp z_v over the whole vocabulary, from (N, V / tp) shards."""
    m = z.detach().max(-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # log-sum-exp is shift-invariant: no gradient needed
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = _ReduceFromShards.apply(torch.exp(z - m[:, None]).sum(-1), group)
    return m + torch.log(s)


def sharded_logprobs_and_entropy(
    logits: DTensor, ids: torch.Tensor, temperature: float = 1.0, *, with_entropy: bool = True
):
    """:func:`tether.algos.logprobs_and_entropy_from_logits` on vocabulary-sharded logits.

    Args:
        logits: (B, T, V) DTensor sharded on V over the tp mesh (each rank holds (B, T, V / tp), rounded as
            torch.chunk).
        ids: (B, T) token ids in [0, V), the same on every tp rank.
        temperature: τ > 0; logits are divided by τ first.
    Returns:
        (logprobs (B, T), entropy (B, T) or None), nats, float32, replicated over the tp ranks and
        differentiable with respect to the logits.
    Raises:
        ValueError: bad shapes, τ ≤ 0.
    """
    local, group, start = _shard_of(logits)
    if tuple(ids.shape) != tuple(local.shape[:-1]):
        raise ValueError(f"ids {tuple(ids.shape)} must match the logits' leading shape {tuple(local.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead, vl = ids.shape, local.shape[-1]
    z = local.reshape(-1, vl).float() / temperature  # (N, V / tp)
    lse = _lse(z, group)  # (N,)
    idx = ids.reshape(-1).to(z.device) - start
    owned = (idx >= 0) & (idx < vl)
    tgt = torch.where(owned, z.gather(-1, idx.clamp(0, vl - 1)[:, None])[:, 0], torch.zeros_like(lse))
    logprobs = (_ReduceFromShards.apply(tgt, group) - lse).reshape(lead)
    if not with_entropy:
        return logprobs, None
    lp = z - _CopyToShards.apply(lse, group)[:, None]  # (N, V / tp) log π
    p = torch.exp(lp)
    plogp = (p * torch.where(p > 0, lp, torch.zeros_like(lp))).sum(-1)  # 0 · log 0 = 0, with finite gradients at -inf
    entropy = -_ReduceFromShards.apply(plogp, group)
    return logprobs, entropy.reshape(lead)


def sharded_kl_full(logits: DTensor, ref_logits: DTensor, temperature: float = 1.0) -> torch.Tensor:
    """:func:`tether.algos.kl_full` on vocabulary-sharded logits: (B, T) KL(π ‖ π_ref) = Σ_v π_v (log π_v − log
    π_ref,v),
    nats per token, float32, replicated over tp ranks, differentiable with respect to both.

    Raises:
        ValueError: shapes or shardings differ, τ ≤ 0.
    """
    if tuple(logits.shape) != tuple(ref_logits.shape) or logits.device_mesh != ref_logits.device_mesh:
        raise ValueError(
            f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} must have the same shape and mesh"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    local, group, _ = _shard_of(logits)
    ref_local, _, _ = _shard_of(ref_logits)
    lead, vl = local.shape[:-1], local.shape[-1]
    z = local.reshape(-1, vl).float() / temperature
    zr = ref_local.reshape(-1, vl).float() / temperature
    lp = z - _CopyToShards.apply(_lse(z, group), group)[:, None]
    lq = zr - _CopyToShards.apply(_lse(zr, group), group)[:, None]
    p = torch.exp(lp)
    part = (p * torch.where(p > 0, lp - lq, torch.zeros_like(lp))).sum(-1)  # 0 · log 0 = 0, finite gradients
    return _ReduceFromShards.apply(part, group).reshape(lead)


# ---------------------------------------------------------------------- layout-agnostic entry points
def logprobs_and_entropy(logits, ids: torch.Tensor, temperature: float = 1.0, *, with_entropy: bool = True):
    """(logprobs (B, T), entropy (B, T) or None) in nats from (B, T, V) logits, plain or vocabulary-sharded."""
    if is_vocab_sharded(logits):
        return sharded_logprobs_and_entropy(logits, ids, temperature, with_entropy=with_entropy)
    return algos.logprobs_and_entropy_from_logits(logits, ids, temperature, with_entropy=with_entropy)


def logprobs_from_logits(logits, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(B, T) log π(ids) in nats from (B, T, V) logits, plain or vocabulary-sharded."""
    return logprobs_and_entropy(logits, ids, temperature, with_entropy=False)[0]


def kl_full(logits, ref_logits, temperature: float = 1.0) -> torch.Tensor:
    """(B, T) exact KL(π ‖ π_ref) in nats per token from (B, T, V) logits, plain or vocabulary-sharded."""
    if is_vocab_sharded(logits):
        return sharded_kl_full(logits, ref_logits, temperature)
    return algos.kl_full(logits, ref_logits, temperature=temperature)
