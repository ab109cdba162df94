"""Rollout engine replicas as Ray actors (``trainer.backend=ray`` with an engine whose registry entry says
``on_ray="replicas"``: vLLM).

The driver's :class:`~tether.rollout.runner.RolloutRunner` calls :class:`ReplicaGroup` as it calls any
:class:`~tether.rollout.engine.GenerationEngine`: the group splits the requests into contiguous, equal-count chunks,
one per replica (``rollout.<engine>.replicas``), and returns the results in the requests' order. Each replica is an
:class:`EngineReplica` Ray actor holding one engine built by the engine module's ``build_replica`` (for vLLM with
``tensor_parallel_size`` = ``rollout.vllm.tensor_parallel_size``); each call's sampling seeds are drawn from the
driver's torch RNG (replica i samples with s + i), so a run's samples depend only on ``trainer.seed`` and the replica
count, and a resumed run (whose checkpoint restored that RNG) samples what the uninterrupted run did.

Placement (``trainer.placement``): ``colocate`` puts replica i on bundle i of the actor group's placement group,
sharing its device (verl's hybrid engine: on GPUs the rank and the replica take half of the bundle's GPU each and
the engine sleeps between rollouts, ``rollout.vllm.sleep``); ``split`` gives the replicas a placement group of their
own, one bundle per replica.

Weight sync: :mod:`tether.distributed.weights` (:func:`~tether.distributed.weights.stream_weights`).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from collections.abc import Sequence

import torch

from tether.distributed.errors import WorkerDiedError, death_cause, failure_text
from tether.engines import entry
from tether.models import load_tokenizer
from tether.rollout.engine import EngineCapabilities, GenerationRequest, GenerationResult, draw_seed
from tether.rollout.registry import engine_module

log = logging.getLogger("tether")

__all__ = ["EngineReplica", "ReplicaGroup", "replica_count", "split_rows"]

#: Environment variables a replica takes from the driver (vLLM's caches and sockets, Hugging Face's home).
_FORWARDED_ENV = re.compile(r"^(VLLM_|TORCHINDUCTOR_|TRITON_|HF_|TMPDIR$|TETHER_|OMP_NUM_THREADS$)")


# ---------------------------------------------------------------------------- pure helpers
def split_rows(n_rows: int, n_replicas: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` row ranges, one per replica, sizes differing by at most one
    (the first ``n_rows % n_replicas`` ranges one row longer); empty ranges are left out."""
    base, extra = divmod(n_rows, n_replicas)
    out, start = [], 0
    for i in range(n_replicas):
        stop = start + base + (i < extra)
        if stop > start:
            out.append((start, stop))
        start = stop
    return out


def _section(cfg):
    """The settings section of ``rollout.engine`` (a replica engine's: ``replicas``, ``tensor_parallel_size``,
    ``sync_bucket_mib``, optionally ``sleep``)."""
    return getattr(cfg.rollout, entry(cfg.rollout.engine).name)


def replica_count(cfg) -> int:
    """``rollout.<engine>.replicas``."""
    return int(_section(cfg).replicas)


def _sleeps(cfg) -> bool:
    """Replicas sleep between rollouts where the engine allows it (``rollout.<engine>.sleep``) and they share a GPU
    with a training rank (``trainer.placement=colocate`` on GPUs)."""
    return bool(
        getattr(_section(cfg), "sleep", False) and cfg.trainer.placement == "colocate" and cfg.trainer.n_gpus_per_node
    )


