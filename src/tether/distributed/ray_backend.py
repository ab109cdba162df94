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
from pathlib import Path

import torch

from tether import engines
from tether.batch import RolloutBatch
from tether.checkpoint import CheckpointError
from tether.config import EXACT_TEACHER, ConfigError
from tether.distributed.dp import gather_rows, split_batch
from tether.distributed.errors import WorkerDiedError, death_cause, failure_text
from tether.distributed.rollout_workers import ReplicaGroup, replica_count
from tether.distributed.worker import ALL, DP_SPLIT, RankWorker
from tether.engines import EngineEntry
from tether.workers.actor import DISTILL_OUT
from tether.workers.build import build_driver_share, build_runner
from tether.workers.roles import Roles

log = logging.getLogger("tether")


def world_size(cfg) -> int:
    """Ranks per worker group: ``trainer.n_workers``, or one per GPU (nnodes × n_gpus_per_node) when left at 1."""
    t = cfg.trainer
    if t.n_gpus_per_node and t.n_workers == 1:
        return t.nnodes * t.n_gpus_per_node
    return t.n_workers


def replica_engine(cfg) -> EngineEntry | None:
    """The registry entry of ``rollout.engine`` when it runs as Ray replicas (``on_ray="replicas"``: vLLM), else
    None (auto never picks such an engine under Ray; HF generate runs on the driver)."""
    e = engines.chosen(cfg)
    return e if e is not None and e.on_ray == "replicas" else None


def colocated_replicas(cfg) -> bool:
    """Engine replicas share the actor group's bundles (a replica engine, ``trainer.placement=colocate``)."""
    return replica_engine(cfg) is not None and cfg.trainer.placement == "colocate"


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


#: seconds tether waits for a cluster at ``trainer.ray_address`` to answer before it gives up (environment variable)
RAY_CONNECT_TIMEOUT_ENV = "TETHER_RAY_CONNECT_TIMEOUT"
RAY_CONNECT_TIMEOUT_S = 15.0
RAY_CLIENT_PORT = 10001  # a ``ray://host`` address without a port: Ray client's default


def _connect_error(address: str, why: str) -> ConfigError:
    return ConfigError(
        f"trainer.ray_address={address!r}: cannot connect to a Ray cluster there ({why}); start one with `ray start "
        "--head` (or name its GCS address, `ray status` prints it), or leave trainer.ray_address null for a local Ray"
    )


def _wait_interruptibly(done, deadline: float, step_s: float = 0.05) -> bool:
    """Poll ``done()`` until it is true or ``deadline`` (time.monotonic) passes: the main thread stays in
    Python, so a signal handler (SIGTERM, SIGINT) runs at once instead of after a blocking C call."""
    import time

    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(step_s)
    return True


