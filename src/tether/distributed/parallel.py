"""Parallelism as transforms over an unchanged model (torchtitan's ``parallelize`` / ``apply_fsdp`` style).

The model file knows nothing of sharding: :func:`parallelize` applies, in a fixed order,
activation checkpointing (:func:`apply_ac`) and FSDP2 (:func:`apply_fsdp`: ``fully_shard`` per
transformer block, then the root) to a model built exactly as the local backend builds it. The
degrees live in one place, :class:`ParallelDims`, which checks them against the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of one worker group. Only data parallelism (FSDP) today: ``dp_shard``.

    Raises:
        ValueError: a degree below 1, or degrees whose product is not the world size (naming both).
    """

    dp_shard: int
    world_size: int

    def __post_init__(self):
        if self.dp_shard < 1 or self.world_size < 1:
            raise ValueError(f"parallel degrees must be >= 1, got dp_shard={self.dp_shard}, world_size={self.world_size}")
        if self.dp_shard != self.world_size:
            raise ValueError(f"dp_shard={self.dp_shard} must multiply to the world size {self.world_size}")

    def build_mesh(self, device_type: str):
        """The (dp_shard,) DeviceMesh over the default process group."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))


@dataclass(frozen=True)
class FSDPSettings:
    """How FSDP2 shards one model (from ``trainer.fsdp``).

    param_dtype: the dtype parameters are all-gathered in for forward/backward (bf16 for compute);
        the sharded parameters, their gradients and AdamW's moments stay in the dtype the model was
        loaded in (fp32 master weights when ``actor.dtype=float32``).
    reduce_dtype: the dtype of the gradient reduce-scatter (fp32).
    cpu_offload: keep the sharded parameters, gradients and optimizer state on the CPU.
    activation_checkpointing: recompute each transformer block's activations in the backward.
    reshard_after_forward: free the all-gathered parameters after each block's forward (ZeRO-3);
        false keeps them to the backward (ZeRO-2, more memory, fewer all-gathers).
    """

    param_dtype: str | None = None
    reduce_dtype: str = "float32"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True

    def mixed_precision(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=DTYPES[self.param_dtype] if self.param_dtype else None, reduce_dtype=DTYPES[self.reduce_dtype], output_dtype=None
        )


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face model (also under a peft wrapper or a value head):
    the modules whose class is named in a ``PreTrainedModel``'s ``_no_split_modules``, outermost
    first. Each becomes one FSDP unit.

    Raises:
        ValueError: no such module (the model declares no ``_no_split_modules``).
    """
    names: set[str] = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no transformer blocks found (no _no_split_modules); cannot shard it per block")
    return blocks


def apply_ac(model: nn.Module) -> None:
    """Activation checkpointing per transformer block (Hugging Face's, the same as the local backend's
    ``actor.gradient_checkpointing``), with the non-reentrant implementation FSDP2 needs."""
    target = model
    while not hasattr(target, "gradient_checkpointing_enable") and hasattr(target, "backbone"):
        target = target.backbone  # the critic's ValueModel
    if not hasattr(target, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(model).__name__} has no gradient_checkpointing_enable; cannot checkpoint activations")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(model: nn.Module, mesh, settings: FSDPSettings) -> nn.Module:
    """``fully_shard`` each transformer block, then the root (which takes the embeddings, final
    norm, LM or value head). Gradients are reduce-scattered as sums, not FSDP's default average: the
    workers' losses are already normalised by the global token and sequence counts
    (``tether.distributed.DataParallel.loss_counts``), so the summed gradient is the global one.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    kwargs = dict(mesh=mesh, mp_policy=settings.mixed_precision(), reshard_after_forward=settings.reshard_after_forward)
    if settings.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinning needs an accelerator
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def parallelize(model: nn.Module, dims: ParallelDims, settings: FSDPSettings, device_type: str = "cpu", mesh=None) -> nn.Module:
    """Activation checkpointing (optional), then FSDP2, over ``model`` in place; returns it."""
    if settings.activation_checkpointing:
        apply_ac(model)
    return apply_fsdp(model, mesh if mesh is not None else dims.build_mesh(device_type), settings)
