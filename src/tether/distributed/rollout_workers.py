"""vLLM engine replicas as Ray actors (``trainer.backend=ray`` with ``rollout.engine=vllm``).

The driver's :class:`~tether.rollout.runner.RolloutRunner` calls :class:`VLLMReplicaGroup` exactly
as it calls the local :class:`~tether.rollout.vllm.VLLMRolloutEngine` (``generate``,
``sync_weights``, ``returns_logprobs``): the group splits the prompts into contiguous, equal-count
chunks, one per replica (``rollout.vllm.replicas``), and concatenates the responses in the prompts'
order. Each replica is a :class:`VLLMReplica` Ray actor holding one ``VLLMRolloutEngine`` (vLLM's
``tensor_parallel_size`` = ``rollout.vllm.tensor_parallel_size``); each call's sampling seeds are
drawn from the driver's torch RNG (replica i samples with s + i), so a run's samples depend only on
``trainer.seed`` and the replica count, and a resumed run (whose checkpoint restored that RNG)
samples what the uninterrupted run did.

Placement (``trainer.placement``): ``colocate`` puts replica i on bundle i of the actor group's
placement group, sharing its device (verl's hybrid engine: on GPUs the rank and the replica take
half of the bundle's GPU each and the engine sleeps between rollouts, ``rollout.vllm.sleep``);
``split`` gives the replicas a placement group of their own, one bundle per replica.

Weight sync: :mod:`tether.distributed.weights` (:func:`~tether.distributed.weights.stream_weights`).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time

import torch

from tether.distributed.errors import WorkerDiedError, death_cause, failure_text
from tether.models import load_tokenizer
from tether.rollout.vllm import VLLMRolloutEngine, draw_seed

log = logging.getLogger("tether")

__all__ = ["VLLMReplica", "VLLMReplicaGroup", "merge_responses", "split_rows"]

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


def merge_responses(
    parts: list[tuple[torch.Tensor, torch.Tensor | None]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the replicas' ``(response_ids (B_i, T_i), logprobs (B_i, T_i) or None)`` along
    the rows, in order, right-padding to the longest T with ``pad_token_id`` (log-probs with 0, as
    the engine pads them). Returns ``(response_ids (B, T), logprobs (B, T) or None)``."""
    T = max(ids.shape[1] for ids, _ in parts)
    ids = torch.cat([torch.nn.functional.pad(i, (0, T - i.shape[1]), value=pad_token_id) for i, _ in parts])
    if parts[0][1] is None:
        return ids, None
    return ids, torch.cat([torch.nn.functional.pad(lp, (0, T - lp.shape[1]), value=0.0) for _, lp in parts])