def _ray_target(address: str) -> tuple[str | None, bool]:
    """The ``host:port`` that ``ray.init(address=address)`` will connect to (None for ``local``: a new Ray),
    and whether it is a Ray client (``ray://``) address. Ray rewrites a loopback host (127.0.0.1, localhost)
    to this machine's address and resolves ``auto`` (``RAY_ADDRESS``, else the cluster ``ray start``
    recorded under Ray's temp directory, else a GCS process running on this machine).

    Raises:
        ConfigError: ``auto`` finds no cluster, or the address is not ``host:port`` / ``ray://host[:port]``.
    """
    if address.startswith("ray://"):
        hostport = address[len("ray://") :].split("/", 1)[0]
        host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", str(RAY_CLIENT_PORT))
        if not host or not port.isdigit():
            raise ConfigError(
                f"trainer.ray_address={address!r} is not a Ray client address: expected ray://HOST[:PORT] (port "
                f"{RAY_CLIENT_PORT} by default)"
            )
        return f"{host}:{port}", True
    try:
        from ray._private.services import canonicalize_bootstrap_address  # what ray.init itself calls
    except ImportError:  # another Ray layout: the address as given
        return address, False
    try:
        target = canonicalize_bootstrap_address(address)
    except ConnectionError as e:  # auto: no cluster recorded or running on this machine
        raise _connect_error(address, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    except ValueError:
        raise ConfigError(
            f"trainer.ray_address={address!r} is not a Ray address: expected auto, HOST:PORT (the cluster's GCS, port "
            f"6379 by default) or ray://HOST[:PORT] (Ray client, port {RAY_CLIENT_PORT})"
        ) from None
    return target, False


def probe_ray_address(address: str, timeout_s: float | None = None) -> None:
    """Check, within ``timeout_s`` seconds (``TETHER_RAY_CONNECT_TIMEOUT``, default 15), that a Ray cluster
    answers at ``trainer.ray_address`` before ``ray.init`` is called: a TCP connection to the host and port
    Ray will use, then (a GCS address, not ``ray://``) one gRPC call of the GCS (``GetClusterId``). Ray's
    own connection loop retries a dead address for about 14 minutes (20 attempts of about 40 s, printing
    its GCS warnings), blocked in C++ so that SIGTERM waits for it; this check fails at once when nothing
    listens, and after ``timeout_s`` when something listens but no GCS answers (a wrong port, a proxy). It
    waits in Python, so a signal ends it promptly. ``ray://`` addresses get the TCP check only: Ray's client
    then gives up by itself after 3 attempts (about 30 s).

    Raises:
        ConfigError: one line naming ``trainer.ray_address``, the address Ray would connect to and why not.
    """
    import socket
    import time

    if timeout_s is None:
        timeout_s = float(os.environ.get(RAY_CONNECT_TIMEOUT_ENV, RAY_CONNECT_TIMEOUT_S))
    deadline = time.monotonic() + timeout_s
    target, client = _ray_target(address)
    if target is None:  # "local": ray.init starts a new cluster, nothing to reach
        return
    given = address.removeprefix("ray://").split("/", 1)[0]
    note = ""
    if address == "auto":
        note = "; `auto` resolved to it"
    elif given != target and not client:
        note = f"; Ray connects there for {given}: it replaces a loopback host by this machine's address"
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except TimeoutError:
        raise _connect_error(address, f"no answer from {target} within {timeout_s:g} s{note}") from None
    except OSError as e:
        raise _connect_error(address, f"nothing listens at {target}: {e.strerror or e}{note}") from None
    if client:
        return
    answered = _gcs_answers(target, deadline)
    if answered == "silent":
        raise _connect_error(
            address,
            f"{target} accepts connections, but no Ray GCS answered within {timeout_s:g} s{note}; is it the GCS port "
            "(6379 by default)? a Ray client port (10001) needs ray://",
        )
    if answered is not None:
        raise _connect_error(address, f"{target} answers, but not as a Ray GCS: {answered}{note}")


def _gcs_answers(target: str, deadline: float) -> str | None:
    """None when a Ray GCS answers ``GetClusterId`` at ``target`` before ``deadline`` (time.monotonic; an
    authentication error counts as an answer: ``ray.init`` then says what it needs); "silent" when nothing
    answered in time; else the gRPC status of a server that is not a GCS."""
    import time

    try:
        import grpc
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

        channel = init_grpc_channel(target)  # TLS (RAY_USE_TLS) and token auth as Ray's own clients
    except Exception:  # another Ray layout, TLS files missing, ...: the TCP check alone, ray.init says the rest
        return None
    left, call = max(deadline - time.monotonic(), 0.5), None
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        call = stub.GetClusterId.future(gcs_service_pb2.GetClusterIdRequest(), timeout=left, wait_for_ready=True)
        if not _wait_interruptibly(call.done, time.monotonic() + left + 1.0):
            return "silent"
        try:
            call.result()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "silent"
            if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE):
                details = (e.details() or "").strip().splitlines()
                return f"{e.code().name}{': ' + details[0][:200] if details else ''}"
        return None
    finally:
        if call is not None:
            call.cancel()
        channel.close()


