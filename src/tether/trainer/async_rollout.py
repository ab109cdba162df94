"""Off-policy overlap (``rollout.async_steps=k``, k = 1..4): batches are generated k steps ahead, the next one while
this one trains.

Timeline of step t with k = 1 (θ_j = the policy after j updates)::

    main thread   take batch t ─ start job t+1 ─ reward ─ ref log-probs ─ KL ─ advantages ─ update t ─ join ─ validate
    ─ checkpoint
    job thread                   └ θ_{t-1} into the snapshot ─ generate batch t+1 ─ its log-probs under θ_{t-1} ┘

So the batch trained at step t was sampled from θ_{t-2} (the policy before step t-1's update; step
1's and step 2's batches both come from θ_0) and is trained on by θ_{t-1}: one step stale. With k > 1
step t starts the job for batch t+k on θ_{t-1} (step 1 starts k of them, all on θ_0), so from step k+1
on each batch is k updates stale; ``rollout/staleness`` logs it. Its ``old_logprobs`` (the PPO ratio's
denominator) and ``entropy`` are the behaviour policy's, computed by the job on the very weights that
generated it, so the clipped ratio π_θ/π_behaviour corrects the staleness (the one-step off-policy
scheme of verl's ``recipe/one_step_off_policy``, with the behaviour policy's own log-probs as the old
ones), and rollout correction (``algo.rollout_correction``) weighs each batch against the engine's
log-probs on that same snapshot. With ``actor.old_logprobs_source=rollout`` the job makes no such pass:
the sampled tokens' log-probs that ``generate`` recorded on the same snapshot
(``batch.rollout_logprobs``) serve as the old ones (the trainer's ``rollout_old_logprobs``; entropy
is then not measured), which saves one no-grad forward over the batch per step. The reference
log-probs, the KL, the advantages and the controllers are computed by the trainer as usual, on the
main thread.

Bounded staleness (``rollout.max_staleness``, default k; as verl's fully async trainer and AReaL
bound it): a batch more updates behind than the bound is, under ``drop``, regenerated at its step from
the current weights (same prompts; ``rollout/stale_dropped``), and under ``wait`` never generated that
far ahead (at most ``max_staleness`` batches are kept ahead). Here every batch is exactly k behind
(fewer at the start, and after a rollback or a resume that restored fewer), so the bound matters when
it is below k.

The jobs run on a **snapshot**: a second copy of the policy (``Trainer.roles.actor.model``: the local
actor, or the driver's copy under ``trainer.backend=ray``), one job at a time on one thread. The
trainable weights are copied into it on the main thread when a job is started with none in flight
(every step after the first; at step 1 the k jobs share θ_0), so the update (local) or the weights
pulled back from the Ray workers never race with generation, and k > 1 costs no more memory than k = 1. torch releases
the GIL inside its kernels, so with one torch
thread each the two threads use two cores.

Determinism: prompts are drawn on the main thread in step order, and every job is joined right after
the update, before validation, checkpointing or anything else that draws from torch's global RNG;
the only RNG draws during the overlap are the jobs' own sampling, in job order (a train-mode forward
with dropout would also draw, so that is refused, :func:`check_no_dropout`). The same seed thus gives
the same metrics run to run. A checkpoint stores the pending batches (their token ids, behaviour
log-probs and versions, ``async_pending.safetensors``), so a resume continues exactly; a rollback
regenerates them, same prompts, from the restored weights.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tether.batch import RolloutBatch
from tether.checkpoint import CheckpointError
from tether.config import ConfigError
from tether.models import patch_lm_head, unpatch_lm_head
from tether.workers.actor import _forward_logprobs

log = logging.getLogger("tether")

PENDING_FILE = "async_pending.safetensors"
MAX_STEPS_AHEAD = 4
"""The largest ``rollout.async_steps``."""


def snapshot_model(model: torch.nn.Module) -> torch.nn.Module:
    """An eval-mode copy of ``model`` for generation (an LM head patch, :func:`tether.models.patch_lm_head`,
    is re-applied to the copy's own head: the patch's closure would otherwise keep calling the original head).

    Its parameters keep ``model``'s ``requires_grad`` flags, though nothing trains them (the job runs
    under ``no_grad``): torch's autocast caches the bf16 cast of a weight for a whole ``generate`` call
    only when the weight requires grad, so a frozen copy recast every weight at every decode step
    (+8% of the small bench model's bf16 generation, the same tokens)."""
    snap = copy.deepcopy(model)
    flags = unpatch_lm_head(snap) if hasattr(snap, "get_output_embeddings") else None
    if flags is not None:
        patch_lm_head(snap, **flags)
    return snap.eval()


def has_dropout(model: torch.nn.Module) -> bool:
    """A Dropout module with p > 0, or attention dropout in the model's config."""
    modules = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    return modules or float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0) > 0