# ---------------------------------------------------------------------------- the replica (a Ray actor)
class VLLMReplica:
    """One vLLM engine in its own Ray actor. A weight push runs ``load_weights`` in a thread of the
    actor, reading the buckets that :meth:`push` calls put in a queue of one.

    Args:
        cfg: the run's config (``rollout.*``, ``actor.dtype``, ``trainer.seed``).
        index: this replica's number; vLLM's engine seed is ``trainer.seed + index`` (each ``generate``
            call then reseeds its sampler with the seed the driver sends).
        model_path: the actor's model directory (the engine's initial weights and tokenizer).
        eos_token_ids: the model's generation_config EOS ids.
        env: environment variables to set before vLLM is imported.
    """

    def __init__(self, cfg, index: int, model_path: str, eos_token_ids: list[int], env: dict[str, str] | None = None):
        os.environ.update(env or {})

        r, v = cfg.rollout, cfg.rollout.vllm
        self.tp = v.tensor_parallel_size
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        self.tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.actor.trust_remote_code)
        self.engine = VLLMRolloutEngine(
            model_path,
            self.tokenizer,
            temperature=r.engine_temperature or r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            do_sample=r.do_sample,
            dtype=cfg.actor.dtype,
            seed=cfg.trainer.seed + index,
            trust_remote_code=cfg.actor.trust_remote_code,
            gpu_memory_utilization=v.gpu_memory_utilization,
            kv_cache_gib=v.kv_cache_gib,
            max_model_len=v.max_model_len,
            eos_token_ids=eos_token_ids,
            tensor_parallel_size=self.tp,
            enable_sleep_mode=self._sleeps(cfg),
        )
        if self.engine.last_sync is None and hasattr(self.engine.llm, "collective_rpc") and self.tp == 1:
            self.engine.last_sync = "reload_weights"  # vLLM 0.1x+: stream from the first push on (no trial list)
        self._queue: queue.Queue | None = None
        self._loader: threading.Thread | None = None
        self._error: BaseException | None = None
        self.asleep = False

    @staticmethod
    def _sleeps(cfg) -> bool:
        return bool(cfg.rollout.vllm.sleep and cfg.trainer.placement == "colocate" and cfg.trainer.n_gpus_per_node)

    def ping(self) -> str:
        return self.engine.backend or "?"

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        return_logprobs: bool,
        overrides: dict,
        seed: int | None = None,
    ):
        """``VLLMRolloutEngine.generate`` on these rows with sampling seed ``seed``;
        ``(response_ids, logprobs or None)`` on the CPU."""
        self.wake_up()
        out = self.engine.generate(prompt_ids, prompt_mask, return_logprobs=return_logprobs, seed=seed, **overrides)
        return out if return_logprobs else (out, None)

    def sleep(self) -> None:
        """vLLM's sleep mode, level 1 (weights to host memory, KV cache freed); GPU only."""
        if not self.asleep:
            self.engine.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.engine.llm.wake_up()
            self.asleep = False

    # -------------------------------------------------------------- weight push
    def begin_sync(self) -> None:
        """Start a push: one ``load_weights`` over the buckets :meth:`push` queues (tensor parallel:
        one load per bucket instead)."""
        self.wake_up()
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

        self._loader = threading.Thread(target=load, name="tether-vllm-load", daemon=True)
        self._loader.start()

    def push(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """Queue (or, tensor parallel, load) one bucket; returns its tensor count."""
        if self._error is not None:
            raise RuntimeError(f"vLLM replica failed to load weights: {self._error!r}") from self._error
        if self._queue is None:
            self.engine.load_weights(bucket)
        else:
            self._queue.put(bucket)
        return len(bucket)

    def end_sync(self) -> str:
        """Finish the push, reset vLLM's prefix cache; returns the loading path used."""
        if self._queue is not None:
            self._queue.put(None)
            self._loader.join()
            self._queue = self._loader = None
        if self._error is not None:
            raise RuntimeError(f"vLLM replica failed to load weights: {self._error!r}") from self._error
        self.engine.reset_prefix_cache()
        return self.engine.last_sync


# ---------------------------------------------------------------------------- driver side
class VLLMReplicaGroup:
    """The driver's rollout engine under the Ray backend: ``rollout.vllm.replicas`` :class:`VLLMReplica`
    actors, placed per ``trainer.placement``; weights pushed from an actor worker group.

    Args:
        cfg: the run's config.
        model_path: the actor's model directory; tokenizer: the trainer's (pad id).
        eos_token_ids: the model's generation_config EOS ids.
        actor_group: the :class:`~tether.distributed.ray_backend.WorkerGroup` whose ``push_weights``
            streams the actor's weights (None: :meth:`sync_weights` is refused until set).
    Raises:
        WorkerDiedError: Ray could not place the replicas, or one failed to start (naming it).
    """

    returns_logprobs = True

    def __init__(self, cfg, model_path, tokenizer, eos_token_ids: list[int], actor_group=None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        v = cfg.rollout.vllm
        self.n, self.tokenizer, self.actor_group = v.replicas, tokenizer, actor_group
        self.bucket_bytes = int(v.sync_bucket_mib * 2**20)
        self.sleeps = VLLMReplica._sleeps(cfg)
        self.pg = None
        self.last_sync: str | None = None
        self.last_sync_stats: dict[str, float] = {}
        gpus = cfg.trainer.n_gpus_per_node > 0
        if cfg.trainer.placement == "colocate":
            pg, bundles = actor_group.pg, [i % actor_group.n for i in range(self.n)]
            res = dict(num_cpus=0, num_gpus=0.5 if gpus else 0)
        else:
            from ray.util.placement_group import placement_group

            bundle = {"CPU": 1} | ({"GPU": v.tensor_parallel_size} if gpus else {})
            pg = self.pg = placement_group([dict(bundle) for _ in range(self.n)], strategy="PACK")
            try:
                ray.get(pg.ready(), timeout=float(os.environ.get("TETHER_RAY_PG_TIMEOUT", "120")))
            except ray.exceptions.GetTimeoutError:
                self.close()
                raise WorkerDiedError(
                    f"rollout (vLLM) replicas: Ray could not place {self.n} bundles of {bundle} (available: "
                    f"{ray.available_resources()}); "
                    "lower rollout.vllm.replicas or use trainer.placement=colocate"
                ) from None
            bundles = list(range(self.n))
            res = dict(num_cpus=1, num_gpus=v.tensor_parallel_size if gpus else 0)
        env = {k: val for k, val in os.environ.items() if _FORWARDED_ENV.match(k)}
        cls = ray.remote(VLLMReplica)
        self.replicas = [
            cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b), **res
            ).remote(cfg, i, str(model_path), list(eos_token_ids), env)
            for i, b in enumerate(bundles)
        ]
        self._get([r.ping.remote() for r in self.replicas], "start")

    def _get(self, refs, what: str):
        import ray

        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise WorkerDiedError(f"rollout (vLLM) replica {i} failed in {what}: {failure_text(cause)}") from None
            except ray.exceptions.RayActorError as e:
                raise WorkerDiedError(
                    f"rollout (vLLM) replica {i} died during {what} ({death_cause(e)}); the run cannot continue"
                ) from None
        return out

    @torch.no_grad()
    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, return_logprobs: bool = False, **overrides
    ):
        """As :meth:`VLLMRolloutEngine.generate`: one response per row (B, T) on ``prompt_ids``'
        device, and with ``return_logprobs`` the sampled tokens' log-probs (B, T), nats. Rows are
        split into contiguous chunks across the replicas (:func:`split_rows`) and merged back in order.
        The sampling seeds come from the driver's torch RNG (replica i samples with seed s + i, s drawn
        once per call), which checkpoints save: a resumed run samples what the uninterrupted one did,
        and one replica samples as the local engine does from the same RNG state."""
        ranges = split_rows(prompt_ids.shape[0], self.n)
        p_ids, p_mask = prompt_ids.cpu(), prompt_mask.cpu()
        base = draw_seed()
        refs = [
            r.generate.remote(p_ids[a:b], p_mask[a:b], return_logprobs, overrides, base + i)
            for i, (r, (a, b)) in enumerate(zip(self.replicas, ranges, strict=False))
        ]
        parts = self._get(refs, "generate")
        if self.sleeps:
            self._get([r.sleep.remote() for r in self.replicas], "sleep")
        ids, lp = merge_responses(parts, self.tokenizer.pad_token_id)
        ids = ids.to(prompt_ids.device)
        return (ids, lp.to(prompt_ids.device)) if return_logprobs else ids

    def sync_weights(self, model=None) -> None:
        """Stream the actor group's current weights into every replica (:func:`stream_weights`) and
        reset their prefix caches; ``model`` (the driver's copy) is not read. Logs bytes and seconds.

        Raises:
            WorkerDiedError: a rank or a replica failed during the push.
        """
        if self.actor_group is None:
            raise RuntimeError("VLLMReplicaGroup.sync_weights: no actor worker group to take the weights from")
        t0 = time.perf_counter()
        stats = self.actor_group.call("push_weights", self.replicas, self.bucket_bytes)
        stats["seconds"] = time.perf_counter() - t0
        self.last_sync = stats.pop("path")
        self.last_sync_stats = stats
        log.debug(
            "weight sync to %d vLLM replica(s): %.1f MiB in %d tensors / %d buckets, %.3f s (gather %.3f s, send %.3f "
            "s)",
            self.n,
            stats["bytes"] / 2**20,
            stats["tensors"],
            stats["buckets"],
            stats["seconds"],
            stats["gather_s"],
            stats["send_s"],
        )

    def close(self) -> None:
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
