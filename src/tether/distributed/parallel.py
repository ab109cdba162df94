"""Parallelism as transforms over an unchanged model (torchtitan's ``parallelize`` / ``apply_fsdp`` style).

The model file knows nothing of sharding: :func:`parallelize` applies, in a fixed order,
tensor parallelism (:func:`apply_tp`: DTensor ``parallelize_module`` on the tp sub-mesh),
activation checkpointing (:func:`apply_ac`) and FSDP2 (:func:`apply_fsdp`: ``fully_shard`` per
transformer block, then the root, on the dp sub-mesh) to a model built exactly as the local backend
builds it. The degrees live in one place, :class:`ParallelDims`, which checks them against the
world size and the model's shape and builds the (dp_shard, tp) mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tether.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of one worker group: data parallelism (FSDP2) ``dp_shard`` × tensor
    parallelism ``tp`` (Megatron-style column/row splits, torchtitan's ``ParallelDims``).

    Ranks are laid out tp-fastest: rank r is dp rank r // tp, tp rank r % tp, so the ranks of one
    tensor-parallel group are neighbours (on a GPU node: the same node's NVLink).

    Raises:
        ValueError: a degree below 1, or degrees whose product is not the world size (naming all three).
    """

    dp_shard: int
    world_size: int
    tp: int = 1

    def __post_init__(self):
        if min(self.dp_shard, self.world_size, self.tp) < 1:
            raise ValueError(
                f"parallel degrees must be >= 1, got dp_shard={self.dp_shard}, tp={self.tp}, "
                f"world_size={self.world_size}"
            )
        if self.dp_shard * self.tp != self.world_size:
            raise ValueError(
                f"dp_shard={self.dp_shard} x tp={self.tp} must multiply to the world size {self.world_size}"
            )

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1) -> ParallelDims:
        """dp_shard = world_size / tp.

        Raises:
            ValueError: tp does not divide the world size (naming both).
        """
        if tp < 1 or world_size % tp:
            raise ValueError(
                f"tp_size={tp} must divide the worker group's world size {world_size} (dp = world size / tp_size)"
            )
        return cls(dp_shard=world_size // tp, world_size=world_size, tp=tp)

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def check_model(self, config, role: str = "actor") -> None:
        """The model's attention splits ``tp`` ways: whole query and KV heads per rank (the
        column-split q/k/v projections). The vocabulary need not divide (DTensor shards it as
        ``torch.chunk`` does).

        Args:
            config: a Hugging Face ``PretrainedConfig`` (Qwen2 / Llama family).
        Raises:
            tether.config.ConfigError: a count not divisible by tp, naming the count and ``{role}.tp_size``.
        """
        if self.tp == 1:
            return

        counts = {
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        }
        bad = [f"{k}={v}" for k, v in counts.items() if v % self.tp]
        if bad:
            raise ConfigError(
                f"{role}.tp_size={self.tp} must divide the model's {', '.join(bad)} (tensor parallelism gives each "
                "rank whole attention heads)"
            )

    def build_mesh(self, device_type: str):
        """The (dp_shard, tp) DeviceMesh over the default process group (1-D (dp_shard,) when tp = 1);
        ``mesh["dp_shard"]`` and ``mesh["tp"]`` are its sub-meshes."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.tp == 1:
            return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
        return init_device_mesh(device_type, (self.dp_shard, self.tp), mesh_dim_names=("dp_shard", "tp"))


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
            param_dtype=DTYPES[self.param_dtype] if self.param_dtype else None,
            reduce_dtype=DTYPES[self.reduce_dtype],
            output_dtype=None,
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
        raise ValueError(
            f"{type(model).__name__}: no transformer blocks found (no _no_split_modules); cannot shard it per block"
        )
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
        # pinning needs an accelerator
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def _tp_plan(model: nn.Module) -> tuple[nn.Module, dict]:
    """(the decoder (the module holding ``embed_tokens`` and ``layers``), its layer plan)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    decoder = next((m for m in model.modules() if hasattr(m, "embed_tokens") and hasattr(m, "layers")), None)
    if decoder is None:
        raise ValueError(
            f"{type(model).__name__}: no decoder with embed_tokens and layers; tensor parallelism knows "
            "Qwen2/Llama-style models only"
        )
    # vocabulary-parallel embedding
    plan = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    layer = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    return decoder, {"plan": plan, "layer": layer}


def apply_tp(model: nn.Module, tp_mesh, src_data_rank: int | None = 0) -> nn.Module:
    """Megatron-style tensor parallelism with PyTorch's ``parallelize_module`` over a Qwen2/Llama model:
    attention q/k/v and MLP gate/up split column-wise (by output features: whole heads per rank),
    o and down row-wise (their outputs all-reduced), the token embedding vocabulary-parallel
    (row-wise over the vocabulary, outputs all-reduced) and the LM head vocabulary-parallel: its
    logits stay a DTensor sharded on the vocabulary, (B, T, V / tp) per rank, which the
    vocabulary-parallel log-softmax (:mod:`tether.models.vocab_parallel`) consumes without
    gathering. Norms stay replicated. Tied embeddings stay tied (both are sharded on the vocabulary).
    A value-head model (the critic) is split the same way, its value head replicated.

    ``src_data_rank`` is ``parallelize_module``'s: 0 (default) scatters tp rank 0's weights to the
    group, a collective that a rank holding a meta-device model skips (so ranks that differ in
    that must all pass None); None keeps each rank's own slice, with no communication (for
    weights loaded afterwards, as ``RankWorker`` does with ``broadcast_from_rank0``).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    decoder, plans = _tp_plan(model)
    owner = next((m for m in model.modules() if isinstance(getattr(m, "lm_head", None), nn.Linear)), None)
    tied = owner is not None and owner.lm_head.weight is decoder.embed_tokens.weight
    parallelize_module(decoder, tp_mesh, plans["plan"], src_data_rank=src_data_rank)
    for block in decoder.layers:
        parallelize_module(block, tp_mesh, plans["layer"], src_data_rank=src_data_rank)
    if owner is not None:  # a causal LM (the critic's ValueModel has none)
        lm_head = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        parallelize_module(owner, tp_mesh, lm_head, src_data_rank=src_data_rank)
        if tied:
            owner.lm_head.weight = decoder.embed_tokens.weight  # the same (vocab, hidden) Shard(0) layout
    return model


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    settings: FSDPSettings,
    device_type: str = "cpu",
    mesh=None,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Tensor parallelism (tp > 1; ``src_data_rank`` as :func:`apply_tp`'s), activation
    checkpointing (optional), then FSDP2 on the dp sub-mesh, over ``model`` in place; returns it."""
    mesh = mesh if mesh is not None else dims.build_mesh(device_type)
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], src_data_rank=src_data_rank)
        mesh = mesh["dp_shard"]
    if settings.activation_checkpointing:
        apply_ac(model)
    return apply_fsdp(model, mesh, settings)