# ---------------------------------------------------------------------------- the replica (a Ray actor)
class EngineReplica:
    """One engine in its own Ray actor. A weight push runs ``load_weights`` in a thread of the actor, reading the
    buckets that :meth:`push` calls put in a queue of one.

    Args:
        cfg: the run's config (``rollout.*``, ``actor.dtype``, ``trainer.seed``).
        index: this replica's number (vLLM's engine seed is ``trainer.seed + index``; each ``generate`` call then
            reseeds its sampler with the seed the driver sends).
        model_path: the actor's model directory (the engine's initial weights and tokenizer).
        eos_token_ids: the model's generation_config EOS ids.
        env: environment variables to set before the engine is imported.
    """

    def __init__(self, cfg, index: int, model_path: str, eos_token_ids: list[int], env: dict[str, str] | None = None):
        os.environ.update(env or {})
        self.tp = int(_section(cfg).tensor_parallel_size)
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        self.tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.actor.trust_remote_code)
        self.engine = engine_module(cfg.rollout.engine).build_replica(
            cfg,
            index=index,
            model_path=model_path,
            tokenizer=self.tokenizer,
            eos_token_ids=eos_token_ids,
            sleeps=_sleeps(cfg),
        )
        self._queue: queue.Queue | None = None
        self._loader: threading.Thread | None = None
        self._error: BaseException | None = None

    def ping(self) -> tuple[str, EngineCapabilities]:
        """What runs here: the engine's backend (vLLM: ``gpu``/``cpu``) and its capabilities."""
        return getattr(self.engine, "backend", None) or "?", self.engine.capabilities

    def generate(self, requests: list[GenerationRequest], seed: int | None = None) -> list[GenerationResult]:
        """The engine's ``generate`` on these requests with sampling seed ``seed`` (it wakes a sleeping engine)."""
        return self.engine.generate(requests, seed=seed)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake()

    # -------------------------------------------------------------- weight push
    def begin_sync(self) -> None:
        """Start a push: one ``load_weights`` over the buckets :meth:`push` queues (tensor parallel:
        one load per bucket instead)."""
        self.engine.wake()
        self._error = None
        if self.tp > 1:
            return
        self._queue = queue.Queue(maxsize=1)

        def buckets():
            while (bucket := self._queue.get()) is not None:
                yield from bucket

        def load():
            try:
                self.engine.load_weights(buckets())
            except BaseException as e:  # noqa: BLE001 - reported by push / end_sync
                self._error = e
                while self._queue.get() is not None:  # drain, so push never blocks forever
                    pass

        self._loader = threading.Thread(target=load, name="tether-engine-load", daemon=True)
        self._loader.start()

    def push(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """Queue (or, tensor parallel, load) one bucket; returns its tensor count."""
        if self._error is not None:
            raise RuntimeError(f"engine replica failed to load weights: {self._error!r}") from self._error
        if self._queue is None:
            self.engine.load_weights(bucket)
        else:
            self._queue.put(bucket)
        return len(bucket)

    def end_sync(self) -> str:
        """Finish the push, reset the engine's prefix cache; returns the loading path used."""
        if self._queue is not None:
            self._queue.put(None)
            self._loader.join()
            self._queue = self._loader = None
        if self._error is not None:
            raise RuntimeError(f"engine replica failed to load weights: {self._error!r}") from self._error
        self.engine.reset_prefix_cache()
        return self.engine.last_sync


# ---------------------------------------------------------------------------- driver side
class ReplicaGroup:
    """The driver's rollout engine under the Ray backend (a :class:`~tether.rollout.engine.GenerationEngine`):
    ``rollout.<engine>.replicas`` :class:`EngineReplica` actors, placed per ``trainer.placement``; weights pushed
    from an actor worker group.

    Args:
        cfg: the run's config.
        name: the engine (``rollout.engine``; its registry entry says ``on_ray="replicas"``).
        model_path: the actor's model directory; tokenizer: the trainer's.
        eos_token_ids: the model's generation_config EOS ids.
        actor_group: the :class:`~tether.distributed.ray_backend.WorkerGroup` whose ``push_weights``
            streams the actor's weights (None: :meth:`sync_weights` is refused until set).
    Raises:
        WorkerDiedError: Ray could not place the replicas, or one failed to start (naming it).
    """

    def __init__(self, cfg, name: str, model_path, tokenizer, eos_token_ids: list[int], actor_group=None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        section, self.name = _section(cfg), name
        self.n, self.tokenizer, self.actor_group = replica_count(cfg), tokenizer, actor_group
        self.bucket_bytes = int(section.sync_bucket_mib * 2**20)
        self.sleeps = _sleeps(cfg)
        self.pg = None
        self.last_sync: str | None = None
        self.last_sync_stats: dict[str, float] = {}
        gpus, tp = cfg.trainer.n_gpus_per_node > 0, int(section.tensor_parallel_size)
        if cfg.trainer.placement == "colocate":
            pg, bundles = actor_group.pg, [i % actor_group.n for i in range(self.n)]
            res = dict(num_cpus=0, num_gpus=0.5 if gpus else 0)
        else:
            from ray.util.placement_group import placement_group

            bundle = {"CPU": 1} | ({"GPU": tp} if gpus else {})
            pg = self.pg = placement_group([dict(bundle) for _ in range(self.n)], strategy="PACK")
            try:
                ray.get(pg.ready(), timeout=float(os.environ.get("TETHER_RAY_PG_TIMEOUT", "120")))
            except ray.exceptions.GetTimeoutError:
                self.close()
                raise WorkerDiedError(
                    f"rollout ({name}) replicas: Ray could not place {self.n} bundles of {bundle} (available: "
                    f"{ray.available_resources()}); lower rollout.{name}.replicas or use trainer.placement=colocate"
                ) from None
            bundles = list(range(self.n))
            res = dict(num_cpus=1, num_gpus=tp if gpus else 0)
        env = {k: val for k, val in os.environ.items() if _FORWARDED_ENV.match(k)}
        cls = ray.remote(EngineReplica)
        self.replicas = [
            cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b), **res
            ).remote(cfg, i, str(model_path), list(eos_token_ids), env)
            for i, b in enumerate(bundles)
        ]
        started = self._get([r.ping.remote() for r in self.replicas], "start")
        self.backends = [backend for backend, _ in started]
        caps = started[0][1]
        # what every replica can do (they run one build; logprobs only where all return them)
        self.capabilities = EngineCapabilities(
            logprobs=all(c.logprobs for _, c in started),
            stop_strings=caps.stop_strings,
            continues_from_ids=caps.continues_from_ids,
            sleeps=caps.sleeps,
            holds_weights=True,
        )

    def _get(self, refs, what: str):
        import ray

        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise WorkerDiedError(
                    f"rollout ({self.name}) replica {i} failed in {what}: {failure_text(cause)}"
                ) from None
            except ray.exceptions.RayActorError as e:
                raise WorkerDiedError(
                    f"rollout ({self.name}) replica {i} died during {what} ({death_cause(e)}); the run cannot continue"
                ) from None
        return out

    def generate(self, requests: Sequence[GenerationRequest], *, seed: int | None = None) -> list[GenerationResult]:
        """One result per request, in order: the requests are split into contiguous chunks across the replicas
        (:func:`split_rows`). The sampling seeds come from the driver's torch RNG (replica i samples with seed
        s + i, s drawn once per call, or ``seed``), which checkpoints save: a resumed run samples what the
        uninterrupted one did, and one replica samples as the engine in this process does from the same RNG state.
        Replicas that sleep between rollouts are put to sleep after it."""
        requests = list(requests)
        base = draw_seed() if seed is None else seed
        refs = [
            r.generate.remote(requests[a:b], base + i)
            for i, (r, (a, b)) in enumerate(zip(self.replicas, split_rows(len(requests), self.n), strict=False))
        ]
        parts = self._get(refs, "generate")
        if self.sleeps:
            self._get([r.sleep.remote() for r in self.replicas], "sleep")
        return [result for part in parts for result in part]

    def sleep(self) -> None:
        """The replicas sleep after every rollout already where they share a GPU (``rollout.<engine>.sleep``)."""

    def wake(self) -> None:
        """A replica wakes itself for a rollout or a weight push."""

    def sync_weights(self, model=None) -> None:
        """Stream the actor group's current weights into every replica (:func:`stream_weights`) and
        reset their prefix caches; ``model`` (the driver's copy) is not read. Logs bytes and seconds.

        Raises:
            WorkerDiedError: a rank or a replica failed during the push.
        """
        if self.actor_group is None:
            raise RuntimeError("ReplicaGroup.sync_weights: no actor worker group to take the weights from")
        t0 = time.perf_counter()
        stats = self.actor_group.call("push_weights", self.replicas, self.bucket_bytes)
        stats["seconds"] = time.perf_counter() - t0
        self.last_sync = stats.pop("path")
        self.last_sync_stats = stats
        log.debug(
            "weight sync to %d engine replica(s): %.1f MiB in %d tensors / %d buckets, %.3f s (gather %.3f s, send "
            "%.3f s)",
            self.n,
            stats["bytes"] / 2**20,
            stats["tensors"],
            stats["buckets"],
            stats["seconds"],
            stats["gather_s"],
            stats["send_s"],
        )

    def close(self) -> None:
        """End the replicas and their placement group."""
        import contextlib

        import ray
        from ray.util.placement_group import remove_placement_group

        for r in getattr(self, "replicas", []):
            with contextlib.suppress(Exception):
                ray.kill(r)
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None