class RayCluster:
    """Attach to a running Ray (``trainer.ray_address``, or one this process already joined) or start a
    local one; :meth:`close` shuts down only a Ray that this object started.

    Raises:
        ConfigError: no Ray cluster answers at ``trainer.ray_address`` (:func:`probe_ray_address`), or
            ``ray.init`` fails to attach; one line naming the key and the address.
    """

    def __init__(self, address: str | None, num_cpus_needed: int):
        import ray

        self.started = False
        if ray.is_initialized():
            return
        if address:
            probe_ray_address(address)
            try:
                ray.init(address=address, log_to_driver=False)
            except (ConnectionError, TimeoutError, RuntimeError) as e:  # Ray raises these after its own retries
                raise _connect_error(
                    address, str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                ) from None
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
            raise ConfigError(
                f"trainer.n_gpus_per_node={per_node}, but the local Ray tether started finds {have:g} GPU(s) on this "
                "machine; set trainer.n_gpus_per_node=0 for a CPU run, or attach to a cluster with GPUs "
                "(trainer.ray_address)"
            )

    def check_nodes(self, nnodes: int) -> None:
        """Refuse ``trainer.nnodes`` > 1 on the one-node local Ray this object started, at once (its
        placement groups would only time out). An attached cluster is left to the placement groups.

        Raises:
            ConfigError: naming the key.
        """
        if self.started and nnodes > 1:
            self.close()
            raise ConfigError(
                f"trainer.nnodes={nnodes}, but without trainer.ray_address tether starts a one-node local Ray; attach "
                "to a cluster of that many nodes (trainer.ray_address) or set trainer.nnodes=1"
            )

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


NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its node id


