"""The training loop: rollout → reward → log-probs → values → KL → advantages → updates → controller.

One single-controller loop drives the roles in ``tether.workers``. Each phase is a short method
timed into ``timing/<phase>_s``; :meth:`Trainer.train_step` reads like the algorithm.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from tether.algos import (
    AdvantageInputs,
    EntropyCoefController,
    compute_advantages,
    distill_k1,
    kl_penalty,
    make_kl_controller,
    mean_kl_per_token,
    overlong_penalty,
    rollout_correction,
    sequence_kl_mean,
    subtract_token_penalty,
    token_level_rewards_from_kl,
    top_entropy_mask,
)
from tether.batch import RolloutBatch
from tether.config import EMBEDDED, ConfigError, TetherConfig, config_to_yaml
from tether.data.loading import PromptSampler, load_prompt_rows, prepare_offline_rows, prepare_prompts
from tether.diagnostics import GUARDED_HACKING_CHECKS, LiveDiagnostics, read_metrics
from tether.evaluation.exact import ExactCache
from tether.evaluation.validation import validate
from tether.models import DTYPES
from tether.outputs import OutputPathError, OutputWriteError
from tether.placement import build_roles
from tether.records import RolloutRecorder
from tether.report import write_report
from tether.rollout import truncated_rows
from tether.rollout.agent import agent_metrics
from tether.signals import StopSignals, TrainingInterrupted, signal_name
from tether.trainer import lock, startup
from tether.trainer.async_rollout import build_async_rollout
from tether.trainer.guards import GuardMonitor, TrainingStopped
from tether.trainer.logging import MetricsLogger
from tether.trainer.perf import matmul_ceiling_flops, matmul_params, update_flops
from tether.trainer.progress import Progress
from tether.trainer.sampling import dynamic_sample
from tether.trainer.state import CheckpointManager, check_fresh_start
from tether.trainer.stats import GROUP_ESTIMATORS, rollout_metrics
from tether.trainer.waiting import WaitNotices, what_phases_wait_for
from tether.workers.build import actor_spec, correction_kwargs, distill_spec

log = logging.getLogger("tether")


class PhaseTimer:
    """Wall-clock seconds per phase of step ``step``, as ``timing/<phase>_s``; a phase that runs long says what it
    waits for (``notices``: ``trainer.wait_notice_s``, :mod:`tether.trainer.waiting`)."""

    def __init__(self, notices: WaitNotices | None = None, step: int = 0):
        self.times: dict[str, float] = {}
        self.notices, self.step = notices or WaitNotices(None), step

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        with self.notices(phase, self.step):
            yield
        self.times[f"timing/{phase}_s"] = self.times.get(f"timing/{phase}_s", 0.0) + time.perf_counter() - t0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


#: Files that may be in a run directory before the run starts: ``tether sweep`` writes the run's log there.
_NOT_USER_FILES = frozenset({"train.log"})


def is_run_dir(path: Path) -> bool:
    """A tether run directory: it holds the ``config.yaml`` or the ``checkpoints/`` a run writes."""
    return (path / "config.yaml").is_file() or (path / "checkpoints").is_dir()


def claim_run_dir(run_dir: Path | None, output_dir: str) -> tuple[Path, bool]:
    """The run directory and whether this call created it.

    ``{time}`` in ``output_dir`` becomes a timestamp, made unique by a suffix when another run
    claimed the same second (the directory is created atomically, so two runs never share one).
    A fixed ``output_dir`` is used as given (created if needed), so re-running the same command
    resumes from its checkpoints. An existing directory that holds files but is not a run
    (:func:`is_run_dir`; dotfiles and the sweep's ``train.log`` aside) is refused, so a run never
    overwrites someone's ``metrics.jsonl``.

    Raises:
        ConfigError: the path exists and is not a directory, is a non-empty directory that is not a
            run (naming its files), or cannot be created or written into.
    """
    if run_dir is None and "{time}" in output_dir:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in range(1000):
            path = Path(output_dir.replace("{time}", stamp + (f"-{i}" if i else "")))
            try:
                path.mkdir(parents=True, exist_ok=False)
                _check_writable(path, output_dir)
                return path, True
            except FileExistsError:
                continue
            except OSError as e:
                raise ConfigError(f"trainer.output_dir={output_dir!r}: cannot create {path}: {e}") from None
    path = Path(run_dir or output_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"trainer.output_dir={str(path)!r} exists and is not a directory")
    existed = path.exists()
    if existed and not is_run_dir(path):
        others = sorted(p.name for p in path.iterdir() if p.name not in _NOT_USER_FILES and not p.name.startswith("."))
        if others:
            raise ConfigError(
                f"trainer.output_dir={str(path)!r} holds files but is not a tether run (no config.yaml or "
                f"checkpoints/): {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}. A run would overwrite "
                "them (metrics.jsonl, summary.md, ...): choose an empty or new directory"
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"trainer.output_dir={str(path)!r}: cannot create it: {e}") from None
    _check_writable(path, output_dir)
    return path, not existed


def _check_writable(path: Path, output_dir: str) -> None:
    """Refuse a run directory nothing can be written into (a read-only mount, a full disk), before any
    model loads or Ray starts: the first write (its config.yaml) only comes after setup.

    Raises:
        ConfigError: naming the key, the directory and the OS's reason.
    """
    probe = path / ".tether-write-probe"
    try:
        probe.write_bytes(b"tether")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"trainer.output_dir={output_dir!r}: cannot write into {path}: {e.strerror or e}") from None


class Trainer:
    """KL-regularized PPO / GRPO / RLOO / REINFORCE++ on Hugging Face causal LMs.

    Args:
        cfg: the validated config.
        run_dir: where outputs go (default: ``cfg.trainer.output_dir`` with ``{time}`` filled in).
    """

    def __init__(self, cfg: TetherConfig, run_dir: Path | None = None):
        self.cfg = cfg
        threads = cfg.trainer.threads or (1 if cfg.actor.model == EMBEDDED else 0)
        if threads:
            torch.set_num_threads(threads)
        seed_everything(cfg.trainer.seed)
        self.run_dir, claimed = claim_run_dir(run_dir, cfg.trainer.output_dir)

        self._lock = lock.acquire(self.run_dir)  # one run per directory (RunDirLocked names the holder)
        try:
            # resume=off on an earlier run: refused before models load
            check_fresh_start(self.run_dir, cfg.trainer.resume)
            self._setup(cfg)
        except BaseException:
            if getattr(self, "roles", None) is not None:
                self.roles.close()
            lock.release(self._lock)
            if claimed and {p.name for p in self.run_dir.iterdir()} <= {lock.LOCK_FILE}:
                (self.run_dir / lock.LOCK_FILE).unlink(missing_ok=True)
                self.run_dir.rmdir()  # a failed start leaves no empty run directory behind
            raise
        # only a start that got this far writes its config (a failed one never overwrites a run's)
        (self.run_dir / "config.yaml").write_text(config_to_yaml(cfg))

        self.logger = MetricsLogger(
            self.run_dir, cfg.trainer.loggers, config=cfg.to_dict(), project=cfg.trainer.project, resume_step=self.step
        )

        t = cfg.trainer
        self.records = RolloutRecorder(
            self.run_dir,
            every=t.log_rollouts,
            k=t.log_rollouts_k,
            max_mb=t.log_rollouts_max_mb,
            seed=t.seed,
            resume_step=self.step,
            token_text=lambda ids: [self.tok.decode([i]) for i in ids],
        )
        self.val_samples: list[dict] = []  # the last validation's samples, until the rollout records take them
        self.diagnostics = LiveDiagnostics(config=cfg.to_dict())  # every LIVE_EVERY steps, as tether doctor replays
        if self.step:
            self.diagnostics.load(read_metrics(self.run_dir))
            replayed = self.ckpt.restore_diagnostics(self.diagnostics)
            self.react(replayed, log_them=False, resumed=True)  # a rollback the step's warning caused happens again

    def _setup(self, cfg: TetherConfig) -> None:
        """Load models, data and state; resume. Raises ConfigError/DataError/CheckpointError before training."""
        train_rows, val_rows = load_prompt_rows(cfg.data, cfg.trainer.seed)  # bad data fails before any model loads
        # guard.rollback_metric=gold without a gold reward fails here, before any model loads
        startup.check_gold(cfg, val_rows)
        startup.check_rollback_targets(cfg)  # a warning: checkpoints never validated at their own step
        startup.check_agent_rows(cfg, train_rows, val_rows)  # agent.environments: each row's pick, before any model
        self.roles = build_roles(cfg)  # tokenizer, actor, ref, critic, engine, reward, device
        self.tok, self.device = self.roles.tokenizer, self.roles.device
        engine = self.roles.engine.engine
        if cfg.algo.rollout_correction.active and not engine.capabilities.logprobs:
            raise ConfigError(
                f"algo.rollout_correction needs the sampled tokens' log-probs, and rollout.engine={engine.name} "
                "returns none here (a vLLM without logprobs_mode); use rollout.engine=hf or a newer vLLM, or set "
                "algo.rollout_correction.level=none and algo.rollout_correction.reject=none"
            )
        if cfg.rollout.mode == "offline":  # data.filter, data.overlong_responses (counts logged)
            train_rows = prepare_offline_rows(train_rows, self.tok, cfg.data, cfg.rollout.max_new_tokens)
        self.train_set = prepare_prompts(train_rows, self.tok, cfg.data, "data.train_files")
        self.val_set = prepare_prompts(val_rows, self.tok, cfg.data, "data.val_files")
        startup.check_context_length(cfg, self.roles.model_paths, self.train_set, self.val_set)
        # before any work
        startup.check_rollout_memory(
            cfg, self.roles.model_paths["actor.model"], self.device, engine.name, self.train_set
        )
        startup.warn_batch_larger_than_data(cfg, len(self.train_set))
        startup.log_reuse_logprobs(cfg, has_critic=self.roles.critic is not None, has_dropout=self._actor_has_dropout)
        startup.warn_partly_inert_settings(cfg)
        if hasattr(self.roles.reward, "check_rows"):
            self.roles.reward.check_rows(train_rows + val_rows)  # an unknown data_source fails here, not mid-run
        self.sampler = PromptSampler(len(self.train_set), cfg.data.batch_size, cfg.trainer.seed, cfg.data.shuffle)
        self.controller = make_kl_controller(cfg.kl.controller, **controller_kwargs(cfg))
        a = cfg.algo  # algo.entropy_target: the entropy bonus's α by dual ascent; None = α fixed at algo.entropy_coef
        self.entropy_controller = (
            None
            if a.entropy_target is None
            else EntropyCoefController(
                a.entropy_coef, target=a.entropy_target, lr=a.entropy_coef_lr, coef_max=a.entropy_coef_max
            )
        )
        self.guard = GuardMonitor(cfg.guard, max_failed_steps=cfg.reward.max_failed_steps)
        # trainer.wait_notice_s: a phase that runs long says what it waits for
        self.notices = WaitNotices(cfg.trainer.wait_notice_s, what_phases_wait_for(cfg))
        self.step = 0
        self.last_val: dict[str, float] = {}

        # rollout.async_steps=k: batches are generated k steps ahead, the next one during each update
        self.async_rollout = build_async_rollout(cfg, self.roles, self.train_set, self.sampler)

        self.exact_cache = ExactCache()  # exact/* metrics' enumeration of the reference
        self.ckpt = CheckpointManager(
            self.run_dir,
            cfg,
            self.roles,
            controller=self.controller,
            sampler=self.sampler,
            guard=self.guard,
            exact_cache=self.exact_cache,
            async_rollout=self.async_rollout,
            entropy_controller=self.entropy_controller,
        )
        resumed = self.ckpt.maybe_resume()
        if resumed is not None:
            self.step, self.last_val = resumed

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict]:
        """Train for ``trainer.total_steps`` steps (continuing a resumed run); returns the step metrics."""
        history = []
        progress = Progress(self.cfg.trainer.total_steps, self.step, enabled=self.cfg.trainer.progress)
        first_step = self.step
        try:
            # SIGTERM/SIGINT: finish the step, checkpoint, stop
            with StopSignals(self.cfg.trainer.stop_grace_s) as self._signals:
                if self.step == 0 and self.cfg.trainer.val_freq:
                    with self.notices("validate", 0):
                        val = self.maybe_validate(force=True)  # the reference's scores, as step 0
                    self.guard_validation(val)
                    val |= self.records.maybe_record(0, None, self.take_val_samples())
                    self.logger.log_samples(0, self.records.last_rows)
                    self.logger.log(0, val)
                    self.diagnostics.observe(0, val)  # the reference's gold: the monitor's first best
                    if self.cfg.guard.on_hacking == "rollback":
                        # the reference's weights as a checkpoint: a hack from the first update (onset at step 0) has
                        # a checkpoint strictly before it to return to (docs/hacking.md)
                        self.ckpt.save(0, self.last_val, diagnostics=self.diagnostics)
                if self.step >= self.cfg.trainer.total_steps:
                    log.warning(
                        "nothing to train: the run is already at step %d >= trainer.total_steps=%d (raise "
                        "trainer.total_steps to continue it)",
                        self.step,
                        self.cfg.trainer.total_steps,
                    )
                while self.step < self.cfg.trainer.total_steps:
                    metrics = self.train_step_or_abandon()
                    history.append(metrics)
                    progress.update(metrics)
                    if self._signals.signum is not None and self.ckpt.last_saved_step == self.step:
                        raise TrainingInterrupted(self._signals.signum, self.step)
                self.resave_after_rollback()
                self.roles.actor.refresh()  # this process's copy of the policy is the trained one when fit returns
        except TrainingStopped as stop:
            log.error("training stopped at step %d: %s", self.step, stop)
            if stop.save:
                self.ckpt.save(self.step, self.last_val, final=True, diagnostics=self.diagnostics, logger=self.logger)
            raise
        finally:
            progress.close()
            self.logger.close()
            if self.async_rollout is not None:
                self.async_rollout.close()
            self.roles.close()
            lock.release(self._lock)  # the directory is free for the next command (resume, extend)
        if (failed := self.guard.all_steps_failed(self.step - first_step)) is not None:
            raise failed  # every step was empty: an error exit, its checkpoint (at total_steps) already written
        if self.cfg.trainer.report:
            try:
                write_report(self.run_dir)
            # the training is done and checkpointed: say so, do not fail it
            except (OutputPathError, OutputWriteError) as e:
                log.warning("report not written (%s); make it later with: tether report %s", e, self.run_dir)
        return history

    def resave_after_rollback(self) -> None:
        """Write the last step's checkpoint again when that step rolled back after it was written.

        A step's checkpoint is written before the doctor looks (so a hacking rollback's target is strictly earlier),
        and mid-run a resume from it replays the rollback. When the last step rolls back, the run ends on the
        restored weights, yet its latest checkpoint would hold the discarded ones, which ``tether export`` and
        ``tether eval`` of the run directory read. So that checkpoint is written again, with the restored weights and
        the guard's and the doctor's state after the rollback, and without the step's record: a resume from it (a
        larger ``trainer.total_steps``) goes on from the rollback, as this process would, instead of replaying it."""
        restores = getattr(self.guard, "restores", 0)
        if self.ckpt.last_saved_step != self.step or restores == getattr(self, "_restores_at_save", restores):
            return
        self.ckpt.save(self.step, self.last_val, diagnostics=self.diagnostics)
        self._restores_at_save = restores
        log.info(
            "step %d's checkpoint written again after its rollback: it holds step %s's weights, the ones the run ends "
            "with",
            self.step,
            getattr(self.guard, "restored_step", "?"),
        )

    def train_step_or_abandon(self) -> dict[str, float]:
        """:meth:`train_step`; after a SIGTERM/SIGINT to the whole process group, whose Ray workers (and local Ray) it
        may
        have stopped mid-step, a worker that dies abandons the step like a second signal: the run exits with the
        signal's code and the last complete checkpoint, not with the worker's error."""
        try:
            return self.train_step()
        except Exception as e:
            signum = getattr(getattr(self, "_signals", None), "signum", None)
            if signum is None or not type(e).__module__.startswith(("ray", "tether.distributed")):
                raise
            log.warning(
                "%s: the step in progress failed after it (%s: %s); abandoning it without a new checkpoint",
                signal_name(signum),
                type(e).__name__,
                str(e).splitlines()[0][:300],
            )
            raise TrainingInterrupted(signum) from e

    def train_step(self) -> dict[str, float]:
        """One step: the algorithm, phase by phase."""
        self.step += 1
        t_step = time.perf_counter()
        timer = PhaseTimer(self.notices, self.step)
        batch = self.sample(timer)  # rollout, reward (repeated under algo.filter_groups, DAPO)
        with timer("logprobs"):
            self.compute_logprobs(batch)
        if self.roles.teacher is not None:
            with timer("teacher"):
                self.compute_teacher_logprobs(batch)
        with timer("rollout_correction"):
            self.correct_rollout(batch)
            self.mask_tokens(batch)  # algo.mask_truncated, algo.top_entropy_quantile
        with timer("values"):
            self.compute_values(batch)
        with timer("kl"):
            self.apply_kl(batch)
        with timer("advantages"):
            self.compute_advantages(batch)
        action = self.guard.before_update(
            self.step,
            self.kl_mean(batch),
            batch.scores,
            self.beta,
            n_valid=self.n_valid(batch),
            why=drop_reasons(batch),
        )
        update_metrics = {}
        if action == "update":
            with timer("update_critic"):
                update_metrics |= self.update_critic(batch)
            with timer("update_actor"):
                update_metrics |= self.update_actor(batch)
            # every token masked out of the loss, step after step, stops as an all-failing reward does
            self.guard.check_trained(self.step, self.untrained_reason(batch, update_metrics))
        if self.async_rollout is not None:
            with timer("rollout_join"):  # the next batch, before anything else draws from the RNG (validation)
                self.async_rollout.join()
        if batch.kl is None:  # the update gave the old log-probs (actor.reuse_update_logprobs)
            with timer("kl"):
                self.finish_kl(batch)
        with timer("controller"):
            self.update_controller(batch)
        metrics = self.step_metrics(batch) | update_metrics
        with timer("validate"):
            val = self.maybe_validate()
            self.guard_validation(val)  # guard.rollback_*: a validation that fell rolls back (a state change)
        metrics |= val
        if self.records.due(self.step) or self.val_samples:  # trainer.log_rollouts
            with timer("records"):
                metrics |= self.records.maybe_record(self.step, batch, self.take_val_samples())
                self.logger.log_samples(self.step, self.records.last_rows)
        metrics |= self.guard.after_step(self.step, metrics)  # guard/* of the step, rollbacks included
        metrics["kl/coef_next"] = self.beta  # after the controller and any guard: the next step's β
        with timer("checkpoint"):
            # the step's line is kept in the checkpoint
            saved = self.ckpt.maybe_save(
                self.step, self.last_val, metrics, force=self.stop_requested, diagnostics=self.diagnostics
            )
        if saved is not None:  # a rollback after this save (the doctor's, below) leaves other weights than it holds
            self._restores_at_save = getattr(self.guard, "restores", 0)
        metrics |= timer.times | self.perf_metrics(batch, timer.times)
        metrics["timing/step_s"] = time.perf_counter() - t_step
        # the doctor's live checks; guard.on_hacking (stop raises here)
        self.react(self.diagnostics.update(self.step, metrics))
        # a hacking rollback's guard/* and β, in this step's line
        metrics |= self.guard.pop_metrics() | {"kl/coef_next": self.beta}
        self.logger.log(self.step, metrics)
        return metrics

    def react(self, findings, *, log_them: bool = True, resumed: bool = False) -> None:
        """Log the doctor's new live findings; a reward-hacking one the guard acts on
        (``tether.diagnostics.GUARDED_HACKING_CHECKS``: not the warn-only ``hacking_kl_focus``) goes to the guard
        (``guard.on_hacking``: warn, rollback or stop; once a step), before the step's line is logged, so a rollback's
        ``guard/*`` are in it and a stop writes it once; in a run that logs a gold reward only the gold check's (a
        ``hacking_proxy`` warning there is logged, not acted on). Under ``rollback`` the guard acts before any line of
        the step is logged: the line of the finding it acted on says so, and every other line of the step says the
        rollback superseded its advice (written before the restore). On resume the checkpointed step's findings are
        replayed: a rollback is applied again, a stop is not."""
        gold = self.diagnostics.gold_seen
        mode = self.cfg.guard.on_hacking
        guarded = [  # warnings only: an info finding (a gold below 0, not judged) is no hack to act on
            f
            for f in findings
            if f.check in GUARDED_HACKING_CHECKS
            and f.severity == "warning"
            and not (gold and f.check == "hacking_proxy")
        ]
        # one reaction a step: both checks firing together are one event (hacking_gold's, listed first)
        target = guarded[0] if guarded and not (resumed and mode == "stop") else None
        handled = None  # the finding a rollback acted on (restored, raised β): it replaces the step's advice
        if target is not None and mode == "rollback":  # before any line, so each line of the step can say so
            state = (getattr(self.guard, "restores", 0), self.beta)
            self.guard.on_hacking(self.step, target, self.ckpt, self.roles, self.controller.value)
            if (getattr(self.guard, "restores", 0), self.beta) != state:
                handled = target
        for finding in findings:
            if log_them:
                tail = f"; suggestion: {finding.suggestion}" if finding.suggestion else ""
                if finding is handled:
                    tail = f"; guard.on_hacking=rollback acted on it (β now {self.beta:.4g})"
                elif handled is not None:  # its advice (a larger β, say) was written before the restore
                    tail = (
                        "; superseded: guard.on_hacking=rollback restored an earlier checkpoint this step"
                        f" (β now {self.beta:.4g})"
                    )
                if finding.check == "hacking_proxy" and gold and mode != "warn":
                    tail += "; guard.on_hacking acts on the gold check alone in a run with a gold reward"
                log.warning("doctor: %s%s", finding.message.rstrip(". "), tail)
            if finding is target and mode != "rollback":
                self.guard.on_hacking(self.step, finding, self.ckpt, self.roles, self.controller.value)
        # a rollback this step (a hacking one, or the validation's): a hack that comes back after it is a new event
        restores = getattr(self.guard, "restores", 0)
        if restores != getattr(self, "_restores_seen", 0):
            self.diagnostics.forget_findings()
        self._restores_seen = restores

    @property
    def stop_requested(self) -> bool:
        """A SIGTERM/SIGINT arrived during :meth:`fit`: this step is checkpointed, then the run stops."""
        signals = getattr(self, "_signals", None)
        return signals is not None and signals.signum is not None

    # ------------------------------------------------------------------ phases
    @property
    def beta(self) -> float:
        """β in use: the controller's value times the guard's scale (raised after KL explosions), at least the guard's
        floor
        (set by a hacking rollback)."""
        return self.guard.beta(self.controller.value)

    @property
    def entropy_coef(self) -> float:
        """α of the entropy bonus in use: ``algo.entropy_target``'s controller, else ``algo.entropy_coef``."""
        return self.cfg.algo.entropy_coef if self.entropy_controller is None else self.entropy_controller.value

    def sample(self, timer: PhaseTimer) -> RolloutBatch:
        """Rollout then reward; under ``algo.filter_groups`` DAPO's dynamic sampling (trainer/sampling.py)."""
        if self.cfg.algo.filter_groups:
            return dynamic_sample(
                self.rollout,
                self.score,
                timer,
                batch_size=self.cfg.data.batch_size,
                max_draws=self.cfg.algo.filter_groups_max_draws,
                pad_id=self.tok.pad_token_id,
                step=self.step,
            )
        with timer("rollout"):
            batch = self.rollout()
        with timer("reward"):
            self.score(batch)
        return batch

    def rollout(self) -> RolloutBatch:
        """Sample ``rollout.n`` responses for each of ``data.batch_size`` prompts; under
        ``rollout.async_steps=k`` the batch generated k updates ago, with its behaviour policy's
        old_logprobs (``tether.trainer.async_rollout``), and the one k steps ahead is started."""
        if self.async_rollout is not None:
            return self.async_rollout.next_batch(self.step, remaining=self.cfg.trainer.total_steps - self.step)
        return self.roles.engine.rollout(self.train_set, self.sampler.next_batch(), self.cfg.rollout.n)

    def score(self, batch: RolloutBatch) -> None:
        """Sequence scores from the reward function/model; samples the reward cannot score are dropped and counted.

        An empty response (the model ended at once: its EOS is an action with a log-prob) is scored like any other
        and trained on, counted in ``rollout/empty_count``. Dropping it would leave the policy free to move mass onto
        ending at once, with no reward, no KL and no gradient against it (on the embedded tool task a run did, and
        its exact success fell below the reference's).

        ``agent.on_prefix_mismatch=split`` (rows are pieces, ``extra["agent_trajectory"]``): each trajectory is scored
        once, whole (``extra["agent_joined"]``: its pieces and the observations between them, as it would be scored
        unsplit), the score on its last piece and 0 on the others (as on a non-final turn); a trajectory dropped
        drops all its pieces; the reward metrics are over trajectories."""
        joined = batch.extra.get("agent_joined")
        if joined is not None:
            self._score_rows(joined)
            traj = batch.extra["agent_trajectory"].to(self.device)  # (B,) each row's trajectory, pieces in order
            last = torch.ones_like(traj, dtype=torch.bool)
            last[:-1] = traj[1:] != traj[:-1]  # (B,) a trajectory's last piece
            batch.scores = torch.where(last, joined.scores[traj], 0.0)
            batch.drop(joined.response_mask.sum(-1)[traj] == 0)
            batch.extra["reward_metrics"] = joined.extra["reward_metrics"]
            return
        self._score_rows(batch)

    def _score_rows(self, batch: RolloutBatch) -> None:
        """:meth:`score` with each row a trajectory."""
        result = self.roles.reward(batch.rows, batch.prompts, batch.responses)
        batch.scores = result.scores.to(self.device)
        # a multi-turn trajectory whose environment failed is already dropped (agent/env_errors), not empty
        failed = batch.extra.get("agent_failed", torch.zeros(len(batch), dtype=torch.bool)).to(self.device)
        # counted, not dropped: an empty response is an action the reward judges
        empty = torch.tensor([not r.strip() for r in batch.responses], device=self.device) & ~failed
        batch.drop(~result.valid.to(self.device) | failed)
        batch.extra["reward_metrics"] = (
            dict(result.metrics) | {"rollout/empty_count": float(empty.sum())} | self.penalize_overlong(batch)
        )
        for msg in result.errors[:3]:
            log.warning("step %d: reward: %s", self.step, msg)

    def penalize_overlong(self, batch: RolloutBatch) -> dict[str, float]:
        """``reward.overlong_buffer``: DAPO's soft overlong penalty (``tether.algos.overlong_penalty``) added to
        ``batch.scores`` of the counted responses, after the reward's clipping and normalisation; its metrics."""
        r = self.cfg.reward
        if not r.overlong_buffer:
            return {}
        lengths = batch.response_lengths  # counted tokens, EOS included (0 for a dropped sample)
        penalty = overlong_penalty(lengths, self.cfg.rollout.max_new_tokens, r.overlong_buffer, r.overlong_penalty).to(
            batch.scores
        )
        valid = lengths > 0
        batch.scores = batch.scores + torch.where(valid, penalty, 0.0)
        n = int(valid.sum())
        return {
            "reward/overlong_penalty_mean": float(penalty[valid].mean()) if n else float("nan"),
            "reward/overlong_frac": float((penalty[valid] < 0).float().mean()) if n else float("nan"),
        }

    def mask_tokens(self, batch: RolloutBatch) -> None:
        """The tokens the actor trains on, after rollout correction: ``algo.mask_truncated`` takes responses cut at
        ``rollout.max_new_tokens`` out of ``batch.loss_mask`` (loss and token counts); ``algo.top_entropy_quantile``
        keeps the policy loss to the step's highest-entropy tokens of what remains (``batch.entropy_mask``, one
        threshold over the whole batch from π_old's entropy). Metrics ``actor/masked_truncated``,
        ``actor/entropy_mask_frac``."""
        a, metrics = self.cfg.algo, {}
        if a.mask_truncated:
            truncated = (
                batch.truncated
                if batch.truncated is not None
                else truncated_rows(batch.response_ids, self.tok.eos_token_id)
            )
            counted = batch.response_mask.sum(-1) > 0
            cut = truncated.to(counted.device) & counted  # (B,) counted responses without EOS
            keep = (~cut).unsqueeze(1).expand_as(batch.response_mask)
            batch.loss_mask = keep if batch.loss_mask is None else batch.loss_mask.to(keep.device) & keep
            metrics["actor/masked_truncated"] = float(cut.sum())
            if bool(cut.any()) and bool(cut.sum() == counted.sum()):
                log.warning(
                    "step %d: algo.mask_truncated took all %d responses out of the loss (none ended within "
                    "rollout.max_new_tokens=%d): nothing of this batch is trained; raise rollout.max_new_tokens",
                    self.step,
                    int(cut.sum()),
                    self.cfg.rollout.max_new_tokens,
                )
        if a.top_entropy_quantile < 1:
            # the config refuses actor.old_logprobs_source=rollout, and reuse_update_logprobs gives way
            if batch.entropy is None:
                raise RuntimeError("algo.top_entropy_quantile: this batch has no entropy of π_old")
            mask = batch.update_mask
            batch.entropy_mask, _ = top_entropy_mask(batch.entropy, mask, a.top_entropy_quantile)
            n = int(mask.bool().sum())
            metrics["actor/entropy_mask_frac"] = float(batch.entropy_mask.sum()) / n if n else float("nan")
        batch.extra["control_metrics"] = batch.extra.get("control_metrics", {}) | metrics

    def reuse_update_logprobs(self, batch: RolloutBatch) -> bool:
        """Whether the update's own log-probs, detached, serve as old_logprobs (actor.reuse_update_logprobs).

        Exact when the old policy is the current one (one epoch, one mini-batch per step), and used only
        where nothing needs π_old's log-probs before the update: no KL in the reward, no exact (full)
        KL, no critic, and guard.on_max_kl=raise_coef (the KL check then follows the update).
        """
        if not self.cfg.actor.reuse_update_logprobs:
            return False
        has_critic = self.roles.critic is not None
        return not startup.reuse_logprobs_blockers(
            self.cfg, has_critic=has_critic, has_dropout=self._actor_has_dropout, responses=len(batch)
        )

    def rollout_old_logprobs(self, batch: RolloutBatch) -> bool:
        """actor.old_logprobs_source=rollout: old_logprobs := the engine's sampled-token log-probs (0 on
        padding), entropy not measured. A batch with a counted token whose log-prob the engine did not
        return (NaN, e.g. an EOS an old vLLM dropped) is recomputed instead; ``rollout/old_logprobs_from_rollout``
        says which (1 or 0)."""
        if self.cfg.actor.old_logprobs_source != "rollout":
            return False
        lp, mask = batch.rollout_logprobs, batch.update_mask.bool()  # the generated tokens
        ok = lp is not None and bool(torch.isfinite(lp[mask]).all())
        batch.extra["old_logprobs_metrics"] = {"rollout/old_logprobs_from_rollout": float(ok)}
        if ok:
            batch.old_logprobs, batch.entropy = torch.where(mask, lp.float(), 0.0), None
        return ok

    @functools.cached_property
    def _actor_has_dropout(self) -> bool:
        """Dropout in the actor (a Dropout module with p > 0, e.g. LoRA's, or attention dropout in its
        config): the update's train-mode forward then differs from the no-grad eval pass, so it is not reused."""
        model = self.roles.actor.model
        modules = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
        return modules or float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0) > 0

    def compute_logprobs(self, batch: RolloutBatch) -> None:
        """old_logprobs and entropy from the actor, ref_logprobs from the reference (one pass each); the
        actor's pass is left to the update when :meth:`reuse_update_logprobs`, not made when the batch
        carries its behaviour policy's (``rollout.async_steps``), and skipped when old_logprobs are
        the rollout engine's (:meth:`rollout_old_logprobs`)."""
        if batch.old_logprobs is None and self.rollout_old_logprobs(batch):
            batch.ref_logprobs = self.roles.ref.compute_logprobs(batch)
            return
        if batch.old_logprobs is not None or self.reuse_update_logprobs(batch):
            batch.ref_logprobs = self.roles.ref.compute_logprobs(batch)
            return
        full = self.roles.ref if self.cfg.kl.estimator == "full" else None
        distill = distill_spec(self.cfg)  # a full-vocabulary divergence to the teacher: its logits in the same pass
        got: dict = {}
        batch.old_logprobs, batch.entropy, kl_full, ref_lp = self.roles.actor.compute_logprobs(
            batch,
            with_entropy=True,
            full_kl_ref=full,
            teacher=self.roles.teacher if distill is not None else None,
            distill=distill,
            distill_out=got,
        )
        if got:
            batch.teacher_logprobs = got.pop("teacher_logprobs")
            batch.extra["distill_full"] = got
        batch.ref_logprobs = ref_lp if ref_lp is not None else self.roles.ref.compute_logprobs(batch)
        if kl_full is not None:
            batch.extra["kl_full"] = kl_full

    def correct_rollout(self, batch: RolloutBatch) -> None:
        """``algo.rollout_correction``: importance weights π_old/π_rollout (truncated or masked) and the rejection
        of divergent samples, into ``batch.is_weights`` and ``batch.loss_mask`` for the update; ``rollout_corr/*``
        metrics. In bypass mode (``actor.old_logprobs_source=rollout``: π_old is π_rollout) the actor applies it per
        micro-batch against π_θ instead (``ActorUpdateSpec.bypass_correction``)."""
        rc = self.cfg.algo.rollout_correction
        if not rc.active or self.cfg.actor.old_logprobs_source == "rollout":
            return
        if batch.rollout_logprobs is None:  # every engine that setup accepts returns them; a batch without is a bug
            raise RuntimeError("algo.rollout_correction: the rollout engine returned no log-probs for this batch")
        batch.is_weights, keep, metrics = rollout_correction(
            batch.old_logprobs,
            batch.rollout_logprobs.to(batch.old_logprobs.device),
            batch.update_mask,  # the generated tokens: the engine's log-probs are of those
            batch_normalize=rc.batch_normalize,
            **correction_kwargs(self.cfg),
        )
        batch.loss_mask = keep if batch.loss_mask is None else batch.loss_mask.to(keep.device) & keep
        batch.extra["rollout_corr_metrics"] = metrics
        if metrics.get("rollout_corr/rejected_frac", 0.0) >= 1.0:
            log.warning(
                "step %d: algo.rollout_correction rejected every token (reject=%s, reject_threshold=%g; "
                "rollout_corr/k3_kl=%.4f): nothing of this batch is trained; raise "
                "algo.rollout_correction.reject_threshold",
                self.step,
                rc.reject,
                rc.reject_threshold,
                metrics["rollout_corr/k3_kl"],
            )

    def compute_values(self, batch: RolloutBatch) -> None:
        if self.roles.critic is not None:
            batch.values = self.roles.critic.compute_values(batch)

    def apply_kl(self, batch: RolloutBatch) -> None:
        """Per-token KL to the reference, and the token-level rewards (β·KL subtracted when placed in the reward)."""
        kl_cfg = self.cfg.kl
        if batch.old_logprobs is None:  # measured by the update (reuse_update_logprobs): the KL is not in the reward
            batch.kl = None
            batch.extra["kl_coef"] = self.beta  # this step's β (kl/coef): before the controller and guards move it
            batch.token_level_rewards = token_level_rewards_from_kl(
                batch.scores,
                torch.zeros_like(batch.ref_logprobs),
                batch.action_mask,
                0.0,
                turn_rewards=batch.turn_rewards,
            )
            return
        if kl_cfg.estimator == "full":
            kl = batch.extra["kl_full"]
        else:
            kl = kl_penalty(
                batch.old_logprobs,
                batch.ref_logprobs,
                kl_cfg.estimator,
                log_ratio_clamp=kl_cfg.log_ratio_clamp,
                value_clamp=kl_cfg.value_clamp,
            )
        mask = batch.action_mask  # the model's tokens: an observation's log-prob is not an action's
        batch.kl = torch.where(mask.bool(), kl, 0.0)
        batch.extra["kl_coef"] = self.beta  # this step's β (kl/coef): before the controller and guards move it
        beta = self.beta if kl_cfg.placement in ("reward", "both") else 0.0
        # the score on the last model token, per-turn rewards on each turn's last one, −β·KL on every model token
        batch.token_level_rewards = token_level_rewards_from_kl(
            batch.scores, batch.kl, mask, beta, turn_rewards=batch.turn_rewards
        )
        self.apply_distill(batch)

    def compute_teacher_logprobs(self, batch: RolloutBatch) -> None:
        """``distill.teacher``: the teacher's log-probs of the sampled tokens, one no-grad pass over the batch (at
        rollout.temperature, as the reference's)."""
        if batch.teacher_logprobs is None:  # a full-vocabulary estimator's came with the actor's pass
            batch.teacher_logprobs = self.roles.teacher.compute_logprobs(batch)

    def apply_distill(self, batch: RolloutBatch) -> None:
        """On-policy distillation: λ·k1 to the teacher (k1 = log π_old − log π_teacher at the sampled token,
        :func:`tether.algos.distill_k1`) subtracted from each response token's reward; ``distill/*`` metrics. The
        old log-probs are known here: ``actor.reuse_update_logprobs`` gives way to distillation
        (``tether.trainer.startup.reuse_logprobs_blockers``)."""
        if batch.teacher_logprobs is None:
            return
        if batch.old_logprobs is None:  # reuse_update_logprobs gives way to distill.teacher: a batch without is a bug
            raise RuntimeError("distill.teacher: this batch has no old log-probs before the update")
        lam = self.cfg.distill.coef
        if "distill_full" in batch.extra:
            self._apply_full_distill(batch, batch.extra["distill_full"], lam)
            return
        mask = batch.action_mask  # the model's tokens
        k1 = distill_k1(batch.old_logprobs, batch.teacher_logprobs, mask)
        batch.token_level_rewards = subtract_token_penalty(batch.token_level_rewards, k1, mask, lam)
        batch.extra["distill_metrics"] = {
            # per-token k1 averaged over each response, then over responses (as kl/ref_mean): nats/token
            "distill/kl_student_teacher": float(mean_kl_per_token(k1, mask)),
            # Σ_t k1 per response, averaged: unbiased for KL_seq(π_old ‖ π_teacher) under π_old's samples
            "distill/kl_student_teacher_seq": float(sequence_kl_mean(k1, mask)),
            "distill/coef": lam,
        }

    def _apply_full_distill(self, batch: RolloutBatch, got: dict, lam: float) -> None:
        """``distill.estimator=reverse|forward|jsd``: the per-state divergence f_t at π_old (detached) subtracted, times
        λ, from each response token's reward: the state-visitation part of ∇D (the actor's loss term carries the
        per-state part; ``tether.algos.distill``). Metrics: the exact per-state means, named by direction."""
        d, mask = self.cfg.distill, batch.action_mask  # the model's tokens
        f = got["divergence"]
        batch.token_level_rewards = subtract_token_penalty(batch.token_level_rewards, f, mask, lam)
        name = {"reverse": "kl_student_teacher", "forward": "kl_teacher_student", "jsd": "jsd"}[d.estimator]
        suffix = "_top_k" if d.top_k is not None else ""
        metrics = {
            # the full-vocabulary KL(π_old(·|s_t) ‖ π_T(·|s_t)) at each visited state: averaged over each response's
            # tokens, then over responses (nats/token); summed per response and averaged (nats/response), unbiased for
            # KL_seq(π_old ‖ π_T) under π_old's samples
            "distill/kl_student_teacher": float(mean_kl_per_token(got["kl_student_teacher"], mask)),
            "distill/kl_student_teacher_seq": float(sequence_kl_mean(got["kl_student_teacher"], mask)),
            # the optimised divergence f (with distill.top_k: renormalised over the teacher's top k)
            f"distill/{name}{suffix}": float(mean_kl_per_token(f, mask)),
            f"distill/{name}{suffix}_seq": float(sequence_kl_mean(f, mask)),
            "distill/coef": lam,
        }
        batch.extra["distill_metrics"] = metrics

    def finish_kl(self, batch: RolloutBatch) -> None:
        """The KL to the reference and its guard check, after an update that measured the old log-probs
        itself (measured here instead when no update ran, for the step's metrics)."""
        if batch.old_logprobs is None:
            batch.old_logprobs, batch.entropy, _, _ = self.roles.actor.compute_logprobs(batch, with_entropy=True)
        k = self.cfg.kl
        kl = kl_penalty(
            batch.old_logprobs,
            batch.ref_logprobs,
            k.estimator,
            log_ratio_clamp=k.log_ratio_clamp,
            value_clamp=k.value_clamp,
        )
        batch.kl = torch.where(batch.action_mask.bool(), kl, 0.0)
        if self.n_valid(batch):
            self.guard.check_kl(self.step, self.kl_mean(batch), self.beta, after_update=True)

    def compute_advantages(self, batch: RolloutBatch) -> None:
        a = self.cfg.algo
        inputs = AdvantageInputs(
            token_level_rewards=batch.token_level_rewards,
            # returns run across turns over the model's tokens: an observation token is skipped, not a step
            response_mask=batch.action_mask,
            group_ids=batch.group_ids,
            values=batch.values,
            gamma=a.gamma,
            lam=a.lam,
            norm_by_std=a.norm_by_std,
            # agent.on_prefix_mismatch=split: a trajectory's pieces count once, sharing its advantage
            trajectory=batch.extra.get("agent_trajectory"),
        )
        batch.advantages, batch.returns = compute_advantages(a.adv_estimator, inputs)

    def update_critic(self, batch: RolloutBatch) -> dict[str, float]:
        if self.roles.critic is None:
            return {}
        a = self.cfg.algo
        return self.roles.critic.update(
            batch,
            ppo_epochs=a.ppo_epochs,
            mini_batch_size=a.mini_batch_size,
            agg_mode=a.agg_mode,
            seed=self.cfg.trainer.seed,
            step=self.step,
        )

    def update_actor(self, batch: RolloutBatch) -> dict[str, float]:
        if self.step <= self.cfg.critic.warmup_steps and self.roles.critic is not None:
            return {}
        if self.cfg.kl.placement == "loss":
            batch.extra["kl_coef"] = self.beta  # the loss's β is the step's (raised at a guard/kl_explosion step)
        beta = self.beta if self.cfg.kl.placement in ("loss", "both") else 0.0
        spec = actor_spec(self.cfg, beta, reuse_logprobs=batch.old_logprobs is None, entropy_coef=self.entropy_coef)
        # the teacher only with a full-vocabulary distillation estimator (the update's loss term needs its logits)
        teacher = {"teacher": self.roles.teacher} if spec.distill else {}
        metrics = self.roles.actor.update(batch, spec, self.step, ref=self.roles.ref, **teacher)
        # broken weights stop here, before anything samples them
        self.guard.check_update(self.step, metrics, lr=self.cfg.actor.lr)
        if spec.reuse_logprobs:  # π_old's log-probs and entropy, measured by the update's own forward
            batch.old_logprobs, batch.entropy = metrics.pop("_old_logprobs"), metrics.pop("_entropy")
        # vLLM replicas take the group's weights, not the driver's
        self.roles.engine.sync_weights(self.roles.actor.model_as_is)
        if self.cfg.ref.reset_every and self.step % self.cfg.ref.reset_every == 0:
            # a Ray reference pulls the driver's copy only if it needs it
            self.roles.ref.reset_to(self.roles.actor.model_as_is)
            self.exact_cache.reset_ref()  # exact/* metrics must see the new reference
        return metrics

    def untrained_reason(self, batch: RolloutBatch, update_metrics: dict) -> str:
        """Why the step's update trained no token, naming the setting that took them all out of the loss; "" when it
        trained some. Read from the batch's loss mask (``algo.rollout_correction``'s rejection, ``algo.mask_truncated``)
        and, in bypass mode (the actor rejects per micro-batch), from the update's ``rollout_corr/rejected_frac``."""
        if int(batch.update_mask.sum()) > 0 and update_metrics.get("rollout_corr/rejected_frac", 0.0) < 1.0:
            return ""
        rc, a = self.cfg.algo.rollout_correction, self.cfg.algo
        corr = batch.extra.get("rollout_corr_metrics", {}) | update_metrics
        if corr.get("rollout_corr/rejected_frac", 0.0) >= 1.0:
            return (
                f"algo.rollout_correction.reject={rc.reject} rejected every token (reject_threshold="
                f"{rc.reject_threshold:g}); raise algo.rollout_correction.reject_threshold or set "
                "algo.rollout_correction.reject=none"
            )
        if a.mask_truncated and batch.extra.get("control_metrics", {}).get("actor/masked_truncated", 0.0) > 0:
            return (
                f"algo.mask_truncated=true took every response out of the loss (none ended within "
                f"rollout.max_new_tokens={self.cfg.rollout.max_new_tokens}); raise rollout.max_new_tokens or set "
                "algo.mask_truncated=false"
            )
        return "no token of the batch was left in the actor's loss"

    @staticmethod
    def n_valid(batch: RolloutBatch) -> int:
        """Responses that still count after bad samples were dropped."""
        return int((batch.response_mask.sum(-1) > 0).sum())

    def kl_mean(self, batch: RolloutBatch) -> float | None:
        """kl/ref_mean: per-token KL averaged over each response, then over responses (nats per token);
        None while the update is still to measure it (reuse_update_logprobs)."""
        if batch.kl is None:
            return None
        if self.n_valid(batch) == 0:
            return float("nan")
        return float(mean_kl_per_token(batch.kl, batch.action_mask))

    def update_controller(self, batch: RolloutBatch) -> None:
        """β from ``kl/ref_mean``; the entropy bonus's α (``algo.entropy_target``) from ``policy/entropy``, its
        step's value logged first as ``actor/entropy_coef``."""
        kl = self.kl_mean(batch)
        if math.isfinite(kl):
            self.controller.update(kl, n_steps=self.n_valid(batch))
        batch.extra["control_metrics"] = batch.extra.get("control_metrics", {}) | {
            "actor/entropy_coef": self.entropy_coef
        }
        if self.entropy_controller is not None and batch.entropy is not None and self.n_valid(batch):
            # policy/entropy: π_old's entropy per token, averaged per counted response, then over responses (nats)
            self.entropy_controller.update(float(mean_kl_per_token(batch.entropy, batch.action_mask)))

    # ------------------------------------------------------------------ metrics, validation
    def perf_metrics(self, batch: RolloutBatch, times: dict[str, float]) -> dict[str, float]:
        """perf/tokens_per_s (response tokens over the training phases: all but validation and
        checkpointing), split into perf/generate_tokens_per_s (rollout) and perf/train_tokens_per_s
        (the phases after reward), and perf/mfu of the actor update (``tether.trainer.perf``)."""
        tokens = float(batch.response_mask.sum())
        train_s = sum(v for k, v in times.items() if k not in ("timing/validate_s", "timing/checkpoint_s"))
        wait_s = times.get("timing/rollout_s", 0.0) + times.get("timing/rollout_join_s", 0.0)  # the main thread's
        async_times = batch.extra.get("async_times", {})  # rollout.async_steps: the job's own, off the main thread
        gen_s = async_times.get("timing/async_generate_s", wait_s)
        out = async_times | {
            "perf/tokens_per_s": tokens / max(train_s, 1e-9),
            "perf/generate_tokens_per_s": tokens / max(gen_s, 1e-9),
            "perf/train_tokens_per_s": tokens / max(train_s - wait_s - times.get("timing/reward_s", 0.0), 1e-9),
        }
        update_s = times.get("timing/update_actor_s", 0.0)
        # shapes only: no weight pull
        if update_s > 0 and hasattr(self.roles.actor.model_as_is, "get_input_embeddings"):
            if not hasattr(self, "_matmul_ceiling"):
                # the dtype the update's matmuls run in: autocast's, else FSDP2's gather dtype (Ray), else storage
                a = self.cfg.actor
                dtype = DTYPES[
                    a.compute_dtype
                    if a.compute_dtype != "float32"
                    else (self.roles.placement.update_param_dtype or a.dtype)
                ]
                self._matmul_ceiling = matmul_ceiling_flops(self.device, dtype)
                self._matmul_params = matmul_params(self.roles.actor.model_as_is)
                log.info(
                    "perf/mfu: matmul ceiling %.1f GFLOP/s (%s, %s)", self._matmul_ceiling / 1e9, self.device, dtype
                )
            # each response's last token is never fed
            context = float(batch.prompt_mask.sum()) + tokens - self.n_valid(batch)
            flops = update_flops(*self._matmul_params, context, tokens) * self.cfg.algo.ppo_epochs
            out["perf/mfu"] = flops / update_s / self._matmul_ceiling
        return out

    def step_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        grouped = self.cfg.algo.adv_estimator in GROUP_ESTIMATORS
        return rollout_metrics(
            batch, beta=self.beta, eos_id=self.tok.eos_token_id, pad_id=self.tok.pad_token_id, grouped=grouped
        )

    def maybe_validate(self, force: bool = False) -> dict[str, float]:
        freq = self.cfg.trainer.val_freq
        due = force or (freq and (self.step % freq == 0 or self.step == self.cfg.trainer.total_steps))
        if not due or len(self.val_set) == 0:
            return {}
        samples = [] if self.records.every else None  # trainer.log_rollouts records every validation sample
        self.last_val = validate(
            self.cfg, self.roles, self.val_set, beta=self.beta, exact_cache=self.exact_cache, samples=samples
        )
        self.val_samples = samples or []
        return self.last_val

    def take_val_samples(self) -> list[dict]:
        """The last validation's per-sample records (once), for the rollout records."""
        samples, self.val_samples = self.val_samples, []
        return samples

    def guard_validation(self, val: dict[str, float]) -> None:
        """The guard reads a validation's score (``guard.rollback_metric``); one more than ``guard.rollback_drop`` below
        the stable checkpoint's rolls back: weights and optimizer moments restored, β and learning rates scaled."""
        if val:
            self.guard.after_validation(self.step, val, self.ckpt, self.roles, self.controller.value)


def drop_reasons(batch: RolloutBatch) -> str:
    """Why samples were dropped, from the reward's counters (e.g. ``reward/error_count=128``)."""
    m = batch.extra.get("reward_metrics", {}) | agent_metrics(batch.extra.get("agent_totals", {}))
    keys = (
        "agent/env_errors",
        "reward/error_count",
        "reward/nonfinite_count",
        "reward/nonnumeric_count",
        "reward/invalid_count",
    )
    return ", ".join(f"{k}={m[k]:g}" for k in keys if m.get(k))


def controller_kwargs(cfg: TetherConfig) -> dict:
    """Constructor arguments of the chosen KL controller, from the ``kl`` section."""
    k = cfg.kl
    common = dict(coef=k.coef, beta_min=k.beta_min, beta_max=k.beta_max)
    extra = {
        "fixed": {},
        "adaptive": dict(target=k.target, horizon=k.horizon),
        "band": dict(high=k.high, low=k.low, up=k.up, down=k.down),
        "exponential": dict(target=k.target, lr=k.lr),
        "scheduled": dict(
            kind=k.schedule.kind,
            stages=[list(s) for s in k.schedule.stages],
            final_coef=k.schedule.final_coef,
            total_steps=k.schedule.total_steps,
        ),
    }[k.controller]
    return common | extra
