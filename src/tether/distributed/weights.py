"""Streaming the actor's weights from its FSDP2 shards to vLLM replicas (``trainer.backend=ray``,
``rollout.engine=vllm``).

Weight sync (:func:`stream_weights`, run by every rank of the actor group after each update): the
FSDP2 parameters are all-gathered one tensor at a time (``DTensor.full_tensor``, a collective in the
same order on every rank), LoRA adapters merged as they come (``W + scaling · B @ A``), and rank 0
packs them into buckets of at most ``rollout.vllm.sync_bucket_mib`` (never splitting a transformer
block, so vLLM's fused layers get all of their parts in one bucket), puts each bucket in Ray's
object store once and sends it to every replica, waiting for the previous bucket's acknowledgement
before sending the next: a rank holds at most one gathered tensor and one bucket, never a full copy
of the model. The replica feeds the buckets to one ``reload_weights`` call through a queue
(tensor-parallel replicas, whose workers are other processes, load each bucket by its own call).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator

import torch

__all__ = ["iter_full_weights", "stream_weights", "weight_buckets"]

_BLOCK = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


def _block_of(name: str) -> int | None:
    m = _BLOCK.search("." + name)
    return int(m.group(1)) if m else None


def weight_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``max_bytes`` bytes, consuming the
    iterator lazily. A bucket is closed before a tensor that would overflow it, except that the
    tensors of one transformer block (``...layers.<i>.``) are never split across buckets (so a
    block larger than ``max_bytes`` makes one larger bucket). Tensors outside any block (embeddings,
    final norm, LM head) fill buckets by size alone."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size, block = 0, None
    for name, t in weights:
        b = _block_of(name)
        nbytes = t.numel() * t.element_size()
        same_block = b is not None and b == block
        if bucket and size + nbytes > max_bytes and not same_block:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
        block = b
    if bucket:
        yield bucket


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (an all-gather over its mesh; every rank must call it), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def iter_full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """An FSDP2-sharded (or plain) model's weights under Hugging Face checkpoint names, gathered one
    tensor at a time (every rank of the mesh must iterate in step: each ``full_tensor`` is a
    collective), detached; the same names and values as
    :func:`tether.rollout.vllm.iter_hf_named_weights` of the unsharded model.

    A peft LoRA model: base names (no ``base_model.model.`` prefix, no ``.base_layer``), each adapted
    linear weight yielded as ``W + Σ_a scaling_a · B_a @ A_a`` (peft's ``Linear.get_delta_weight``;
    transposed for ``fan_in_fan_out``) once its adapters have been gathered; adapter tensors are not
    yielded. At most one base weight and its adapters are held gathered at a time.

    Raises:
        ValueError: a DoRA adapter (its magnitude vector changes the merge; not supported).
    """
    if not hasattr(model, "peft_config"):
        for k, v in model.state_dict().items():
            yield k, _full(v).detach()
        return
    inner = model.get_base_model()
    adapted = {}
    for name, mod in inner.named_modules():
        if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
            active = [a for a in getattr(mod, "active_adapters", []) if a in mod.lora_A]
            if any(getattr(mod, "use_dora", {}).get(a) for a in active):
                raise ValueError(
                    f"weight sync to vLLM: {name} is a DoRA adapter, which is not supported (use plain LoRA)"
                )
            if active and not getattr(mod, "merged", False):
                adapted[name] = (mod, active)
    pending: dict[str, dict] = {}  # module -> gathered base weight and adapter tensors, until complete
    for key, v in inner.state_dict().items():
        t = _full(v).detach()
        if "modules_to_save" in key:
            continue
        owner = (
            key.split(".base_layer.")[0] if ".base_layer." in key else re.sub(r"\.lora_[AB]\.[^.]+\.weight$", "", key)
        )
        if owner in adapted and (key.endswith(".base_layer.weight") or ".lora_" in key):
            mod, active = adapted[owner]
            parts = pending.setdefault(owner, {})
            parts[key] = t
            need = {f"{owner}.base_layer.weight"} | {f"{owner}.lora_{ab}.{a}.weight" for a in active for ab in "AB"}
            if need <= parts.keys():
                w = parts[f"{owner}.base_layer.weight"]
                for a in active:
                    delta = parts[f"{owner}.lora_B.{a}.weight"].float() @ parts[f"{owner}.lora_A.{a}.weight"].float()
                    delta = delta.T if getattr(mod, "fan_in_fan_out", False) else delta
                    w = w + (delta * mod.scaling[a]).to(w.dtype)
                del pending[owner]
                yield f"{owner}.weight", w
            continue
        if ".lora_" in key:
            continue
        yield key.replace(".base_layer.", "."), t


def stream_weights(model: torch.nn.Module, rank: int, replicas: list, bucket_bytes: int) -> dict:
    """Send ``model``'s full weights to every replica, bucket by bucket (see the module docstring).

    Every rank of the model's process group calls this (the gathers are collectives); only
    ``rank`` 0 sends. Returns (rank 0; zeros elsewhere) ``{"bytes": bytes sent per replica,
    "tensors": tensors sent, "buckets": buckets, "gather_s": seconds in the all-gathers,
    "send_s": seconds waiting for the replicas, "path": the replicas' loading way}``.

    Raises:
        ray.exceptions.RayTaskError: a replica failed to load a bucket (wrapping its RuntimeError,
            which chains vLLM's error); the driver's WorkerGroup reports it naming the rank.
    """
    import ray

    stats = {"bytes": 0.0, "tensors": 0.0, "buckets": 0.0, "gather_s": 0.0, "send_s": 0.0}
    if rank == 0:
        ray.get([r.begin_sync.remote() for r in replicas])
    in_flight: list = []

    def timed_weights():
        it = iter_full_weights(model)
        while True:
            t0 = time.perf_counter()
            try:
                name, t = next(it)
            except StopIteration:
                return
            t = t.cpu() if rank == 0 else t  # a CPU copy only where it is sent
            stats["gather_s"] += time.perf_counter() - t0
            yield name, t

    for bucket in weight_buckets(timed_weights(), bucket_bytes):
        if rank != 0:
            continue
        t0 = time.perf_counter()
        ray.get(in_flight)  # the previous bucket is queued on every replica: its memory can go
        ref = ray.put(bucket)
        in_flight = [r.push.remote(ref) for r in replicas]
        stats["send_s"] += time.perf_counter() - t0
        stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
        stats["tensors"] += len(bucket)
        stats["buckets"] += 1
        del bucket, ref
    if rank == 0:
        t0 = time.perf_counter()
        ray.get(in_flight)
        paths = ray.get([r.end_sync.remote() for r in replicas])
        stats["send_s"] += time.perf_counter() - t0
        stats["path"] = paths[0]
    return stats