def check_no_dropout(models: dict[str, torch.nn.Module | None]) -> None:
    """Refuse models whose train-mode forward draws random numbers on the main thread while the job samples.

    Raises:
        ConfigError: naming the role whose model has dropout.
    """
    for role, model in models.items():
        if model is not None and has_dropout(model):
            raise ConfigError(
                f"rollout.async_steps with trainer.backend=local needs {role} without dropout: its training forward "
                "draws from torch's global RNG while the background generation samples from it, so runs would not "
                "repeat. Use rollout.async_steps=0, trainer.backend=ray (the update then draws on the workers), or a "
                "model without dropout"
            )


class AsyncRollout:
    """Produces each step's batch one step ahead, on a snapshot of the policy, in a background thread.

    Args:
        runner: the trainer's :class:`~tether.rollout.runner.RolloutRunner`; its engine is copied to run on the
            snapshot (``sync_weights``): one whose registry entry says ``snapshot_async`` (HF; the config refuses
            the others).
        model: the policy whose weights each job copies (the local actor, or the Ray driver's copy).
        prompts: the training prompt set; sampler: its PromptSampler (drawn on the main thread).
        n: responses per prompt; micro_batch_size, temperature, compute_dtype: as the actor's
            log-prob pass (``actor.micro_batch_size``, ``rollout.temperature``, ``actor.compute_dtype``).
        from_rollout: ``actor.old_logprobs_source=rollout``: a batch whose ``rollout_logprobs`` are
            finite on every counted token keeps them for the trainer instead of the job's pass.
    """

    def __init__(
        self,
        runner,
        model,
        prompts,
        sampler,
        *,
        n: int,
        micro_batch_size: int,
        temperature: float,
        compute_dtype: str,
        from_rollout: bool = False,
        steps_ahead: int = 1,
        max_staleness: int | None = None,
        staleness_policy: str = "drop",
    ):
        if not 1 <= steps_ahead <= MAX_STEPS_AHEAD:
            raise ValueError(f"steps_ahead must be in 1..{MAX_STEPS_AHEAD}, got {steps_ahead}")
        if staleness_policy not in ("drop", "wait"):
            raise ValueError(f"staleness_policy must be 'drop' or 'wait', got {staleness_policy!r}")
        self.source = model
        self.snapshot = snapshot_model(model)
        engine = copy.copy(runner.engine)
        engine.sync_weights(self.snapshot)
        self.runner = runner.fork(engine)  # its own tokenizer: the job decodes while the main thread may use one
        self.prompts, self.sampler, self.n = prompts, sampler, n
        self.micro_batch_size, self.temperature, self.compute_dtype = micro_batch_size, temperature, compute_dtype
        self.from_rollout = from_rollout
        self.steps_ahead = steps_ahead  # rollout.async_steps: k
        self.max_staleness = steps_ahead if max_staleness is None else max_staleness  # rollout.max_staleness
        self.staleness_policy = staleness_policy  # rollout.staleness_policy
        self._pool: ThreadPoolExecutor | None = None  # started by the first job, ended by close()
        # (batch or job, prompt indices, version) in step order; version = the step whose weights θ_{version} generated
        # it
        self._ready: deque[tuple[RolloutBatch, list[int], int]] = deque()  # joined, not yet trained on
        self._jobs: deque[tuple[Future, list[int], int]] = deque()  # running or queued on the one job thread
        self._step = 0  # the step of the last next_batch: the weights now are θ_{step-1} until that step's update

    # -------------------------------------------------------------- the step's batch
    @property
    def lookahead(self) -> int:
        """How many batches are kept generated ahead: k, or fewer under ``wait`` with max_staleness < k."""
        return min(self.steps_ahead, self.max_staleness) if self.staleness_policy == "wait" else self.steps_ahead

    def next_batch(self, step: int = 1, *, remaining: int = 1) -> RolloutBatch:
        """Step ``step``'s batch (the oldest pending one, else generated now from the current weights θ_{step-1}),
        with ``old_logprobs`` and ``entropy`` of the policy that generated it; then jobs start on the current
        weights until :attr:`lookahead` batches (at most ``remaining``, the steps after this one) are ahead.

        A pending batch is ``staleness`` = (step − 1) − its version updates behind the policy that trains on it
        (k in steady state); one past ``max_staleness`` under ``drop`` is regenerated now from the current
        weights (same prompts). ``batch.extra["async_metrics"]``: ``rollout/staleness`` (steps),
        ``rollout/stale_dropped`` (0/1); ``batch.extra["async_times"]``: the job's own seconds
        (``timing/async_generate_s``, ``timing/async_logprobs_s``), spent off the main thread when pre-generated.
        """
        self.join()
        self._step = step
        if self._ready:
            batch, indices, version = self._ready.popleft()
        else:
            indices, version = self.sampler.next_batch(), step - 1
            self._copy_weights()
            batch = self._produce(indices)
        dropped = (step - 1 - version) > self.max_staleness and self.staleness_policy == "drop"
        if dropped:  # too old: the same prompts, generated now by the policy that trains on them
            self._copy_weights()
            batch, version = self._produce(indices), step - 1
        batch.extra["async_metrics"] = {
            "rollout/staleness": float(step - 1 - version),
            "rollout/stale_dropped": float(dropped),
        }
        while len(self._ready) + len(self._jobs) < min(self.lookahead, remaining):
            self._launch(step - 1)
        return batch

    def join(self) -> None:
        """Wait for every running or queued job: their batches become pending, in order. Re-raises a job's error."""
        while self._jobs:
            job, indices, version = self._jobs.popleft()
            self._ready.append((job.result(), indices, version))

    def discard(self) -> None:
        """Regenerate every pending batch from the current weights (after a rollback restored older ones),
        keeping their prompts; they count as generated by this step's weights."""
        self.join()
        if self._ready:
            self._copy_weights()
            self._ready = deque((self._produce(indices), indices, self._step) for _, indices, _ in self._ready)

    def close(self) -> None:
        """End the background thread (after the running jobs, whose batches are kept); a later step starts a new one."""
        self.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _launch(self, version: int) -> None:
        """Start the job for the next prompts on the current weights θ_{version}. With no job in flight (every step
        after the first) they go into the snapshot now, on the main thread, before the update can move them; a job
        queued behind others of the same weights (step 1 under k > 1) needs none; otherwise it carries a copy."""
        indices = self.sampler.next_batch()
        weights = None
        if not self._jobs:
            self._copy_weights()
        # not reached by the trainer's loop (it joins every step); kept exact regardless
        elif self._jobs[-1][2] != version:
            weights = self._weights()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tether-async-rollout")
        self._jobs.append((self._pool.submit(self._job, weights, indices), indices, version))

    def _job(self, weights: dict[str, torch.Tensor] | None, indices: list[int]) -> RolloutBatch:
        """On the job thread, one job at a time: the launch's weights into the snapshot (if it carries them), then the
        batch."""
        if weights is not None:
            self._copy_weights(weights)
        return self._produce(indices)

    def _weights(self) -> dict[str, torch.Tensor]:
        """A copy of the policy's trainable weights (frozen ones never change)."""
        with torch.no_grad():
            return {name: p.detach().clone() for name, p in self.source.named_parameters() if p.requires_grad}

    def _copy_weights(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """``weights`` (default: the policy's trainable weights, read now) into the snapshot; no job may be running."""
        params = dict(self.snapshot.named_parameters())
        with torch.no_grad():
            if weights is None:
                weights = {name: p for name, p in self.source.named_parameters() if p.requires_grad}
            for name, w in weights.items():
                params[name].copy_(w)

    def _produce(self, indices: list[int]) -> RolloutBatch:
        """Generate ``n`` responses per prompt index on the snapshot, then their log-probs (B, T) and
        entropy (B, T) under the same weights, nats; with ``from_rollout`` the sampled tokens'
        log-probs recorded by ``generate`` stand for them (old_logprobs left None for the trainer
        to take from ``batch.rollout_logprobs``) unless one of a counted token is not finite."""
        t0 = time.perf_counter()
        batch = self.runner.rollout(self.prompts, indices, self.n)
        t1 = time.perf_counter()
        lp = batch.rollout_logprobs
        if not (self.from_rollout and lp is not None and bool(torch.isfinite(lp[batch.response_mask.bool()]).all())):
            batch.old_logprobs, batch.entropy, _, _ = _forward_logprobs(
                self.snapshot, batch, self.micro_batch_size, self.temperature, True, compute_dtype=self.compute_dtype
            )
        batch.extra["async_times"] = {
            "timing/async_generate_s": t1 - t0,
            "timing/async_logprobs_s": time.perf_counter() - t1,
        }
        return batch

    # -------------------------------------------------------------- checkpoints
    _TENSORS = (
        "prompt_ids",
        "prompt_mask",
        "response_ids",
        "response_mask",
        "generated_mask",
        "turn_rewards",
        "truncated",
        "group_ids",
        "old_logprobs",
        "entropy",
        "rollout_logprobs",
    )

    def save(self, directory: Path) -> None:
        """Write the pending batches (if any) as ``async_pending.safetensors``: per batch i, its token ids, masks,
        group ids, behaviour log-probs and entropy (or the engine's sampled-token log-probs, ``from_rollout``)
        as ``{i}.{name}``, and each batch's prompt indices and version in the metadata (``batches``)."""
        self.join()
        if not self._ready:
            return
        tensors, meta = {}, []
        for i, (b, indices, version) in enumerate(self._ready):
            for k in self._TENSORS:
                v = getattr(b, k)
                if v is not None:
                    tensors[f"{i}.{k}"] = v.detach().cpu().contiguous()
            extra, values = self.runner.saved_extra(b)  # a multi-turn batch's agent_* (turns, calls, failed rows)
            tensors |= {f"{i}.extra.{k}": v.detach().cpu().contiguous() for k, v in extra.items()}
            meta.append({"indices": indices, "version": version} | ({"extra": values} if values else {}))
        save_file(tensors, str(Path(directory) / PENDING_FILE), metadata={"batches": json.dumps(meta)})

    def load(self, directory: Path, step: int | None = None) -> None:
        """Restore :meth:`save`'s pending batches (none in a checkpoint without the file). ``step``: the
        checkpoint's step, the version of a batch in a file written before versions were saved (one batch).

        Raises:
            CheckpointError: the file does not match the training prompts (another data set).
        """
        self._ready.clear()
        self._step = step or 0
        path = Path(directory) / PENDING_FILE
        if not path.is_file():  # e.g. the checkpoint of a run's last step, after which no next batch was started
            log.warning(
                "resume: checkpoint %s holds no pending batch (%s): the next step's batch is generated from the "
                "restored weights, not from the previous ones, so the run will not match an uninterrupted one",
                Path(directory).name,
                PENDING_FILE,
            )
            return
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        if "batches" in meta:
            batches = json.loads(meta["batches"])
        else:  # rollout.async_steps=1 before k > 1: one batch, unprefixed names, generated by the checkpoint's weights
            batches = [{"indices": json.loads(meta["indices"]), "version": self._step - 1}]
            t = {f"0.{k}": v for k, v in t.items()}
        device = self.runner.device
        for i, spec in enumerate(batches):
            indices = spec["indices"]
            ids = t[f"{i}.response_ids"]
            if any(not 0 <= j < len(self.prompts) for j in indices) or ids.shape[0] != len(indices) * self.n:
                raise CheckpointError(
                    f"checkpoint {directory}: {PENDING_FILE} holds {ids.shape[0]} responses of prompts "
                    f"{indices[:4]}..., which do not fit this run's {len(self.prompts)} prompts x rollout.n={self.n}"
                )
            rep = [j for j in indices for _ in range(self.n)]
            masks = {k: t.get(f"{i}.{k}") for k in ("response_mask", "generated_mask", "truncated")}  # None: older file
            saved = {k[len(f"{i}.extra.") :]: v for k, v in t.items() if k.startswith(f"{i}.extra.")}
            saved |= spec.get("extra", {})
            if "agent_lengths" in saved:  # a multi-turn batch: its dropped rows (response_mask 0) at their length
                saved["agent_lengths"] = saved["agent_lengths"].long()
                masks["response_mask"] = torch.arange(ids.shape[1]) < saved["agent_lengths"].unsqueeze(1)
            batch = self.runner.restore(
                self.prompts,
                rep,
                t[f"{i}.prompt_ids"],
                t[f"{i}.prompt_mask"],
                ids,
                t[f"{i}.group_ids"],
                **masks,
                saved=saved,
            )
            for k in (
                "old_logprobs",
                "entropy",
                "rollout_logprobs",
                "turn_rewards",
            ):  # absent: None (from_rollout keeps only the last)
                setattr(batch, k, t[f"{i}.{k}"].to(device) if f"{i}.{k}" in t else None)
            batch.extra["async_times"] = {}
            self._ready.append((batch, indices, int(spec["version"])))


def build_async_rollout(cfg, roles, train_set, sampler) -> AsyncRollout | None:
    """The AsyncRollout of ``rollout.async_steps`` (None at 0) over a run's roles, training
    prompts and PromptSampler.

    Raises:
        ConfigError: a local actor or critic with dropout (:func:`check_no_dropout`).
    """
    if not cfg.rollout.async_steps:
        return None
    if roles.placement.trains_in_process:
        check_no_dropout({"actor.model": roles.actor.model, "critic.model": getattr(roles.critic, "model", None)})
    return AsyncRollout(
        roles.engine,
        roles.actor.model,
        train_set,
        sampler,
        n=cfg.rollout.n,
        micro_batch_size=cfg.actor.micro_batch_size,
        temperature=cfg.rollout.temperature,
        compute_dtype=cfg.actor.compute_dtype,
        from_rollout=cfg.actor.old_logprobs_source == "rollout",
        steps_ahead=cfg.rollout.async_steps,
        max_staleness=cfg.rollout.max_staleness,
        staleness_policy=cfg.rollout.staleness_policy,
    )
