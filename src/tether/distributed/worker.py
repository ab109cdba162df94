"""One data-parallel rank of a worker group: the same role classes as the local backend, FSDP2-sharded.

:class:`RankWorker` builds, on its rank, the models of the roles it hosts (actor + reference, and/or
critic), applies :func:`tether.distributed.parallel.parallelize` to each, wraps them in the local
backend's :class:`~tether.workers.ActorWorker` / :class:`~tether.workers.ReferenceWorker` /
:class:`~tether.workers.CriticWorker` and gives those the :class:`~tether.distributed.dp.DataParallel`
hooks. Every public method declares how the driver dispatches to it (:func:`register`). The class is
plain Python: the Ray backend runs it as a Ray actor, the tests also in ``torch.multiprocessing``
processes.
"""

from __future__ import annotations

import os
from dataclasses import fields, replace

import torch

from tether.batch import RolloutBatch
from tether.config import EXACT_TEACHER
from tether.distributed.dp import DataParallel, real_rows
from tether.distributed.parallel import FSDPSettings, ParallelDims, parallelize
from tether.distributed.weights import stream_weights
from tether.models import load_tokenizer, resolve_model_path
from tether.workers.actor import DISTILL_OUT
from tether.workers.build import (
    actor_worker,
    assemble_critic,
    assemble_policy,
    assemble_teacher,
    critic_worker,
    distill_spec,
    reference_worker,
)

#: Dispatch modes. DP_SPLIT: the batch (first argument) is split across ranks by tokens and the
#: per-row results come back in the batch's order. ALL: every rank gets the same arguments (a
#: collective: an update, a checkpoint) and rank 0's result is returned.
DP_SPLIT, ALL = "dp_split", "all"


def register(mode: str):
    """Declare beside a worker method how the driver calls it (verl's ``@register``, two modes)."""

    def mark(fn):
        fn.dispatch_mode = mode
        return fn

    return mark


def batch_to(batch: RolloutBatch, device) -> RolloutBatch:
    """The batch with every tensor field on ``device``."""
    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return replace(batch, **moved)


def fsdp_settings(cfg) -> FSDPSettings:
    f = cfg.trainer.fsdp
    return FSDPSettings(
        param_dtype=f.param_dtype,
        reduce_dtype=f.reduce_dtype,
        cpu_offload=f.cpu_offload,
        activation_checkpointing=f.activation_checkpointing or cfg.actor.gradient_checkpointing,
        reshard_after_forward=f.reshard_after_forward,
    )


