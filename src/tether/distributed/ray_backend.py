"""``trainer.backend=ray``: worker groups of Ray actors on placement groups, driven by the unchanged Trainer.

The driver keeps ``Trainer.train_step`` as it is: rollout, reward and all the pure math (KL,
advantages, controllers) stay in the driver process, and the roles it calls (``roles.actor``,
``roles.ref``, ``roles.critic``) are the driver-side stand-ins below, which forward each call to a
:class:`WorkerGroup`: N Ray actors (:class:`~tether.distributed.worker.RankWorker`), one bundle of a
placement group each, owning one ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).
How a call is split across the ranks is declared beside the worker method (``@register``).

The driver also keeps one full copy of the actor (``roles.actor.model``) for HF rollouts and
validation; after every update it takes the updated trainable weights from the actor group. With
``rollout.engine=vllm`` the rollouts run on vLLM replicas as Ray actors instead
(:mod:`tether.distributed.rollout_workers`), their weights streamed from the actor group's shards,
and the driver's copy is pulled only when something on the driver reads it (:class:`RemoteActor`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from contextlib import suppress

import torch

from tether.batch import RolloutBatch
from tether.config import ConfigError
from tether.distributed.dp import gather_rows, split_batch
from tether.distributed.worker import ALL, DP_SPLIT, RankWorker

log = logging.getLogger("tether")


class WorkerDiedError(RuntimeError):
    """A Ray worker of a role died or failed; the message names the role's worker group and the rank."""


def death_cause(e: BaseException, limit: int = 300) -> str:
    """What ``ray.get`` said of a dead actor, in one line: the error its ``__init__`` raised (an
    ``ActorDiedError`` of a failed creation task carries the whole remote traceback in its message,
    and Ray's worker logs do not reach the driver), else Ray's account of the death (killed by
    ``ray.kill``, the worker process exited, ...) cut to ``limit`` characters, else the type."""
    msg = str(getattr(e, "error_msg", "") or "")
    lines = [line.strip() for line in msg.splitlines() if line.strip()]
    if getattr(e, "actor_init_failed", False) and lines:
        return f"its __init__ raised {lines[-1]}"  # the remote traceback's last line: 'module.Error: message'
    fields = ("class_name:", "actor_id:", "pid:", "name:", "namespace:", "ip:")
    text = " ".join(line for line in lines if not line.startswith(fields) and "died unexpectedly before finishing" not in line)
    if not text:
        return type(e).__name__
    return f"{type(e).__name__}: {text[:limit]}{'…' if len(text) > limit else ''}"


