"""Guards across steps: KL explosions, non-finite values, and rollback to the last stable checkpoint.

The within-step guard (early stop of PPO epochs on ``guard.target_kl``) and the per-mini-batch
non-finite check live in the actor update; :meth:`GuardMonitor.after_step` turns their counts into
console lines. Every event is a ``guard/<event>`` metric and a console line (``docs/checkpoints.md``
lists them all).
"""

from __future__ import annotations

import logging
import math

import torch

from tether.config import GuardConfig

log = logging.getLogger("tether")


class TrainingStopped(RuntimeError):
    """A guard stopped the run; the message says which and why. ``save``: whether the run's final checkpoint is
    written (False when the weights themselves are broken: the latest complete checkpoint stays the resume point)."""

    def __init__(self, message: str, *, save: bool = True):
        super().__init__(message)
        self.save = save


class GuardMonitor:
    """Watches each step before its update, after it, and each validation.

    State (checkpointed): ``coef_scale`` (β multiplier raised after KL explosions and rollbacks), ``coef_floor`` (β's
    floor after a hacking rollback: ``guard.hacking_coef``, doubled, by ``guard.coef_factor``, at each further one),
    ``rollbacks`` and the step of the last one (a step rolls back at most once), what each rollback did
    (``tried``: the step, the checkpoint restored and the β after it, named when ``guard.max_rollbacks`` stops the
    run), the last stable checkpoint's step and validation score, the gold reward's best validation and the
    checkpoints whose gold was within reach of it (a hacking rollback's targets; without a gold, the stable ones),
    and the step, score and gold of the last validation (a checkpoint is labelled with a score only when it was
    validated at its step).
    """

    def __init__(self, cfg: GuardConfig, *, max_failed_steps: int = 3):
        self.cfg = cfg
        # reward.max_failed_steps: this many steps in a row with no valid sample stop the run
        self.max_failed_steps = max_failed_steps
        self.empty_cause = ""  # what the last all-dropped step's counters blame (_drop_cause)
        self.coef_scale = 1.0
        self.coef_floor = 0.0  # β at least this after a hacking rollback (guard.hacking_coef): a β of 0 scaled stays 0
        self.rollbacks = 0
        self.stable_step: int | None = None
        self.stable_score: float | None = None
        self.stable_sem = 0.0
        self.empty_streak = 0  # consecutive steps whose every sample was dropped
        # consecutive steps that trained no token (every sample dropped, or every token masked out of the loss) and why
        self.untrained_streak = 0
        self.untrained_why = ""
        self.nonfinite_streak = 0  # consecutive steps with a non-finite update skipped (guard.max_nonfinite_steps)
        self.val_step: int | None = None
        self.val_score: float | None = None
        self.val_sem = 0.0
        self.rollback_step: int | None = None  # the last rollback's step: a step (one validation) rolls back once
        self.restored_step: int | None = None  # the checkpoint that rollback restored
        self.restores = 0  # checkpoints restored by this process (not checkpointed: a count the trainer compares)
        # the gold reward (exact/gold_mean, else val/gold_mean): the best validation's, the last validation's, and the
        # last checkpoint whose gold is not a drop from the best (gold_floor): where a hacking rollback returns
        self.gold_best: float | None = None
        self.gold_best_sem = 0.0
        self.val_gold: float | None = None
        self.val_gold_sem = 0.0
        self.gold_stable_step: int | None = None
        self.gold_stable_score: float | None = None
        # the checkpoints a hacking rollback may return to, oldest first: [step, score, sem] of each stable one (by
        # guard.rollback_metric) and [step, gold] of each whose gold held; a restore drops those after its checkpoint
        self.stable_steps: list[list] = []
        self.gold_stable_steps: list[list] = []
        self.tried: list[list] = []  # [step, checkpoint restored, β after] of each rollback
        self._zero_beta_said = False  # guard.on_max_kl=raise_coef at β = 0 has been said once
        self._events: dict[str, float] = {}
        self._step_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ events
    def _event(self, name: str, message: str, count: float = 1.0, level: int = logging.WARNING) -> None:
        self._events[f"guard/{name}"] = self._events.get(f"guard/{name}", 0.0) + count
        log.log(level, "guard/%s: %s", name, message)

    def _stop(self, name: str, message: str, *, save: bool = True) -> TrainingStopped:
        """Record ``guard/stop`` and ``guard/<name>`` and return the exception to raise."""
        self._events[f"guard/{name}"] = self._events.get(f"guard/{name}", 0.0) + 1.0
        self._events["guard/stop"] = 1.0
        log.error("guard/stop: %s", message)
        return TrainingStopped(message, save=save)

    def check_update(self, step: int, metrics: dict[str, float], *, lr: float) -> None:
        """Right after the actor's update, before anything samples from the new weights.

        Raises:
            TrainingStopped: the update left non-finite weights (``guard/nonfinite_weights``, counted by the
                actor over every rank; no checkpoint of them, ``save=False``); or ``guard.max_nonfinite_steps``
                steps in a row skipped a non-finite mini-batch update (checkpointed only under
                ``guard.atomic_update``, which undid those steps whole). Both name the learning rate, the usual cause.
        """
        bad = metrics.get("guard/nonfinite_weights", 0.0)
        if bad > 0:
            raise self._stop(
                "nonfinite_weights",
                f"step {step}: the update left {bad:g} non-finite weight(s) (actor.lr={lr:g}: a learning rate far too "
                "large, or non-finite inputs): stopped without checkpointing them; the latest complete checkpoint is "
                "the resume point",
                save=False,
            )
        skipped = metrics.get("guard/nonfinite_skip", 0.0) > 0
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped else 0
        if skipped and self.nonfinite_streak >= self.cfg.max_nonfinite_steps:
            raise self._stop(
                "nonfinite",
                f"step {step}: a non-finite loss or gradient in {self.nonfinite_streak} steps in a row "
                f"(guard.max_nonfinite_steps={self.cfg.max_nonfinite_steps}; actor.lr={lr:g}): the run is not "
                "learning; lower actor.lr or check the data and reward",
                save=self.cfg.atomic_update,
            )

    def pop_metrics(self) -> dict[str, float]:
        """``guard/coef_scale``, ``guard/rollbacks`` and the events since the last call."""
        out = {"guard/coef_scale": self.coef_scale, "guard/rollbacks": float(self.rollbacks), **self._events}
        if self.coef_floor:
            out["guard/coef_floor"] = self.coef_floor
        self._events = {}
        return out

    def stop_record(self) -> dict[str, float]:
        """The metrics line of a step a guard stopped: what the step had computed, and the guard's events."""
        out = dict(self._step_metrics) | self.pop_metrics()
        self._step_metrics = {}
        return out

    # ------------------------------------------------------------------ across steps
    def before_update(
        self,
        step: int,
        kl_mean: float | None,
        scores: torch.Tensor,
        beta: float,
        *,
        n_valid: int | None = None,
        why: str = "",
    ) -> str:
        """'update' or 'skip' for this step's update; raises TrainingStopped when configured to stop.

        Args:
            kl_mean: ``kl/ref_mean`` of the batch (NaN when no sample is left, e.g. every reward invalid);
                None when the update measures it (then :meth:`check_kl` runs after the update).
            scores: the batch's scores (invalid samples are already 0 and dropped).
            n_valid: responses left after dropping bad samples; 0 skips the update with the event
                ``guard/empty_batch`` (or stops under ``guard.on_nonfinite=stop``), naming ``why``.
        """
        self._step_metrics = {}
        if n_valid == 0:
            self.empty_streak += 1
            self.untrained_streak += 1
            why = why or "no valid response"
            self.untrained_why = f"every sample was dropped ({why})"
            msg = f"step {step}: every sample of the batch was dropped ({why}); the update is not applied"
            if self.cfg.on_nonfinite == "stop":
                raise self._stop("empty_batch", msg + " (guard.on_nonfinite=stop)")
            self.empty_cause = _drop_cause(why)
            if self.empty_streak >= self.max_failed_steps:
                raise self._stop(
                    "empty_batch",
                    f"step {step}: every sample was dropped ({why or 'no valid response'}) for {self.empty_streak} "
                    f"steps in a row (reward.max_failed_steps={self.max_failed_steps}): {self.empty_cause}",
                )
            self._event("empty_batch", msg)
            return "skip"
        self.empty_streak = 0
        scores_finite = bool(torch.isfinite(scores).all())
        if kl_mean is None:  # the update measures the KL itself (actor.reuse_update_logprobs): check_kl runs after it
            kl_mean = 0.0
            if scores_finite:
                return "update"
        if not math.isfinite(kl_mean) or not scores_finite:
            what = (
                "scores"
                if not scores_finite
                else f"KL to the reference ({kl_mean}; non-finite, or no valid sample left)"
            )
            msg = f"step {step}: non-finite {what}; the update is not applied"
            if self.cfg.on_nonfinite == "stop":
                raise self._stop("nonfinite", msg + " (guard.on_nonfinite=stop)")
            self._event("nonfinite", msg)
            return "skip"
        return self.check_kl(step, kl_mean, beta)

    def check_trained(self, step: int, why: str) -> None:
        """After an update: ``why`` is empty when it trained some token, else why it trained none (the setting that
        took every token out of the loss, e.g. ``algo.mask_truncated``). ``reward.max_failed_steps`` steps in a row
        that trained nothing stop the run as an all-failing reward does (``guard/nothing_trained``, exit 3).

        Raises:
            TrainingStopped: the streak reached ``reward.max_failed_steps``; the message names ``why``.
        """
        if not why:
            self.untrained_streak, self.untrained_why = 0, ""
            return
        self.untrained_streak += 1
        self.untrained_why = why
        if self.untrained_streak >= self.max_failed_steps:
            raise self._stop(
                "nothing_trained",
                f"step {step}: no token was trained for {self.untrained_streak} steps in a row "
                f"(reward.max_failed_steps={self.max_failed_steps}): {why}",
            )

    def all_steps_failed(self, steps_run: int) -> TrainingStopped | None:
        """The error for a run that ended with every one of its ``steps_run`` steps empty, or training no token
        (fewer than reward.max_failed_steps, else :meth:`before_update` or :meth:`check_trained` stopped it already);
        None otherwise."""
        if steps_run <= 0 or self.untrained_streak < steps_run:
            return None
        if self.empty_streak >= steps_run:
            return self._stop(
                "empty_batch",
                f"every sample of all {steps_run} step(s) of this run was dropped: nothing was trained; "
                f"{self.empty_cause}",
            )
        return self._stop(
            "nothing_trained",
            f"no token of all {steps_run} step(s) of this run was trained: {self.untrained_why}",
        )

    def check_kl(self, step: int, kl_mean: float, beta: float, *, after_update: bool = False) -> str:
        """guard.max_kl on ``kl/ref_mean``: 'update' or 'skip'; raises TrainingStopped when configured to stop.

        ``after_update``: the KL was measured by the update's own forward (actor.reuse_update_logprobs,
        only with guard.on_max_kl=raise_coef), so a raised β applies from the next step on, and a
        non-finite KL is reported (the actor has already dropped a non-finite loss).
        """
        if after_update and not math.isfinite(kl_mean):
            self._event("nonfinite", f"step {step}: non-finite KL to the reference ({kl_mean}) measured in the update")
            return "update"
        if kl_mean > self.cfg.max_kl:
            msg = f"step {step}: KL to the reference {kl_mean:.4f} nats/token > guard.max_kl={self.cfg.max_kl}"
            action = self.cfg.on_max_kl
            if action == "stop":
                raise self._stop("kl_explosion", msg + " (guard.on_max_kl=stop)")
            if action == "raise_coef":
                # the run's β (``beta``) is max(controller × scale, hacking floor): both are raised, so it becomes
                # β × coef_factor whichever holds it (a floor-held β at kl.coef=0 would not move with the scale alone)
                self.coef_scale *= self.cfg.coef_factor
                self.coef_floor *= self.cfg.coef_factor
                if beta == 0:  # kl.coef=0: no multiple of 0 contains anything; said once, then counted quietly
                    said = self._zero_beta_said
                    self._zero_beta_said = True
                    self._event(
                        "kl_explosion",
                        f"{msg}; β is 0, which guard.on_max_kl=raise_coef cannot raise: nothing contains this KL "
                        "(guard.on_max_kl=skip or stop would act, or kl.coef > 0); later explosions are only counted "
                        "(guard/kl_explosion)",
                        level=logging.DEBUG if said else logging.WARNING,
                    )
                    return "update"
                self._event(
                    "kl_explosion",
                    f"{msg}; β {beta:.4g} → {beta * self.cfg.coef_factor:.4g} (guard.on_max_kl=raise_coef)",
                )
                return "update"
            self._event("kl_explosion", f"{msg}; update skipped (guard.on_max_kl=skip)")
            return "skip"
        return "update"

    def after_step(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Console lines for the update's own guard counts; returns the ``guard/*`` metrics of the step.

        Reads ``guard/early_stop`` and ``guard/nonfinite_skip`` (actor), ``guard/value_nonfinite_skip``
        (critic) and ``reward/nonfinite_count`` from ``metrics``. Non-finite rewards become the event
        ``guard/nonfinite_reward`` (their samples were already dropped). A skipped non-finite update
        stops the run under ``guard.on_nonfinite=stop``.
        """
        self._step_metrics = dict(metrics)
        if metrics.get("guard/early_stop", 0.0) > 0:
            log.info(
                "guard/early_stop: step %d: policy/approx_kl > guard.target_kl=%s; the remaining PPO epochs and "
                "mini-batches were skipped after %d update(s)",
                step,
                self.cfg.target_kl,
                int(metrics.get("policy/updates", 0)),
            )
        skipped = metrics.get("guard/nonfinite_skip", 0.0) + metrics.get("guard/value_nonfinite_skip", 0.0)
        if skipped > 0:
            msg = f"step {step}: a non-finite loss or gradient norm; {skipped:g} mini-batch update(s) not applied"
            if self.cfg.on_nonfinite == "stop":
                raise self._stop("nonfinite", msg + " (guard.on_nonfinite=stop)")
            log.warning("guard/nonfinite_skip: %s", msg)
        bad = metrics.get("reward/nonfinite_count", 0.0)
        if bad and bad > 0:
            self._event(
                "nonfinite_reward", f"step {step}: {bad:g} non-finite reward(s); those samples were dropped", count=bad
            )
        return self.pop_metrics()

    # ------------------------------------------------------------------ validation and rollback
    def after_validation(self, step: int, val_metrics: dict, ckpt, roles, controller_beta: float) -> None:
        """Roll back when the validation score fell more than ``rollback_drop`` below the last stable checkpoint's.

        A rollback restores the stable checkpoint's weights and optimizer moments (the data position,
        RNG and LR schedule go on), multiplies β by ``coef_factor`` and the learning rates by
        ``rollback_lr_factor``. After ``max_rollbacks`` rollbacks the next drop stops the run.

        Args:
            step: the step validated; val_metrics: its ``val/*`` / ``exact/*`` metrics.
            ckpt: the run's CheckpointManager (``root``, ``restore_weights``).
            roles: the run's roles (``actor`` and ``critic``: ``scale_lr``; the actor's ``optimizer``).
            controller_beta: the KL controller's β (the run's β is it times ``coef_scale``).
        """
        score, sem = self.validation_score(val_metrics)
        self.val_step, self.val_score, self.val_sem = step, score, sem
        self.val_gold, self.val_gold_sem = self.gold_score(val_metrics)
        if self.val_gold is not None and (self.gold_best is None or self.val_gold > self.gold_best):
            self.gold_best, self.gold_best_sem = self.val_gold, self.val_gold_sem
        if score is None or not self.cfg.rollback_drop or self.stable_score is None or self.stable_step is None:
            return
        floor = self.floor(sem)
        if score >= floor:
            return
        metric = self.score_key(val_metrics)
        noise = self.stable_score - floor > self.cfg.rollback_drop * abs(self.stable_score)
        limit = (
            f"guard.rollback_z={self.cfg.rollback_z:g} standard errors"
            if noise
            else f"guard.rollback_drop={self.cfg.rollback_drop:g}"
        )
        drop = (
            f"validation score {score:.4f} at step {step} ({metric}) is more than {limit} below the stable "
            f"checkpoint's (step {self.stable_step}: {self.stable_score:.4f}, floor {floor:.4f})"
        )
        self.roll_back(drop, ckpt, roles, controller_beta, step=step)

    def on_hacking(self, step: int, finding, ckpt, roles, controller_beta: float) -> None:
        """A live reward-hacking finding (``tether.diagnostics.HACKING_CHECKS``) under ``guard.on_hacking``: ``warn``
        does nothing more (the trainer logs it), ``stop`` checkpoints and stops, ``rollback`` rolls back as a
        validation drop does (β × ``coef_factor``, learning rates × ``rollback_lr_factor``) to :meth:`hacking_target`:
        with a gold reward, the last checkpoint before ``step`` whose gold was within ``rollback_drop`` of the best
        gold so far (the reference's at step 0 included), never one already hacked nor the one just flagged. β's
        floor escalates (:meth:`escalate_floor`): ``hacking_coef`` at the first hacking rollback, then × ``coef_factor``
        at each further one, so a run at β = 0 that hacks again gets 0.05, 0.1, 0.2, ...

        A step whose validation already rolled back (``guard/rollback``) is not rolled back again: one validation is
        one rollback (one count, one learning-rate scaling); the finding then only escalates β's floor and, if its
        target is an earlier checkpoint than the one restored, restores that one instead."""
        why = f"step {step}: {finding.message}"
        if self.cfg.on_hacking == "stop":
            raise self._stop("hacking", f"{why} (guard.on_hacking=stop)")
        if self.cfg.on_hacking != "rollback":
            return
        target = self.hacking_target(step)
        if self.rollback_step == step:
            before = self.beta(controller_beta)
            self.escalate_floor()
            if target is not None and target != self.restored_step:
                self._restore(ckpt, target, why)
            if self.tried and self.tried[-1][0] == step:
                self.tried[-1][1:] = [self.restored_step, self.beta(controller_beta)]
            after = self.beta(controller_beta)
            log.warning(
                "guard/hacking_rollback: %s; this step already rolled back (rollback %d/%d, not counted again): "
                "weights of step %s, β %s",
                why,
                self.rollbacks,
                self.cfg.max_rollbacks,
                self.restored_step,
                f"{before:.4g} → floor {after:.4g} (guard.hacking_coef={self.cfg.hacking_coef:g}, × "
                f"guard.coef_factor={self.cfg.coef_factor:g} per further hacking rollback)"
                if after > before
                else f"{after:.4g} (unchanged: above its floor {self.coef_floor:g})",
            )
            return
        if target is None:
            stable = (
                f"a checkpoint is stable for it once its validated gold is within guard.rollback_drop="
                f"{self.cfg.rollback_drop:g} of the best gold so far ({self.gold_best:.4f})"
                if self.gold_best is not None
                else "a checkpoint is stable once a validation of its weights is not a drop"
            )
            self._event(
                "hacking_no_rollback",
                f"{why}; guard.on_hacking=rollback has no stable checkpoint before step {step} to return to yet "
                f"({stable}; trainer.save_freq, trainer.val_freq)",
            )
            return
        self.roll_back(why, ckpt, roles, controller_beta, step=step, to_step=target, event="hacking_rollback")

    def escalate_floor(self) -> None:
        """β's floor at a hacking rollback: ``guard.hacking_coef`` at the first, × ``guard.coef_factor`` at each
        further one (β = 0 × coef_factor stays 0, so the floor is what escalates a run at β = 0)."""
        self.coef_floor = max(self.cfg.hacking_coef, self.coef_floor * self.cfg.coef_factor)

    def hacking_target(self, step: int | None = None) -> int | None:
        """The checkpoint a hacking rollback flagged at ``step`` returns to, strictly before it (never the flagged
        weights, checkpointed at ``step`` before the doctor looked): with a gold reward (any validation logged one),
        the last checkpoint whose gold was not a drop from the best gold so far (:meth:`gold_floor`); without one, the
        last stable checkpoint by ``guard.rollback_metric``. None when there is none yet."""
        history = self.gold_stable_steps if self.gold_best is not None else self.stable_steps
        before = [h[0] for h in history if step is None or h[0] < step]
        return before[-1] if before else None

    def protected_steps(self) -> set[int]:
        """The checkpoints a rollback may return to, which pruning keeps: the stable and the gold-stable one, and under
        ``guard.on_hacking=rollback`` the last two of each (a hacking rollback flagged at the newest checkpoint returns
        to the one before it)."""
        steps = {self.stable_step, self.gold_stable_step}
        if self.cfg.on_hacking == "rollback":
            steps |= {h[0] for h in self.stable_steps[-2:]} | {h[0] for h in self.gold_stable_steps[-2:]}
        return {s for s in steps if s is not None}

    def gold_score(self, val: dict) -> tuple[float | None, float]:
        """(gold, standard error) of a validation: ``exact/gold_mean`` (no noise) where logged, else ``val/gold_mean``
        with ``val/gold_sem``; (None, 0) when it has neither (no gold reward, or no sample scored by it)."""
        v = val.get("exact/gold_mean")
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v), 0.0
        v = val.get("val/gold_mean")
        if not isinstance(v, (int, float)) or not math.isfinite(v) or val.get("val/gold_unscored_frac", 0.0) >= 1.0:
            return None, 0.0
        return float(v), float(val.get("val/gold_sem", 0.0) or 0.0)

    def gold_floor(self, sem: float) -> float:
        """The lowest gold of a checkpoint a hacking rollback may return to: the best gold so far less
        ``rollback_drop`` of it, or less ``rollback_z`` standard errors of the difference where that is larger (as
        :meth:`floor`). The best includes the reference's (step 0), so a checkpoint whose gold fell below the
        reference's by more than that is never the target."""
        noise = self.cfg.rollback_z * math.sqrt(sem**2 + self.gold_best_sem**2)
        return self.gold_best - max(self.cfg.rollback_drop * abs(self.gold_best), noise)

    def roll_back(
        self,
        drop: str,
        ckpt,
        roles,
        controller_beta: float,
        *,
        step: int,
        to_step: int | None = None,
        event: str = "rollback",
    ) -> None:
        """Restore checkpoint ``to_step`` (default: the stable one) weights and optimizer moments, raise β (a hacking
        rollback also escalates β's floor: :meth:`escalate_floor`) and lower the learning rates (``drop``: why, for
        the message); stop after ``max_rollbacks``, naming what the rollbacks tried."""
        to_step = self.stable_step if to_step is None else to_step
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise self._stop(
                "rollback_limit",
                f"{drop}, and the run has already rolled back {self.rollbacks} time(s) "
                f"(guard.max_rollbacks={self.cfg.max_rollbacks}){self.tried_text()}. The last stable checkpoint is "
                f"{ckpt.root / f'step_{to_step:06d}'}; resume from it with a lower actor.lr or a higher "
                "kl.coef (trainer.resume=<that path>).",
            )
        self._restore(ckpt, to_step, drop)
        self.rollbacks += 1
        self.rollback_step = step
        before = self.beta(controller_beta)
        self.coef_scale *= self.cfg.coef_factor
        if event == "hacking_rollback":
            self.escalate_floor()
        self.tried.append([step, to_step, self.beta(controller_beta)])
        roles.actor.scale_lr(self.cfg.rollback_lr_factor)
        if roles.critic is not None:
            roles.critic.scale_lr(self.cfg.rollback_lr_factor)
        self._event(
            event,
            f"{drop}: restored step {to_step} (rollback {self.rollbacks}/{self.cfg.max_rollbacks}), "
            f"{self._beta_text(before, controller_beta)}, learning rates "
            f"×{self.cfg.rollback_lr_factor:g} → {roles.actor.optimizer.param_groups[0]['lr']:.3g}",
        )

    def _beta_text(self, before: float, controller_beta: float) -> str:
        """What a rollback did to β: ``β ×2 → 0.1`` when the multiplier set it, ``β 0 → floor 0.05 (...)`` when the
        hacking floor did (β = 0 × coef_factor stays 0: it did not double)."""
        after, scaled = self.beta(controller_beta), controller_beta * self.coef_scale
        if after <= scaled:
            return f"β ×{self.cfg.coef_factor:g} → {after:.4g}"
        return (
            f"β {before:.4g} → floor {after:.4g} (guard.hacking_coef={self.cfg.hacking_coef:g}, × "
            f"guard.coef_factor={self.cfg.coef_factor:g} per further hacking rollback; the controller's β "
            f"{controller_beta:.4g} × the guard's scale {self.coef_scale:g} would be {scaled:.4g})"
        )

    def tried_text(self) -> str:
        """``": step 30 → checkpoint 20 (β 0.05), ..."``: what the rollbacks so far restored and the β after each."""
        if not self.tried:
            return ""
        return ": " + ", ".join(f"step {s} → checkpoint {to} (β {b:.4g})" for s, to, b in self.tried)

    def _restore(self, ckpt, to_step: int, why: str) -> None:
        """Checkpoint ``to_step``'s weights and optimizer moments; a failure stops the run (``rollback_failed``).
        The checkpoints after it (the trajectory left) are no longer targets, and when the stable checkpoint was one of
        them (a hacking rollback to an earlier one), the restored checkpoint becomes the stable one."""
        try:
            ckpt.restore_weights(to_step)
        except (OSError, ValueError) as e:  # CheckpointError is a ValueError
            raise self._stop("rollback_failed", f"{why}; cannot roll back: {e}") from None
        self.restored_step = to_step
        self.restores += 1  # the trainer's live diagnostics forget their firing findings (Trainer.react)
        self.val_score = self.val_gold = None  # the weights are no longer the ones that scored it
        self.stable_steps = [h for h in self.stable_steps if h[0] <= to_step]
        self.gold_stable_steps = [h for h in self.gold_stable_steps if h[0] <= to_step]
        last_gold = self.gold_stable_steps[-1] if self.gold_stable_steps else (None, None)
        self.gold_stable_step, self.gold_stable_score = last_gold
        if self.stable_step is not None and self.stable_step > to_step:
            kept = [h for h in self.stable_steps if h[0] == to_step]
            self.stable_step, self.stable_score, self.stable_sem = kept[-1] if kept else (None, None, 0.0)

    def beta(self, controller_beta: float) -> float:
        """The run's β: the controller's times ``coef_scale``, at least ``coef_floor``."""
        return max(controller_beta * self.coef_scale, self.coef_floor)

    def validation_score(self, last_val: dict) -> tuple[float | None, float]:
        """(score, standard error) of a validation by ``guard.rollback_metric``.

        ``auto`` takes ``exact/score_mean`` (E_π[r] by enumeration, no sampling noise: standard
        error 0) when the embedded task's exact evaluation ran, else the sampled ``val/score_mean``
        with its standard error ``val/score_sem``. ``gold`` takes ``exact/gold_mean`` where the hackable embedded task
        logs it, else the gold reward's ``val/gold_mean`` with ``val/gold_sem``; a validation whose every gold sample
        was unscored (the gold reward failed
        throughout: ``val/gold_unscored_frac`` = 1) has no score, so a failing gold never rolls back.
        """
        key = self.score_key(last_val)
        if key == "val/gold_mean" and last_val.get("val/gold_unscored_frac", 0.0) >= 1.0:
            return None, 0.0
        score = last_val.get(key)
        sem = 0.0 if key.startswith("exact/") else float(last_val.get(key.replace("_mean", "_sem"), 0.0) or 0.0)
        return score, sem

    def score_key(self, last_val: dict) -> str:
        """The metric :meth:`validation_score` reads for ``guard.rollback_metric`` in this validation's metrics."""
        key = self.cfg.rollback_metric
        if key == "auto":
            return "exact/score_mean" if "exact/score_mean" in last_val else "val/score_mean"
        if key == "gold":  # exact/gold_mean on the hackable embedded task (no sampling noise), else the sampled one
            return "exact/gold_mean" if "exact/gold_mean" in last_val else "val/gold_mean"
        return key

    def floor(self, sem: float) -> float:
        """The lowest score that is not a drop from the stable checkpoint's.

        A drop must exceed both ``rollback_drop`` (a fraction of the stable score) and ``rollback_z``
        standard errors of the difference of the two validations, so sampling noise alone never
        triggers a rollback.
        """
        noise = self.cfg.rollback_z * math.sqrt(sem**2 + self.stable_sem**2)
        return self.stable_score - max(self.cfg.rollback_drop * abs(self.stable_score), noise)

    def score_at(self, step: int) -> float | None:
        """The validation score of the weights at ``step``, if they were validated at that step."""
        return self.val_score if self.val_step == step else None

    def mark_stable(self, step: int, score: float | None) -> None:
        """A checkpoint at ``step`` with validation ``score`` is the new stable point (if not a drop); with its gold
        (validated at ``step``) not a drop from the best gold (:meth:`gold_floor`), the new hacking-rollback target."""
        if self.val_step == step and self.val_gold is not None and self.val_gold >= self.gold_floor(self.val_gold_sem):
            self.gold_stable_step, self.gold_stable_score = step, self.val_gold
            self.gold_stable_steps.append([step, self.val_gold])
        if score is None:
            return
        sem = self.val_sem if self.val_step == step else 0.0
        if self.stable_score is None or score >= self.floor(sem):
            self.stable_step, self.stable_score, self.stable_sem = step, score, sem
            self.stable_steps.append([step, score, sem])

    def state_dict(self) -> dict:
        return {
            "coef_scale": self.coef_scale,
            "coef_floor": self.coef_floor,
            "rollbacks": self.rollbacks,
            "stable_step": self.stable_step,
            "stable_score": self.stable_score,
            "val_step": self.val_step,
            "val_score": self.val_score,
            "stable_sem": self.stable_sem,
            "val_sem": self.val_sem,
            "empty_streak": self.empty_streak,
            "untrained_streak": self.untrained_streak,
            "untrained_why": self.untrained_why,
            "nonfinite_streak": self.nonfinite_streak,
            "rollback_step": self.rollback_step,
            "restored_step": self.restored_step,
            "gold_best": self.gold_best,
            "gold_best_sem": self.gold_best_sem,
            "val_gold": self.val_gold,
            "val_gold_sem": self.val_gold_sem,
            "gold_stable_step": self.gold_stable_step,
            "gold_stable_score": self.gold_stable_score,
            "stable_steps": self.stable_steps,
            "gold_stable_steps": self.gold_stable_steps,
            "tried": self.tried,
        }

    def load_state_dict(self, state: dict) -> None:
        self.coef_scale = float(state["coef_scale"])
        self.coef_floor = float(state.get("coef_floor", 0.0))  # checkpoints before guard.on_hacking have none
        self.rollbacks = int(state["rollbacks"])
        self.stable_step = state["stable_step"]
        self.stable_score = state["stable_score"]
        self.val_step = state.get("val_step")
        self.val_score = state.get("val_score")
        self.stable_sem = float(state.get("stable_sem", 0.0))
        self.val_sem = float(state.get("val_sem", 0.0))
        self.empty_streak = int(state.get("empty_streak", 0))
        self.untrained_streak = int(state.get("untrained_streak", self.empty_streak))
        self.untrained_why = str(state.get("untrained_why", ""))
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        # checkpoints before the gold-stable target: a gold rollback falls back on the stable checkpoint
        self.rollback_step = state.get("rollback_step")
        self.restored_step = state.get("restored_step")
        self.gold_best = state.get("gold_best")
        self.gold_best_sem = float(state.get("gold_best_sem", 0.0))
        self.val_gold = state.get("val_gold")
        self.val_gold_sem = float(state.get("val_gold_sem", 0.0))
        self.gold_stable_step = state.get("gold_stable_step")
        self.gold_stable_score = state.get("gold_stable_score")
        # checkpoints before the target histories: the last stable / gold-stable checkpoint is the only target
        old_stable = [[self.stable_step, self.stable_score, self.stable_sem]] if self.stable_step is not None else []
        old_gold = [[self.gold_stable_step, self.gold_stable_score]] if self.gold_stable_step is not None else []
        self.stable_steps = [list(h) for h in state.get("stable_steps", old_stable)]
        self.gold_stable_steps = [list(h) for h in state.get("gold_stable_steps", old_gold)]
        self.tried = [list(t) for t in state.get("tried", [])]


def _drop_cause(why: str) -> str:
    """What a step whose every sample was dropped blames, from its counters (``why``, e.g. ``agent/env_errors=8``):
    the agent environment when it failed on every trajectory, the reward or the data otherwise."""
    env = "agent/env_errors" in why
    if env and "," not in why:
        return (
            "the agent environment failed on every trajectory (agent/env_errors; see the agent environment warnings "
            "above for the first failure): fix agent.environment / agent.tools, or the model or data they run on"
        )
    either = "the agent environment (agent/env_errors) or " if env else ""
    return f"{either}the reward function or the data never give a valid sample (see the warnings above)"