def spread_over_nodes(name: str, n: int, nnodes: int, bundle: dict, timeout_s: float) -> list[dict[str, str]]:
    """``trainer.nnodes`` > 1: one label selector per rank that puts ranks ``[j·k, (j+1)·k)`` on node j,
    k = n / nnodes ranks per node, the nnodes nodes all distinct. Ray picks the nodes: a placement group
    of nnodes bundles of k × ``bundle`` each, ``STRICT_SPREAD`` (each bundle on its own node), reserved
    and released again; the worker group's own placement group (one bundle per rank, so that colocated
    vLLM replica i still shares rank i's bundle) then pins bundle i to node i // k with
    ``bundle_label_selector`` (Ray's ``ray.io/node-id`` label). Neighbouring ranks share a node, so a
    tensor-parallel group (``actor.tp_size`` ≤ k) stays on one. Without this the group's ``PACK``
    placement filled one node first, whatever ``trainer.nnodes`` said.

    Raises:
        WorkerDiedError: no nnodes distinct nodes with room for k bundles each within ``timeout_s``
            seconds (``TETHER_RAY_PG_TIMEOUT``), naming the group, the key and the alive nodes.
    """
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    per = n // nnodes
    probe = placement_group([{k: v * per for k, v in bundle.items()} for _ in range(nnodes)], strategy="STRICT_SPREAD")
    try:
        ray.get(probe.ready(), timeout=timeout_s)
        nodes = placement_group_table(probe)["bundles_to_node_id"]
    except ray.exceptions.GetTimeoutError:
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        raise WorkerDiedError(
            f"{name} worker group: trainer.nnodes={nnodes}, but Ray found no {nnodes} distinct nodes with room for "
            f"{per} bundles of {bundle} each within {timeout_s:g} s ({alive} alive node(s), available: "
            f"{ray.available_resources()}); add nodes or lower trainer.nnodes"
        ) from None
    finally:
        remove_placement_group(probe)
    return [{NODE_ID_LABEL: nodes[i // per]} for i in range(n)]


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
        if gpus and colocated_replicas(cfg) and "actor" in roles:
            gpus = 0.5  # the other half of the bundle's GPU is the colocated engine replica's (rollout_workers)
        bundle = {"CPU": 1} | ({"GPU": 1} if gpus else {})
        timeout = float(os.environ.get("TETHER_RAY_PG_TIMEOUT", "120"))
        nnodes = cfg.trainer.nnodes
        selectors = spread_over_nodes(name, n, nnodes, bundle, timeout) if nnodes > 1 else None
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK", bundle_label_selector=selectors)
        try:
            ray.get(self.pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            avail = ray.available_resources()
            raise WorkerDiedError(
                f"{name} worker group: Ray could not place {n} bundles of "
                f"{bundle}{f' on the {nnodes} nodes it chose' if selectors else ''} (available: {avail}); lower "
                "trainer.n_workers or add nodes"
            ) from None
        if selectors:
            log.info(
                "%s worker group: %d ranks on %d nodes, %d per node (ranks %s)",
                name,
                n,
                nnodes,
                n // nnodes,
                ", ".join(f"{i}: {sel[NODE_ID_LABEL][:8]}" for i, sel in enumerate(selectors)),
            )

        def on(i, **kw):
            return dict(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i), **kw
            )

        addr, port = ray.get(ray.remote(_node_address).options(**on(0, num_cpus=0)).remote())
        cls = ray.remote(RankWorker)
        lora_ref = ray.put(lora_state) if lora_state is not None else None
        self.workers = [
            cls.options(**on(i, num_cpus=1, num_gpus=gpus), name=None).remote(cfg, i, n, addr, port, roles, lora_ref)
            for i in range(n)
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
                    raise WorkerDiedError(
                        f"{self.name} worker group: rank {rank} died during {what} ({death_cause(e)}); the run cannot "
                        "continue"
                    ) from None
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    failed = f"rank {rank} failed in {what}: {failure_text(cause)}"
                    later, _ = (
                        ray.wait(list(pending), num_returns=len(pending), timeout=self.DEATH_GRACE_S)
                        if pending
                        else ([], [])
                    )
                    for other in later:
                        try:
                            ray.get(other)
                        except died as d:
                            raise WorkerDiedError(
                                f"{self.name} worker group: rank {pending[other]} died during {what} "
                                f"({death_cause(d)}); the run cannot continue (then {failed})"
                            ) from None
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
            refs = [
                getattr(w, method).remote(shards[i // self.tp], *args[1:], **kwargs) for i, w in enumerate(self.workers)
            ]
            outs = self._get(refs, method)[:: self.tp]
            if isinstance(outs[0], tuple):
                return tuple(
                    None if outs[0][j] is None else gather_rows([o[j] for o in outs], parts)
                    for j in range(len(outs[0]))
                )
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

    def compute_logprobs(
        self,
        batch: RolloutBatch,
        *,
        with_entropy: bool = True,
        full_kl_ref=None,
        teacher=None,
        distill=None,
        distill_out: dict | None = None,
    ):
        """As ``ActorWorker.compute_logprobs``, on the actor group: ``full_kl_ref`` and ``teacher`` say only whether
        the ranks' own reference and teacher join the pass (they live beside the actor there)."""
        with_teacher = teacher is not None and distill is not None
        out = self.group.call(
            "compute_logprobs", batch, with_entropy=with_entropy, full_kl=full_kl_ref is not None, distill=with_teacher
        )
        if with_teacher and distill_out is not None:
            distill_out.update(zip(DISTILL_OUT, out[4:], strict=True))
        return out[:4]

    def update(self, batch: RolloutBatch, spec, step: int, ref=None, teacher=None) -> dict[str, float]:
        """``ActorWorker.update`` on the actor group; ``ref`` and ``teacher`` are the ranks' own (``spec.distill``: the
        ranks pass their teacher to the loss term)."""
        metrics = self.group.call("update_actor", batch, spec, step)
        # spec.reuse_logprobs: the rows measured by the ranks, gathered in order
        for k in ("_old_logprobs", "_entropy"):
            if k in metrics:
                metrics[k] = metrics[k].to(batch.response_mask.device)
        self.weights_changed()
        return metrics

    def refresh(self) -> None:
        """Bring the driver's copy up to date now (a lazy copy that is stale is pulled once)."""
        if self.stale:
            self.pull_weights()

    def weights_changed(self) -> None:
        """The group's weights moved (an update, a checkpoint load): pull them now (eager) or mark the copy stale
        (lazy)."""
        if self.lazy:
            self.stale = True
        else:
            self.pull_weights()

    def pull_weights(self) -> None:
        """The driver's copy takes the actor group's trainable weights."""
        if self.group.workers is None:
            raise RuntimeError(
                "the driver's copy of the policy is stale and the actor worker group is closed: read the trained "
                "weights from the run's last checkpoint (`tether export`)"
            )
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
    task's exact/* metrics (``tether.workers.build.driver_holds_ref``), else None."""

    def __init__(self, group: WorkerGroup, local, actor: RemoteActor | None = None):
        self.group, self.local, self.actor = group, local, actor

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        return self.group.call("ref_logprobs", batch)

    def as_reference(self):
        return self.local.as_reference() if self.local is not None else contextlib.nullcontext()

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


class RemoteTeacher:
    """Stands where the teacher's ``ReferenceWorker`` stands (``distill.teacher=DIR``): log-probs on the actor group,
    whose ranks hold the teacher sharded beside the reference (``RankWorker._build_actor``)."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        return self.group.call("teacher_logprobs", batch)


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
    """The worker groups of one run and the Ray they run on (the ``Placement`` of ``tether.workers.roles``): it
    saves and loads the roles sharded; :meth:`close` ends the groups and Ray."""

    trains_in_process = False  # the updates run on the workers

    def __init__(self, cfg, share):
        # FSDP2 gathers parameters in it for the update's matmuls
        self.update_param_dtype = cfg.trainer.fsdp.param_dtype
        n = world_size(cfg)
        has_critic = cfg.algo.adv_estimator == "gae"
        split = cfg.trainer.placement == "split" and has_critic
        replicas = replica_engine(cfg)
        replica_bundles = replica_count(cfg) if replicas is not None and not colocated_replicas(cfg) else 0
        nnodes = cfg.trainer.nnodes
        if n % nnodes:
            raise ConfigError(
                f"trainer.n_workers={n} must be a multiple of trainer.nnodes={nnodes}: each node runs n_workers / "
                "nnodes ranks of a worker group"
            )
        self.cluster = RayCluster(cfg.trainer.ray_address, n * (2 if split else 1) + replica_bundles)
        self.cluster.check_gpus(cfg.trainer.n_gpus_per_node)
        self.cluster.check_nodes(nnodes)
        self.rollout = None
        lora_state = None
        if cfg.actor.lora.rank > 0:
            from peft import get_peft_model_state_dict

            lora_state = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(share.actor.model).items()}
        self.groups: list[WorkerGroup] = []
        try:
            actor_roles = ("actor", "critic") if has_critic and not split else ("actor",)
            teacher = ["teacher"] if cfg.distill.teacher not in (None, EXACT_TEACHER) else []
            self.actor_group = self._group(
                "+".join(["actor", "ref", *teacher, *actor_roles[1:]]), cfg, n, actor_roles, lora_state
            )
            self.critic_group = None
            if has_critic:
                self.critic_group = self._group("critic", cfg, n, ("critic",)) if split else self.actor_group
            if replicas is not None:  # the engine runs as Ray actors, its weights streamed from the actor group
                self.rollout = ReplicaGroup(
                    cfg, replicas.name, share.actor_path, share.tokenizer, share.eos_token_ids, self.actor_group
                )
        except BaseException:
            self.close()
            raise

    def _group(self, name, cfg, n, roles, lora_state=None) -> WorkerGroup:
        group = WorkerGroup(name, cfg, n, roles, lora_state)
        self.groups.append(group)
        return group

    # -------------------------------------------------------------- checkpoints (the Placement protocol)
    def _critic_group_separate(self) -> bool:
        return self.critic_group is not None and self.critic_group is not self.actor_group

    def save_weights(self, roles, path, *, with_ref: bool) -> None:
        """Sharded weights + optimizer states of every role under ``path/dcp`` (and ``path/dcp_critic``
        for a split critic group), written by the workers with torch.distributed.checkpoint, and the actor's
        config and tokenizer under ``path/actor`` (:func:`save_sharded_actor_meta`). The path must be visible
        to every worker (a shared file system on several nodes)."""
        self.actor_group.call("save_checkpoint", str(path / "dcp"), with_ref)
        if self._critic_group_separate():
            self.critic_group.call("save_checkpoint", str(path / "dcp_critic"))
        save_sharded_actor_meta(roles.actor, roles.tokenizer, path / "actor")

    def save_optimizer(self, roles, path) -> None:
        """Nothing: the optimizer states are in ``dcp/`` with the weights."""

    def load(self, roles, path, *, with_ref: bool, schedule: bool) -> None:
        """Load :meth:`save_weights`'s checkpoint at this run's world size (DCP reshards); the driver's copies of the
        policy (pulled now, or when next read) and of the reference take the loaded weights, and the rollout engine
        the policy's.

        Raises:
            CheckpointError: a checkpoint of the local backend (no ``dcp/``), or a split critic's ``dcp_critic/``
                missing.
        """
        if not (path / "dcp" / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint {path} holds no sharded dcp/ weights: it was written by trainer.backend=local; resume it "
                "with trainer.backend=local (or start a new run from its `tether export`)"
            )
        if self._critic_group_separate() and not (path / "dcp_critic" / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint {path}: dcp_critic/ is missing (was it saved with trainer.placement=colocate?)"
            )
        self.actor_group.call("load_checkpoint", str(path / "dcp"), with_ref, schedule)
        if self._critic_group_separate():
            self.critic_group.call("load_checkpoint", str(path / "dcp_critic"), False, schedule)
        roles.actor.weights_changed()  # pulled now, or when the driver next reads it (vLLM replicas)
        if with_ref:
            roles.ref.pull_weights()
        roles.engine.sync_weights(roles.actor.model_as_is)

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


def build_ray_roles(cfg) -> Roles:
    """The roles of ``trainer.backend=ray``: this process's share (``tether.workers.build.build_driver_share``:
    tokenizer, its copy of the policy, reward), the worker groups that hold actor, reference and critic (stand-ins
    here forward each call), and the rollout role built whole: over engine replicas as Ray actors where the engine
    runs so, else over the engine on the driver's copy of the policy."""
    share = build_driver_share(cfg)
    backend = RayBackend(cfg, share)
    try:
        runner = build_runner(cfg, share, backend.rollout)
    except BaseException:
        backend.close()
        raise
    # with engine replicas nothing generates on the driver's copy: it is pulled only when read (RemoteActor)
    actor = RemoteActor(backend.actor_group, share.actor.model, lazy=backend.rollout is not None)
    ref = RemoteReference(backend.actor_group, share.ref, actor)
    critic = RemoteCritic(backend.critic_group) if backend.critic_group is not None else None
    # distill.teacher=DIR lives on the actor group's ranks; =exact (a lookup table) stays in this process
    teacher = RemoteTeacher(backend.actor_group) if "distill.teacher" in share.model_paths else share.teacher
    return Roles(
        share.tokenizer,
        actor,
        ref,
        critic,
        runner,
        share.reward,
        share.device,
        share.actor_path,
        share.val_reward,
        placement=backend,
        model_paths=share.model_paths,
        gold=share.gold,
        teacher=teacher,
    )


def save_sharded_actor_meta(actor, tokenizer, out: Path) -> None:
    """What a sharded (trainer.backend=ray) checkpoint keeps of the actor role besides dcp/: the
    model's config, generation config and tokenizer (``tether export`` rebuilds the model from them);
    with LoRA the adapters themselves, which are small (read from ``actor.model``: a lazy driver copy
    is pulled first; the config alone needs no pull)."""
    model = actor.model_as_is
    if hasattr(model, "peft_config"):
        actor.model.save_pretrained(out, safe_serialization=True)
    else:
        out.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