def failure_text(cause: BaseException, limit: int = 500) -> str:
    """A worker's error in one line. A ``CheckpointException`` (torch.distributed.checkpoint: a sharded
    save or load that failed on some ranks) is given as each rank's own exception, e.g.
    ``OSError: [Errno 28] No space left on device``, which its text buries at the end of one
    traceback per rank."""
    failures = getattr(cause, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, f in sorted(failures.items()):
            exc = f[0] if isinstance(f, tuple) else f
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return f"{type(cause).__name__} ({'; '.join(parts)})"[:limit]
    return f"{type(cause).__name__}: {cause}"


def world_size(cfg) -> int:
    """Ranks per worker group: ``trainer.n_workers``, or one per GPU (nnodes × n_gpus_per_node) when left at 1."""
    t = cfg.trainer
    if t.n_gpus_per_node and t.n_workers == 1:
        return t.nnodes * t.n_gpus_per_node
    return t.n_workers


def colocated_vllm(cfg) -> bool:
    """vLLM replicas share the actor group's bundles (``rollout.engine=vllm``, ``trainer.placement=colocate``)."""
    return cfg.rollout.engine == "vllm" and cfg.trainer.placement == "colocate"


RAY_INSTALL_HINT = "pip install -e '.[ray]' (or `make install-ray`)"


def check_ray_installed() -> None:
    """trainer.backend=ray needs the ``ray`` extra; checked before any model loads.

    Raises:
        ConfigError: ray is not importable, naming the extra to install.
    """
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError(f"trainer.backend=ray needs Ray, which is not installed: {RAY_INSTALL_HINT}") from None


class RayCluster:
    """Attach to a running Ray (``trainer.ray_address``, or one this process already joined) or start a
    local one; :meth:`close` shuts down only a Ray that this object started."""

    def __init__(self, address: str | None, num_cpus_needed: int):
        import ray

        self.started = False
        if ray.is_initialized():
            return
        if address:
            try:
                ray.init(address=address, log_to_driver=False)
            except (ConnectionError, TimeoutError) as e:  # Ray raises ConnectionError after its own retries
                raise ConfigError(f"trainer.ray_address={address!r}: cannot connect to a Ray cluster there ({e}); "
                                  "start one with `ray start --head` or leave trainer.ray_address null for a local Ray") from None
            return
        ray.init(num_cpus=max(os.cpu_count() or 1, num_cpus_needed), include_dashboard=False, log_to_driver=False)
        self.started = True

    def check_gpus(self, per_node: int) -> None:
        """Refuse ``trainer.n_gpus_per_node`` GPUs on a local Ray this object started with fewer, at once:
        its resources cannot grow, so its placement groups would only time out (``TETHER_RAY_PG_TIMEOUT``,
        120 s). An attached cluster may be autoscaled: its placement groups are left to wait.

        Raises:
            ConfigError: naming the key and the GPUs the local Ray found.
        """
        import ray

        have = ray.cluster_resources().get("GPU", 0) if self.started and per_node else per_node
        if have < per_node:
            self.close()
            raise ConfigError(f"trainer.n_gpus_per_node={per_node}, but the local Ray tether started finds {have:g} GPU(s) on this "
                              "machine; set trainer.n_gpus_per_node=0 for a CPU run, or attach to a cluster with GPUs (trainer.ray_address)")  # fmt: skip

    def close(self) -> None:
        import ray

        if self.started and ray.is_initialized():
            ray.shutdown()
            self.started = False


def _node_address() -> tuple[str, int]:
    """This node's IP and a free TCP port (run on a group's bundle 0: the rendezvous of its process group)."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class WorkerGroup:
    """``n`` RankWorkers of one or more roles on a placement group (one bundle each), one process group.

    Args:
        name: the roles it hosts, for messages ("actor+ref", "critic").
        cfg: the run's config; roles, lora_state: see RankWorker.
    Raises:
        WorkerDiedError: a worker failed to start (naming the group).
    """

    def __init__(self, name: str, cfg, n: int, roles: tuple[str, ...], lora_state=None):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.n, self.tp = name, n, cfg.actor.tp_size  # n = dp × tp ranks
        gpus = 1 if cfg.trainer.n_gpus_per_node else 0
        if gpus and colocated_vllm(cfg) and "actor" in roles:
            gpus = 0.5  # the other half of the bundle's GPU is the colocated vLLM replica's (rollout_workers)
        bundle = {"CPU": 1} | ({"GPU": 1} if gpus else {})
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=float(os.environ.get("TETHER_RAY_PG_TIMEOUT", "120")))
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            avail = ray.available_resources()
            raise WorkerDiedError(
                f"{name} worker group: Ray could not place {n} bundles of {bundle} (available: {avail}); "
                "lower trainer.n_workers or add nodes"
            ) from None

        def on(i, **kw):
            return dict(scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i), **kw)

        addr, port = ray.get(ray.remote(_node_address).options(**on(0, num_cpus=0)).remote())
        cls = ray.remote(RankWorker)
        lora_ref = ray.put(lora_state) if lora_state is not None else None
        self.workers = [
            cls.options(**on(i, num_cpus=1, num_gpus=gpus), name=None).remote(cfg, i, n, addr, port, roles, lora_ref) for i in range(n)
        ]
        self._get([w.ping.remote() for w in self.workers], "start")

    #: seconds a rank's error waits for a peer's death to surface: a rank killed in a collective makes
    #: its peers fail (gloo: "Connection reset by peer") before Ray reports the death itself
    DEATH_GRACE_S = 5.0

    def _get(self, refs, what: str):
        """ray.get in rank order, failing on the first worker that errors or dies (its peers may be
        blocked in a collective waiting for it). A rank's error is first held for up to
        :data:`DEATH_GRACE_S` seconds: if another rank turns out dead meanwhile, the message names
        the dead rank, the cause, and the error as what followed."""
        import ray

        died = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ActorDiedError)
        pending = {r: i for i, r in enumerate(refs)}
        results: list = [None] * len(refs)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for r in ready:
                rank = pending.pop(r)
                try:
                    results[rank] = ray.get(r)
                except died as e:
                    raise WorkerDiedError(f"{self.name} worker group: rank {rank} died during {what} ({death_cause(e)}); the run cannot continue") from None
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    failed = f"rank {rank} failed in {what}: {failure_text(cause)}"
                    later, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.DEATH_GRACE_S) if pending else ([], [])
                    for other in later:
                        try:
                            ray.get(other)
                        except died as d:
                            raise WorkerDiedError(f"{self.name} worker group: rank {pending[other]} died during {what} ({death_cause(d)}); "
                                                  f"the run cannot continue (then {failed})") from None  # fmt: skip
                        except ray.exceptions.RayTaskError:
                            pass
                    raise WorkerDiedError(f"{self.name} worker group: {failed}") from None
        return results

    def call(self, method: str, *args, **kwargs):
        """Call ``method`` on every rank as its ``@register`` mode says; the result as the local role returns it."""
        import ray

        mode = getattr(RankWorker, method).dispatch_mode
        if mode == DP_SPLIT:  # one shard per dp rank, sent to each of its tp ranks; the tp ranks' results are equal
            shards, parts = split_batch(args[0], self.n // self.tp)
            refs = [getattr(w, method).remote(shards[i // self.tp], *args[1:], **kwargs) for i, w in enumerate(self.workers)]
            outs = self._get(refs, method)[:: self.tp]
            if isinstance(outs[0], tuple):
                return tuple(None if outs[0][j] is None else gather_rows([o[j] for o in outs], parts) for j in range(len(outs[0])))
            return gather_rows(outs, parts)
        assert mode == ALL, mode
        args = tuple(ray.put(a) if isinstance(a, RolloutBatch) else a for a in args)  # one copy in the object store
        return self._get([getattr(w, method).remote(*args, **kwargs) for w in self.workers], method)[0]

    def kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers or []:
            with suppress(Exception):
                ray.kill(w)
        self.workers = None  # closed: calls are refused (RemoteActor.pull_weights names it)
        with suppress(Exception):
            remove_placement_group(self.pg)


class _LRView:
    """``optimizer.param_groups[0]["lr"]`` of a remote role, for the guard's messages."""

    def __init__(self, lr: float):
        self.param_groups = [{"lr": lr}]


class RemoteActor:
    """Stands where ``ActorWorker`` stands in ``Roles``: each call runs on the actor group.

    ``model`` is the driver's full copy of the policy. Eager (``lazy=False``: HF rollouts generate
    on it) it takes the actor group's weights after every update. Lazy (``lazy=True``: vLLM
    replicas generate, their weights streamed from the group's shards) an update only marks it
    stale, and reading ``model`` pulls the weights first: validation's exact/*, a LoRA checkpoint's
    adapters, a reference reset and the end of :meth:`Trainer.fit` read it, so a run pulls the full
    model once per such read instead of once per step. ``model_as_is`` is the copy without a pull,
    for what needs only its config and parameter shapes (perf/mfu, checkpoint metadata).
    ``pulls`` counts the pulls (one all-gather of the trainable weights on the group each).

    Raises:
        RuntimeError: ``model`` read while stale after the worker group was closed (the weights
            are in the run's last checkpoint; ``tether export`` writes them out).
    """

    def __init__(self, group: WorkerGroup, model, *, lazy: bool = False):
        self.group, self.model_as_is, self.lazy = group, model, lazy
        self.stale, self.pulls = False, 0

    @property
    def model(self):
        if self.stale:
            self.pull_weights()
        return self.model_as_is

    def compute_logprobs(self, batch: RolloutBatch, *, with_entropy: bool = True, full_kl_ref=None):
        return self.group.call("compute_logprobs", batch, with_entropy=with_entropy, full_kl=full_kl_ref is not None)

    def update(self, batch: RolloutBatch, spec, step: int, ref=None) -> dict[str, float]:
        metrics = self.group.call("update_actor", batch, spec, step)
        for k in ("_old_logprobs", "_entropy"):  # spec.reuse_logprobs: the rows measured by the ranks, gathered in order
            if k in metrics:
                metrics[k] = metrics[k].to(batch.response_mask.device)
        self.weights_changed()
        return metrics

    def weights_changed(self) -> None:
        """The group's weights moved (an update, a checkpoint load): pull them now (eager) or mark the copy stale (lazy)."""
        if self.lazy:
            self.stale = True
        else:
            self.pull_weights()

    def pull_weights(self) -> None:
        """The driver's copy takes the actor group's trainable weights."""
        if self.group.workers is None:
            raise RuntimeError("the driver's copy of the policy is stale and the actor worker group is closed: "
                               "read the trained weights from the run's last checkpoint (`tether export`)")
        state = self.group.call("full_state", "actor", True)
        self.pulls += 1
        with torch.no_grad():
            params = dict(self.model_as_is.named_parameters())
            for k, v in state.items():
                params[k].copy_(v.to(params[k].device, params[k].dtype))
        self.stale = False

    def scale_lr(self, factor: float) -> None:
        self.group.call("scale_lr", "actor", factor)

    @property
    def optimizer(self) -> _LRView:
        return _LRView(self.group.call("lr", "actor"))


class RemoteReference:
    """Stands where ``ReferenceWorker`` stands: log-probs on the actor group (the reference lives
    beside the actor there). ``local`` is the driver's own reference, kept only for the embedded
    task's exact/* metrics (``tether.trainer.setup.driver_holds_ref``), else None."""

    def __init__(self, group: WorkerGroup, local, actor: RemoteActor | None = None):
        self.group, self.local, self.actor = group, local, actor

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        return self.group.call("ref_logprobs", batch)

    def _context(self):
        return self.local._context() if self.local is not None else contextlib.nullcontext()

    @property
    def module(self):
        return self.local.module if self.local is not None else None

    @property
    def model(self):
        return self.local.model if self.local is not None else None

    def reset_to(self, actor_model) -> None:
        """The group's reference takes its actor's weights; a driver reference takes the driver's
        copy (``actor.model``: pulled first when lazy; ``actor_model`` may be that copy as it is)."""
        self.group.call("reset_ref")
        if self.local is not None:
            self.local.reset_to(self.actor.model if self.actor is not None else actor_model)

    def pull_weights(self) -> None:
        """The driver's reference (exact/* metrics) takes the group's reference weights (after a load)."""
        if self.local is not None and self.local.model is not None:
            self.local.model.load_state_dict(self.group.call("full_state", "ref", False))


class RemoteCritic:
    """Stands where ``CriticWorker`` stands: values and updates on the critic's group (the driver
    holds no critic model)."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        return self.group.call("compute_values", batch).to(batch.response_mask.device)

    def update(self, batch: RolloutBatch, **kwargs) -> dict[str, float]:
        return self.group.call("update_critic", batch, kwargs)

    def scale_lr(self, factor: float) -> None:
        self.group.call("scale_lr", "critic", factor)

    @property
    def optimizer(self) -> _LRView:
        return _LRView(self.group.call("lr", "critic"))


class RayBackend:
    """The worker groups of one run and the Ray they run on; :meth:`close` ends both."""

    def __init__(self, cfg, local_roles):
        n = world_size(cfg)
        has_critic = cfg.algo.adv_estimator == "gae"
        split = cfg.trainer.placement == "split" and has_critic
        vllm_bundles = cfg.rollout.vllm.replicas if cfg.rollout.engine == "vllm" and not colocated_vllm(cfg) else 0
        self.cluster = RayCluster(cfg.trainer.ray_address, n * (2 if split else 1) + vllm_bundles)
        self.cluster.check_gpus(cfg.trainer.n_gpus_per_node)
        self.rollout = None
        lora_state = None
        if cfg.actor.lora.rank > 0:
            from peft import get_peft_model_state_dict

            lora_state = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(local_roles.actor.model).items()}
        self.groups: list[WorkerGroup] = []
        try:
            actor_roles = ("actor", "critic") if has_critic and not split else ("actor",)
            self.actor_group = self._group("+".join(["actor", "ref", *actor_roles[1:]]), cfg, n, actor_roles, lora_state)
            self.critic_group = None
            if has_critic:
                self.critic_group = self._group("critic", cfg, n, ("critic",)) if split else self.actor_group
            if cfg.rollout.engine == "vllm":
                from tether.distributed.rollout_workers import VLLMReplicaGroup
                from tether.trainer.setup import generation_eos_ids

                eos = generation_eos_ids(local_roles.actor.model)
                self.rollout = VLLMReplicaGroup(cfg, local_roles.actor_path, local_roles.tokenizer, eos, self.actor_group)
        except BaseException:
            self.close()
            raise

    def _group(self, name, cfg, n, roles, lora_state=None) -> WorkerGroup:
        group = WorkerGroup(name, cfg, n, roles, lora_state)
        self.groups.append(group)
        return group

    # -------------------------------------------------------------- checkpoints
    def _critic_group_separate(self) -> bool:
        return self.critic_group is not None and self.critic_group is not self.actor_group

    def save(self, path, with_ref: bool) -> None:
        """Sharded weights + optimizer states of every role under ``path/dcp`` (and ``path/dcp_critic``
        for a split critic group), written by the workers with torch.distributed.checkpoint. The
        path must be visible to every worker (a shared file system on several nodes)."""
        self.actor_group.call("save_checkpoint", str(path / "dcp"), with_ref)
        if self._critic_group_separate():
            self.critic_group.call("save_checkpoint", str(path / "dcp_critic"))

    def load(self, path, with_ref: bool, schedule: bool) -> None:
        """Load :meth:`save`'s checkpoint at this run's world size (DCP reshards)."""
        from tether.trainer.checkpoint import CheckpointError

        if not (path / "dcp" / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint {path} holds no sharded dcp/ weights: it was written by trainer.backend=local; "
                "resume it with trainer.backend=local (or start a new run from its `tether export`)"
            )
        if self._critic_group_separate() and not (path / "dcp_critic" / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {path}: dcp_critic/ is missing (was it saved with trainer.placement=colocate?)")
        self.actor_group.call("load_checkpoint", str(path / "dcp"), with_ref, schedule)
        if self._critic_group_separate():
            self.critic_group.call("load_checkpoint", str(path / "dcp_critic"), False, schedule)

    def close(self) -> None:
        """End the worker groups and replicas: one by one on an attached cluster; on a local Ray this
        process started, by shutting that Ray down, which ends them all. Removing a placement group
        needs Ray's GCS, and a SIGTERM to the whole process group (``timeout``, ``kill -- -PGID``, a
        batch scheduler) reaches the local GCS too: the one-by-one teardown then blocked until Ray's
        60 s reconnect timeout killed the driver, after its checkpoint but before its exit message."""
        if self.cluster.started:
            self.rollout, self.groups = None, []
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None
        for g in self.groups:
            g.kill()
        self.groups = []
        self.cluster.close()


def build_ray_roles(cfg, roles):
    """Replace the local roles' actor, reference and critic by stand-ins for Ray worker groups.

    ``roles`` are the local roles (``tether.trainer.setup.build_roles``): their tokenizer, rollout
    engine, reward and the actor's model (the driver's copy for rollouts) are kept.
    """
    backend = RayBackend(cfg, roles)
    roles.backend = backend
    # with vLLM replicas nothing generates on the driver's copy: it is pulled only when read (RemoteActor)
    roles.actor = RemoteActor(backend.actor_group, roles.actor.model, lazy=backend.rollout is not None)
    roles.ref = RemoteReference(backend.actor_group, roles.ref, roles.actor)
    if backend.critic_group is not None:
        roles.critic = RemoteCritic(backend.critic_group)
    if backend.rollout is not None:  # rollout.engine=vllm: the runner samples on the replicas
        roles.engine.engine = backend.rollout
    return roles
