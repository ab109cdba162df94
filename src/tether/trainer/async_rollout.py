"""One-step off-policy overlap (``rollout.async_steps=1``): the next batch is generated while this one trains.

Timeline of step t (θ_k = the policy after k updates)::

    main thread   take batch t ─ start job t+1 ─ reward ─ ref log-probs ─ KL ─ advantages ─ update t ─ join ─ validate ─ checkpoint
    job thread                   └ copy θ_{t-1} into the snapshot ─ generate batch t+1 ─ its log-probs under θ_{t-1} ┘

So the batch trained at step t was sampled from θ_{t-2} (the policy before step t-1's update; step
1's and step 2's batches both come from θ_0) and is trained on by θ_{t-1}: one step stale. Its
``old_logprobs`` (the PPO ratio's denominator) and ``entropy`` are the behaviour policy's, computed
by the job on the very weights that generated it, so the clipped ratio π_θ/π_behaviour corrects the
staleness (the one-step off-policy scheme of verl's ``recipe/one_step_off_policy``, with the
behaviour policy's own log-probs as the old ones). With ``actor.old_logprobs_source=rollout`` the job
makes no such pass: the sampled tokens' log-probs that ``generate`` recorded on the same snapshot
(``batch.rollout_logprobs``) serve as the old ones (the trainer's ``rollout_old_logprobs``; entropy
is then not measured), which saves one no-grad forward over the batch per step. The reference
log-probs, the KL, the advantages and the controllers are computed by the trainer as usual, on the
main thread.

The job runs on a **snapshot**: a second copy of the policy (``Trainer.roles.actor.model``: the local
actor, or the driver's copy under ``trainer.backend=ray``) into which the trainable weights are
copied before each job, so the update (local) or the weights pulled back from the Ray workers never
race with generation. torch releases the GIL inside its kernels, so with one torch thread each the
two threads use two cores.

Determinism: prompts are drawn on the main thread in step order, and the job is joined right after
the update, before validation, checkpointing or anything else that draws from torch's global RNG;
the only RNG draws during the overlap are the job's own sampling (a train-mode forward with dropout
would also draw, so that is refused, :func:`check_no_dropout`). The same seed thus gives the same
metrics run to run. A checkpoint stores the pending batch (its token ids and behaviour log-probs,
``async_pending.safetensors``); a rollback discards it and the next step regenerates those prompts
from the restored weights.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tether.batch import RolloutBatch
from tether.workers.actor import _forward_logprobs

log = logging.getLogger("tether")

PENDING_FILE = "async_pending.safetensors"


def snapshot_model(model: torch.nn.Module) -> torch.nn.Module:
    """An eval-mode copy of ``model`` for generation (an LM head patch, :func:`tether.models.patch_lm_head`,
    is re-applied to the copy's own head: the patch's closure would otherwise keep calling the original head).

    Its parameters keep ``model``'s ``requires_grad`` flags, though nothing trains them (the job runs
    under ``no_grad``): torch's autocast caches the bf16 cast of a weight for a whole ``generate`` call
    only when the weight requires grad, so a frozen copy recast every weight at every decode step
    (+8% of the small bench model's bf16 generation, the same tokens)."""
    from tether.models import patch_lm_head, unpatch_lm_head

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
    from tether.config import ConfigError

    for role, model in models.items():
        if model is not None and has_dropout(model):
            raise ConfigError(
                f"rollout.async_steps=1 with trainer.backend=local needs {role} without dropout: its training forward draws from "
                "torch's global RNG while the background generation samples from it, so runs would not repeat. Use "
                "rollout.async_steps=0, trainer.backend=ray (the update then draws on the workers), or a model without dropout"
            )


class AsyncRollout:
    """Produces each step's batch one step ahead, on a snapshot of the policy, in a background thread.

    Args:
        runner: the trainer's :class:`~tether.trainer.rollout.RolloutRunner` (its engine must take a
            model by ``sync_weights``: the HF engine).
        model: the policy whose weights each job copies (the local actor, or the Ray driver's copy).
        prompts: the training prompt set; sampler: its PromptSampler (drawn on the main thread).
        n: responses per prompt; micro_batch_size, temperature, compute_dtype: as the actor's
            log-prob pass (``actor.micro_batch_size``, ``rollout.temperature``, ``actor.compute_dtype``).
        from_rollout: ``actor.old_logprobs_source=rollout``: a batch whose ``rollout_logprobs`` are
            finite on every counted token keeps them for the trainer instead of the job's pass.
    """

    def __init__(self, runner, model, prompts, sampler, *, n: int, micro_batch_size: int, temperature: float, compute_dtype: str,
                 from_rollout: bool = False):  # fmt: skip
        self.source = model
        self.snapshot = snapshot_model(model)
        engine = copy.copy(runner.engine)
        engine.sync_weights(self.snapshot)
        self.runner = copy.copy(runner)
        self.runner.engine = engine
        self.runner.tok = copy.deepcopy(runner.tok)  # the job decodes while the main thread may use the tokenizer
        self.prompts, self.sampler, self.n = prompts, sampler, n
        self.micro_batch_size, self.temperature, self.compute_dtype = micro_batch_size, temperature, compute_dtype
        self.from_rollout = from_rollout
        self._pool: ThreadPoolExecutor | None = None  # started by the first job, ended by close()
        self._job: Future | None = None
        self._job_indices: list[int] | None = None
        self._pending: RolloutBatch | None = None  # joined, not yet trained on
        self._pending_indices: list[int] | None = None

    # -------------------------------------------------------------- the step's batch
    def next_batch(self, *, launch: bool = True) -> RolloutBatch:
        """This step's batch (the pending one, else generated now from the current weights), with
        ``old_logprobs`` and ``entropy`` of the policy that generated it; then, if ``launch``, the job
        for the next step's batch starts on the current weights.

        ``batch.extra["async_times"]`` holds the job's own seconds (``timing/async_generate_s``,
        ``timing/async_logprobs_s``), spent off the main thread when the batch was pre-generated.
        """
        self.join()
        if self._pending is not None:
            batch, self._pending, self._pending_indices = self._pending, None, None
        else:
            self._copy_weights()
            batch = self._produce(self.sampler.next_batch())
        if launch:
            self._launch()
        return batch

    def join(self) -> None:
        """Wait for the running job (if any): its batch becomes the pending one. Re-raises its error."""
        if self._job is None:
            return
        job, self._job = self._job, None
        self._pending, self._pending_indices = job.result(), self._job_indices

    def discard(self) -> None:
        """Drop the pending batch, keeping its prompts: the next step regenerates them from the weights
        it then has (after a rollback restored older ones)."""
        self.join()
        if self._pending is not None:
            self._copy_weights()
            self._pending = self._produce(self._pending_indices)

    def close(self) -> None:
        """End the background thread (after the running job, whose batch is kept); a later step starts a new one."""
        self.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _launch(self) -> None:
        indices = self.sampler.next_batch()
        self._copy_weights()  # on the main thread, before the update can move the weights
        self._job_indices = indices
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tether-async-rollout")
        self._job = self._pool.submit(self._produce, indices)

    def _copy_weights(self) -> None:
        """Trainable weights of the policy into the snapshot (frozen ones never change)."""
        params = dict(self.snapshot.named_parameters())
        with torch.no_grad():
            for name, p in self.source.named_parameters():
                if p.requires_grad:
                    params[name].copy_(p)

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
        batch.extra["async_times"] = {"timing/async_generate_s": t1 - t0, "timing/async_logprobs_s": time.perf_counter() - t1}
        return batch

    # -------------------------------------------------------------- checkpoints
    def save(self, directory: Path) -> None:
        """Write the pending batch (if any) as ``async_pending.safetensors``: token ids, masks, group
        ids, behaviour log-probs and entropy (or the engine's sampled-token log-probs, ``from_rollout``),
        and its prompt indices in the metadata."""
        self.join()
        if self._pending is None:
            return
        b = self._pending
        tensors = {
            "prompt_ids": b.prompt_ids, "prompt_mask": b.prompt_mask, "response_ids": b.response_ids, "group_ids": b.group_ids,
            "old_logprobs": b.old_logprobs, "entropy": b.entropy, "rollout_logprobs": b.rollout_logprobs,
        }  # fmt: skip
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items() if v is not None}
        save_file(tensors, str(Path(directory) / PENDING_FILE), metadata={"indices": json.dumps(self._pending_indices)})

    def load(self, directory: Path) -> None:
        """Restore :meth:`save`'s pending batch (none in a checkpoint without the file).

        Raises:
            CheckpointError: the file does not match the training prompts (another data set).
        """
        from tether.trainer.checkpoint import CheckpointError

        self._pending = self._pending_indices = None
        path = Path(directory) / PENDING_FILE
        if not path.is_file():  # e.g. the checkpoint of a run's last step, after which no next batch was started
            log.warning("resume: checkpoint %s holds no pending batch (%s): the next step's batch is generated from the restored "
                        "weights, not from the previous ones, so the run will not match an uninterrupted one", Path(directory).name,
                        PENDING_FILE)  # fmt: skip
            return
        with safe_open(str(path), framework="pt") as f:
            indices = json.loads(f.metadata()["indices"])
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        if any(not 0 <= i < len(self.prompts) for i in indices) or t["response_ids"].shape[0] != len(indices) * self.n:
            raise CheckpointError(f"checkpoint {directory}: {PENDING_FILE} holds {t['response_ids'].shape[0]} responses of prompts "
                                  f"{indices[:4]}..., which do not fit this run's {len(self.prompts)} prompts x rollout.n={self.n}")
        device = self.runner.device
        rep = [i for i in indices for _ in range(self.n)]
        batch = self.runner._batch(
            self.prompts, rep, t["prompt_ids"].to(device), t["prompt_mask"].to(device), t["response_ids"].to(device), t["group_ids"].to(device)
        )
        for k in ("old_logprobs", "entropy", "rollout_logprobs"):  # absent: None (from_rollout keeps only the last)
            setattr(batch, k, t[k].to(device) if k in t else None)
        batch.extra["async_times"] = {}
        self._pending, self._pending_indices = batch, indices


def build_async_rollout(cfg, roles, train_set, sampler) -> AsyncRollout | None:
    """The AsyncRollout of ``rollout.async_steps=1`` (None at 0) over a run's roles, training
    prompts and PromptSampler.

    Raises:
        ConfigError: a local actor or critic with dropout (:func:`check_no_dropout`).
    """
    if not cfg.rollout.async_steps:
        return None
    if roles.backend is None:
        check_no_dropout({"actor.model": roles.actor.model, "critic.model": getattr(roles.critic, "model", None)})
    return AsyncRollout(
        roles.engine, roles.actor.model, train_set, sampler, n=cfg.rollout.n, micro_batch_size=cfg.actor.micro_batch_size,
        temperature=cfg.rollout.temperature, compute_dtype=cfg.actor.compute_dtype, from_rollout=cfg.actor.old_logprobs_source == "rollout",
    )  # fmt: skip