class RankWorker:
    """The roles of one rank. ``roles`` ⊆ {"actor", "critic"}; "actor" brings the reference with it, and the teacher
    of ``distill.teacher=DIR``.

    With ``actor.tp_size`` = tp > 1 the group's ranks form a (world_size / tp) × tp mesh
    (:class:`ParallelDims`): rank r is data-parallel rank r // tp, and the tp ranks of one dp rank
    receive the same shard of a batch (the driver's :class:`~tether.distributed.ray_backend.WorkerGroup`
    sends it to each) and return the same results.

    Args:
        cfg: the run's TetherConfig.
        rank, world_size: this rank in its worker group's process group.
        master_addr, master_port: the group's rendezvous (rank 0's host).
        roles: which roles this group hosts.
        lora_state: the driver's initial LoRA adapter weights (so every rank starts from the
            driver's adapters), or None.
    """

    def __init__(
        self, cfg, rank: int, world_size: int, master_addr: str, master_port: int, roles=("actor",), lora_state=None
    ):
        import torch.distributed as dist

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.role_names = tuple(roles)
        threads = cfg.trainer.threads or (1 if cfg.actor.model == "embedded" else 0)
        if threads:
            torch.set_num_threads(threads)
        use_gpu = cfg.trainer.n_gpus_per_node > 0
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_gpu else "gloo", rank=rank, world_size=world_size)
        self.dims = ParallelDims.from_world(world_size, cfg.actor.tp_size)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.settings = fsdp_settings(cfg)
        # the tp ranks of one dp rank see the same rows; the loss normalisers and metrics reduce over dp only
        dp_group = self.mesh["dp_shard"].get_group() if self.dims.tp > 1 else None
        self.dp = DataParallel(self.dims.dp_rank(rank), self.dims.dp_shard, group=dp_group)
        self.actor = self.ref = self.critic = self.teacher = self.tokenizer = None
        if "actor" in self.role_names:
            self._build_actor(lora_state)
        if "critic" in self.role_names:
            self._build_critic()

    # ------------------------------------------------------------------ building
    def _on_meta(self) -> bool:
        """Ranks other than 0 build their models on the meta device (no memory) and get the weights
        from rank 0 once sharded: only rank 0 ever holds a whole model."""
        return self.rank != 0

    @property
    def _load_device(self) -> torch.device:
        """Where :func:`tether.workers.build.assemble_policy` loads this rank's models: rank 0 on the CPU (sharded
        onto ``self.device`` by :meth:`_parallelize`), the others on the meta device."""
        return torch.device("meta") if self._on_meta() else torch.device("cpu")

    def _parallelize(self, model):
        """Tensor parallelism (actor.tp_size > 1; its head counts checked first) and FSDP2 over ``model``; a
        meta-device model is then materialised and every rank takes rank 0's
        weights (``set_model_state_dict(..., broadcast_from_rank0=True)``) and buffers (rotary tables)."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        config = next(m.config for m in model.modules() if hasattr(m, "config"))
        self.dims.check_model(config, "actor")
        meta = any(p.is_meta for p in model.parameters())
        full = {} if meta else model.state_dict()
        # rank 0 holds real weights, the others meta tensors: tensor parallelism must not scatter rank 0's
        # (a collective the meta ranks skip, so they hung in the broadcast below); the broadcast sets them all
        src = None if self.world_size > 1 else 0
        model = parallelize(
            model if meta else model.to(self.device),
            self.dims,
            self.settings,
            self.device.type,
            mesh=self.mesh,
            src_data_rank=src,
        )
        if self.world_size > 1:
            if meta:
                model.to_empty(device=self.device)
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            for buf in model.buffers():
                dist.broadcast(buf, src=0)
        return model

    @property
    def _share_prefix(self) -> bool:
        """actor.share_prompt_prefix on one rank, as the local backend. On several: the ordinary pass, since FSDP2
        needs the
        same forward calls (and so collectives) on every rank, and whether a shard repeats a prompt is each rank's own
        (a
        mismatch aborts gloo)."""
        return self.cfg.actor.share_prompt_prefix and self.world_size == 1

    def _build_actor(self, lora_state) -> None:
        """The actor and reference roles of this rank, by the factory the local backend uses (``tether.workers.build``):
        the models assembled by its one recipe (every check included) on the CPU (rank 0) or the meta device (the
        others), then sharded (:meth:`_parallelize`)."""
        cfg, share = self.cfg, self._share_prefix
        models = assemble_policy(cfg, self.device, load_device=self._load_device, lora_state=lora_state)
        self.tokenizer = models.tokenizer
        model = self._parallelize(models.policy)
        if models.lora:
            self.ref = reference_worker(cfg, adapter_host=model, share_prompt_prefix=share)
        else:
            self.ref = reference_worker(cfg, self._parallelize(models.reference), share_prompt_prefix=share)
        self.actor = actor_worker(cfg, model, share_prompt_prefix=share)
        self.actor.dp = self.ref.dp = self.dp  # equal micro-batch counts on every rank (token budgets)
        if cfg.distill.teacher not in (None, EXACT_TEACHER):  # a model directory: placed as the reference is
            path = resolve_model_path(cfg.distill.teacher, "distill.teacher")  # the driver checked its tokenizer
            teacher = assemble_teacher(cfg, self.device, path, load_device=self._load_device)
            self.teacher = reference_worker(cfg, self._parallelize(teacher), share_prompt_prefix=share)
            self.teacher.dp = self.dp

    def _build_critic(self) -> None:
        tokenizer = self.tokenizer or load_tokenizer(
            resolve_model_path(self.cfg.actor.model, "actor.model", task=self.cfg.data.embedded_task),
            trust_remote_code=self.cfg.actor.trust_remote_code,
        )
        vm = assemble_critic(self.cfg, self.device, tokenizer=tokenizer, load_device=self._load_device)
        self.critic = critic_worker(self.cfg, self._parallelize(vm), share_prompt_prefix=self._share_prefix)
        self.critic.dp = self.dp

    def _role(self, name: str):
        role = getattr(self, name)
        if role is None:
            raise ValueError(f"this worker group hosts {self.role_names}, not {name}")
        return role

    # ------------------------------------------------------------------ no-grad passes (split by tokens)
    @register(DP_SPLIT)
    def compute_logprobs(
        self, shard: RolloutBatch, with_entropy: bool = True, full_kl: bool = False, distill: bool = False
    ):
        """The actor's (old_logprobs, entropy, kl_full, ref_logprobs) for this rank's shard (see
        ``ActorWorker.compute_logprobs``); padding rows removed, on the CPU. With ``distill`` (``distill.estimator``
        reverse, forward or jsd) the teacher's pass in the same micro-batches adds (teacher_logprobs, divergence,
        kl_student_teacher) to the tuple (``tether.workers.actor.DISTILL_OUT``)."""
        n = real_rows(shard)
        got: dict = {}
        out = self.actor.compute_logprobs(
            batch_to(shard, self.device),
            with_entropy=with_entropy,
            full_kl_ref=self.ref if full_kl else None,
            teacher=self._role("teacher") if distill else None,
            distill=distill_spec(self.cfg) if distill else None,
            distill_out=got,
        )
        out = (*out, *(got[k] for k in DISTILL_OUT)) if distill else out
        return tuple(None if x is None else x[:n].cpu() for x in out)

    @register(DP_SPLIT)
    def ref_logprobs(self, shard: RolloutBatch) -> torch.Tensor:
        """ref_logprobs (rows, T), nats."""
        return self._role("ref").compute_logprobs(batch_to(shard, self.device))[: real_rows(shard)].cpu()

    @register(DP_SPLIT)
    def teacher_logprobs(self, shard: RolloutBatch) -> torch.Tensor:
        """teacher_logprobs (rows, T) of ``distill.teacher``, nats (at rollout.temperature, as the reference's)."""
        return self._role("teacher").compute_logprobs(batch_to(shard, self.device))[: real_rows(shard)].cpu()

    @register(DP_SPLIT)
    def compute_values(self, shard: RolloutBatch) -> torch.Tensor:
        """V(s_t) (rows, T)."""
        return self._role("critic").compute_values(batch_to(shard, self.device))[: real_rows(shard)].cpu()

    # ------------------------------------------------------------------ updates (the whole batch on every rank)
    @register(ALL)
    def update_actor(self, batch: RolloutBatch, spec, step: int) -> dict[str, float]:
        """``ActorWorker.update``: every rank draws the same mini-batches and trains on its share of each.
        With ``spec.reuse_logprobs`` its ``_old_logprobs`` / ``_entropy`` (B, T) hold every rank's rows
        in the batch's order (``DataParallel.merge_rows``), on the CPU."""
        teacher = self._role("teacher") if spec.distill is not None else None  # the full estimators' loss term
        out = self._role("actor").update(batch_to(batch, self.device), spec, step, ref=self.ref, teacher=teacher)
        return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    @register(ALL)
    def update_critic(self, batch: RolloutBatch, kwargs: dict) -> dict[str, float]:
        return self._role("critic").update(batch_to(batch, self.device), **kwargs)

    @register(ALL)
    def scale_lr(self, role: str, factor: float) -> float:
        """Multiply a role's learning rates by ``factor``; returns the new first-group LR."""
        worker = self._role(role)
        worker.scale_lr(factor)
        return worker.optimizer.param_groups[0]["lr"]

    @register(ALL)
    def lr(self, role: str) -> float:
        return self._role(role).optimizer.param_groups[0]["lr"]

    @register(ALL)
    def reset_ref(self) -> None:
        """ref.reset_every: the reference takes the actor's weights, shard by shard (same layout)."""
        if self.ref.model is None:
            raise ValueError("ref.reset_every is not supported with a LoRA adapter-disabled reference")
        self.ref.model.load_state_dict(self.actor.model.state_dict())

    # ------------------------------------------------------------------ weights for the driver
    @register(ALL)
    def full_state(self, role: str = "actor", trainable_only: bool = True) -> dict[str, torch.Tensor] | None:
        """The unsharded parameters of a role (CPU): the trainable ones, or the whole state dict. On
        rank 0; None elsewhere. A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        model = self._role(role).model
        if trainable_only and not self.settings.cpu_offload:  # gather only what trains (LoRA: the adapters)
            out = {}
            for name, p in model.named_parameters():
                if p.requires_grad:
                    full = p.full_tensor() if hasattr(p, "full_tensor") else p  # a collective, same order on every rank
                    if self.rank == 0:
                        out[name] = full.detach().cpu()
            return out if self.rank == 0 else None
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        if not trainable_only:
            return state
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in trainable}

    @register(ALL)
    def push_weights(self, replicas: list, bucket_bytes: int) -> dict:
        """Stream the actor's full weights to the vLLM replicas, one gathered tensor at a time
        (:func:`tether.distributed.weights.stream_weights`; a collective, rank 0 sends)."""
        return stream_weights(self._role("actor").model, self.rank, replicas, bucket_bytes)

    # ------------------------------------------------------------------ sharded checkpoints (DCP)
    def _dcp_state(self, with_ref: bool) -> dict:
        """{role: {"model": sharded state dict, "optim": sharded optimizer state dict}} of the hosted roles."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        state = {}
        for name in ("actor", "critic"):
            worker = getattr(self, name)
            if worker is not None:
                model_sd, optim_sd = get_state_dict(worker.model, worker.optimizer)
                state[name] = {"model": model_sd, "optim": optim_sd}
        if with_ref and self.ref is not None and self.ref.model is not None:
            state["ref"] = {"model": get_model_state_dict(self.ref.model)}
        return state

    @register(ALL)
    def save_checkpoint(self, path: str, with_ref: bool = False) -> list[str]:
        """Write the hosted roles' sharded weights and optimizer states to ``path`` with
        torch.distributed.checkpoint (one file per rank + .metadata), and rank 0's LR-scheduler
        states to ``path/schedulers.pt``. Returns the roles written."""
        import torch.distributed.checkpoint as dcp

        state = self._dcp_state(with_ref)
        dcp.save(state, checkpoint_id=path)
        if self.rank == 0:
            scheds = {
                n: getattr(self, n).scheduler.state_dict()
                for n in ("actor", "critic")
                if getattr(self, n) is not None and getattr(self, n).scheduler
            }
            torch.save(scheds, os.path.join(path, "schedulers.pt"))
        return sorted(state)

    @register(ALL)
    def load_checkpoint(self, path: str, with_ref: bool = False, schedule: bool = True) -> None:
        """Load what :meth:`save_checkpoint` wrote, resharded to this world size. With
        ``schedule=False`` (rollback) the current learning rates and LR schedules are kept."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = self._dcp_state(with_ref)
        lrs = {n: [g["lr"] for g in getattr(self, n).optimizer.param_groups] for n in ("actor", "critic") if n in state}
        dcp.load(state, checkpoint_id=path)
        for name in ("actor", "critic"):
            if name in state:
                worker = getattr(self, name)
                set_state_dict(
                    worker.model,
                    worker.optimizer,
                    model_state_dict=state[name]["model"],
                    optim_state_dict=state[name]["optim"],
                )
        if "ref" in state:
            set_model_state_dict(self.ref.model, state["ref"]["model"])
        scheds = torch.load(os.path.join(path, "schedulers.pt"), weights_only=True)
        for name in lrs:
            worker = getattr(self, name)
            if schedule and worker.scheduler is not None and name in scheds:
                worker.scheduler.load_state_dict(scheds[name])
            elif not schedule:
                for g, lr in zip(worker.optimizer.param_groups, lrs[name], strict=True):
                    g["lr"] = lr

    @register(ALL)
    def memory_stats(self) -> dict[str, float]:
        """Peak device memory of this rank (GiB; CUDA only, else empty) and its process's peak RSS (GiB)."""
        import resource

        out = {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        if self.device.type == "cuda":
            out["device_peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        """This rank's process id (to find, or kill, the process of a rank)."""
        return os.getpid()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
