"""What a checkpoint holds for the trainer, and resume / rollback (see ``tether.checkpoint``)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tether.checkpoint import (
    CheckpointError,
    latest_valid_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    read_json,
    rng_state,
    set_rng_state,
    step_dir_name,
    verify_checkpoint,
    write_checkpoint,
    write_json,
)
from tether.config import ConfigError, resolve_local_paths
from tether.engines import AUTO
from tether.rollout.registry import resolve as resolve_engine
from tether.trainer.logging import _clean as clean_value
from tether.trainer.logging import _flatten

log = logging.getLogger("tether")

#: Config keys that may change between a run and its resumption without a warning.
RESUME_FREE_KEYS = {
    "trainer.total_steps",
    "trainer.resume",
    "trainer.output_dir",
    "trainer.progress",
    "trainer.report",
    "trainer.loggers",
    "trainer.threads",
    "trainer.device",
    "trainer.project",
    "trainer.save_freq",  # when checkpoints are written, and how many are kept, do not change the training
    "trainer.keep_last",
    "trainer.wait_notice_s",
    "reward.timeout_s",
}

#: Config keys naming a model whose weights a checkpoint holds: a change there explains weights that do not fit.
MODEL_KEYS = ("actor.model", "critic.model", "ref.model")


def check_fresh_start(run_dir: Path, resume: str) -> None:
    """``trainer.resume=off`` on a run directory that holds an earlier run is refused, before any
    model loads: a fresh start there would rewrite its metrics.jsonl yet leave its checkpoints, which
    a later ``auto`` resume would pick (steps 0, 1, then 20, 21, ... in one metrics.jsonl). As the
    Hugging Face Trainer (and so TRL) refused a non-empty output_dir without ``--overwrite_output_dir``,
    nothing is deleted or moved: the user chooses.

    Raises:
        ConfigError: one line naming the directory, what it holds, and the ways out.
    """
    if resume != "off":
        return
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    ckpts = (
        sorted(p.name for p in root.iterdir() if p.is_dir() and "step_" in p.name and not p.name.startswith("."))
        if root.is_dir()
        else []
    )
    metrics = run_dir / "metrics.jsonl"
    lines = sum(1 for x in metrics.read_text(errors="replace").splitlines() if x.strip()) if metrics.is_file() else 0
    if not ckpts and not lines:
        return
    held = [f"{len(ckpts)} checkpoint(s) ({', '.join(ckpts[-3:])})"] if ckpts else []
    held += [f"metrics.jsonl with {lines} line(s)"] if lines else []
    raise ConfigError(
        f"trainer.resume=off: trainer.output_dir={str(run_dir)!r} holds an earlier run ({' and '.join(held)}); a fresh "
        f"start would mix with it. Choose a new trainer.output_dir, delete {str(run_dir)!r} to start over there, or "
        "continue it with trainer.resume=auto"
    )


class CheckpointManager:
    """Saves and restores every bit of a trainer's state.

    Saved: actor (and critic) weights, the reference's weights when ``ref.reset_every`` moves it,
    optimizer and LR-scheduler states, KL controller, entropy coefficient (``algo.entropy_target``),
    RNG states, data position, guard state, reward
    normaliser, best validation score, last validation metrics, the live diagnostics' state, the
    step's metrics line, the batch pre-generated for the next step (``rollout.async_steps``) and the
    config. Resuming from it continues exactly as the run would have.

    Args:
        run_dir: the run directory (checkpoints go to ``run_dir/checkpoints``, metrics.jsonl is there).
        cfg: the run's config; roles: its ``Roles`` (models, optimizers, tokenizer, reward, engine).
        controller, sampler, guard: the KL controller, PromptSampler and GuardMonitor, saved and
            loaded in place.
        entropy_controller: the ``EntropyCoefController`` of ``algo.entropy_target`` (saved and loaded in place), or
            None.
        exact_cache: the exact/* metrics' ``ExactCache``, emptied when a checkpoint loads the reference.
        async_rollout: the ``AsyncRollout`` of ``rollout.async_steps`` (its pending batches are saved, loaded, and
            regenerated after a rollback), or None.

    The loop's step and last validation metrics are passed to :meth:`save`; :meth:`maybe_resume`
    returns those it loaded.
    """

    def __init__(
        self,
        run_dir,
        cfg,
        roles,
        *,
        controller,
        sampler,
        guard,
        exact_cache=None,
        async_rollout=None,
        entropy_controller=None,
    ):
        self.run_dir, self.cfg, self.roles = Path(run_dir), cfg, roles
        self.controller, self.sampler, self.guard, self.exact_cache = controller, sampler, guard, exact_cache
        self.entropy_controller = entropy_controller
        self.async_rollout = async_rollout
        self.root = self.run_dir / "checkpoints"
        self.step = 0  # the step of the checkpoint last saved or loaded
        self.best_step: int | None = None
        self.best_score: float | None = None
        self.resumed_from: Path | None = None
        self._diagnostics_state: dict | None = None
        self._step_record: dict | None = None
        self.last_saved_step: int | None = None
        self._verified: dict = {}  # checkpoints that verified, for pruning (prune_checkpoints)

    # -------------------------------------------------------------- saving
    def maybe_save(
        self, step: int, last_val: dict, metrics: dict | None = None, *, force: bool = False, diagnostics=None
    ) -> Path | None:
        """Save every ``trainer.save_freq`` steps, at ``trainer.total_steps``, and when ``force``d
        (a stop signal: ``tether.signals``); arguments as :meth:`save`'s.
        """
        freq = self.cfg.trainer.save_freq
        if force or step == self.cfg.trainer.total_steps or (freq and step % freq == 0):
            return self.save(step, last_val, metrics=metrics, diagnostics=diagnostics)
        return None

    def save(
        self,
        step: int,
        last_val: dict,
        *,
        final: bool = False,
        metrics: dict | None = None,
        diagnostics=None,
        logger=None,
    ) -> Path:
        """Write a checkpoint of ``step`` (atomically) and prune old ones.

        Args:
            step: the step just trained; last_val: the last validation's metrics.
            final: the run was stopped by a guard (``fit`` saves then): the step's metrics line, with
                ``guard/stop`` and the guard's events, is written to metrics.jsonl here (by ``logger``).
            metrics: the step's metrics so far; stored so that a crash between the checkpoint and the
                step's line in metrics.jsonl does not lose that line on resume.
            diagnostics: the run's LiveDiagnostics (its counters are saved), or None.
            logger: the run's MetricsLogger (``final`` only), or None.
        """
        if final:
            metrics = self.guard.stop_record()
            if logger is not None:
                logger.log(step, metrics)
        score = self.guard.score_at(step)  # only a validation of these very weights labels the checkpoint
        if score is not None and (self.best_score is None or score > self.best_score):
            self.best_step, self.best_score = step, score
        self.guard.mark_stable(step, score)
        roles = self.roles

        def weights(d: Path) -> None:  # each role's own files (sharded under Ray: the placement's)
            roles.save_weights(d, with_ref=self._saves_ref())

        def optim(d: Path) -> None:
            roles.save_optimizer(d)

        def trainer_state(d: Path) -> None:
            write_json(rng_state(), d / "rng.json")
            diag = diagnostics
            write_json(
                {
                    "step": step,
                    "controller": self.controller.state_dict(),
                    "entropy_controller": None
                    if self.entropy_controller is None
                    else self.entropy_controller.state_dict(),
                    "data": self.sampler.state_dict(),
                    "guard": self.guard.state_dict(),
                    "reward": roles.reward.state_dict(),
                    "best": {"step": self.best_step, "score": self.best_score},
                    "last_val": _clean(last_val),
                    "val_score": score,
                    "stopped": final,
                    "diagnostics": None if diag is None else diag.state_dict(),
                    "metrics": None if metrics is None else _clean(metrics),
                    "config": resolve_local_paths(self.cfg.to_dict()),
                    "rollout_engine": roles.engine.engine.name,  # what rollout.engine (auto) resolved to
                },
                d / "trainer_state.json",
            )

        writers = {"weights": weights, "optim": optim, "state": trainer_state}
        if self.async_rollout is not None:  # rollout.async_steps: the batches generated for the next steps
            writers["pending"] = self.async_rollout.save
        path = write_checkpoint(self.root, step, writers, self._verified)
        self.step = self.last_saved_step = step
        prune_checkpoints(self.root, self.cfg.trainer.keep_last, self.protected(), self._verified)
        return path

    def protected(self) -> set[int]:
        """Steps that pruning keeps besides the newest ``keep_last``: the best and the stable checkpoints (by
        ``guard.rollback_metric``, and by the gold for a hacking rollback: :meth:`GuardMonitor.protected_steps`)."""
        return self.guard.protected_steps() | ({self.best_step} if self.best_step is not None else set())

    def _saves_ref(self) -> bool:
        # a LoRA reference has no weights of its own
        return bool(self.cfg.ref.reset_every) and self.cfg.actor.lora.rank == 0

    # -------------------------------------------------------------- loading
    def maybe_resume(self) -> tuple[int, dict] | None:
        """Apply ``trainer.resume``: auto (latest complete checkpoint here, if any), off, or a path.

        Returns:
            (step, last validation metrics) of the checkpoint loaded, or None when the run starts at step 0.

        Raises:
            CheckpointError: an explicit path that is incomplete or corrupt (naming the file), or
                ``auto`` with checkpoints of which none is complete (naming each problem).
        """
        mode = self.cfg.trainer.resume
        if mode == "off":
            self._clear_metrics()
            return None
        if mode == "auto":
            errors: list[str] = []
            path = latest_valid_checkpoint(self.root, errors)
            if path is None:
                if errors:
                    raise CheckpointError(
                        f"trainer.resume=auto: no complete checkpoint in {self.root}: "
                        + "; ".join(errors)
                        + " (choose a new trainer.output_dir, or delete this one, to start over; or set trainer.resume "
                        "to a checkpoint path)"
                    )
                self._clear_metrics()
                return None
            if errors:
                log.warning(
                    "resume: %d newer checkpoint(s) failed verification; falling back to %s", len(errors), path.name
                )
        else:
            path = Path(mode)
            verify_checkpoint(path)
        resumed = self.load(path)
        log.info("resumed from %s (step %d)", path, self.step)
        return resumed

    def _load_weights(self, path: Path, *, schedule: bool = True) -> None:
        """Actor (critic, reference) weights and optimizer states; with ``schedule=False`` the current
        learning rates and LR-scheduler state are kept (rollback).

        Raises:
            CheckpointError: a file is missing, or the checkpoint's tensors do not fit this config's
                models (e.g. a checkpoint of another model): one line naming the checkpoint.
        """
        try:
            self._load_weights_unchecked(path, schedule=schedule)
        except CheckpointError:
            raise
        except (RuntimeError, ValueError, KeyError) as e:  # size mismatches, optimizer groups that differ
            lines = [x.strip() for x in str(e).splitlines() if x.strip()]
            shown = "; ".join(lines[:3]) + (f" (+{len(lines) - 3} more)" if len(lines) > 3 else "")
            raise CheckpointError(
                f"checkpoint {path} does not fit the configured models: {type(e).__name__}: {shown}"
            ) from None

    def _load_weights_unchecked(self, path: Path, *, schedule: bool) -> None:
        # resharded to this run's world size under Ray
        self.roles.load(path, with_ref=self._saves_ref(), schedule=schedule)
        if self._saves_ref():
            self._reference_changed()

    def _reference_changed(self) -> None:
        if self.exact_cache is not None:
            self.exact_cache.reset_ref()  # cached reference quantities of exact/* metrics

    def load(self, path: Path) -> tuple[int, dict]:
        """Restore everything from a verified checkpoint: the run continues exactly where it stopped.

        Returns:
            (step, last validation metrics) of the checkpoint, for the loop to continue from.
        """
        path = Path(path)
        state = read_json(path / "trainer_state.json")
        changed = self._warn_config_changes(state.get("config"), path, state.get("rollout_engine"))
        self._check_estimator_change(changed, path)
        try:
            self._load_weights(path)
        except CheckpointError as e:
            model = next((k for k in MODEL_KEYS if k in changed), None)
            if model is None:
                raise
            old, new = changed[model]
            where = (
                f"trainer.output_dir={str(self.run_dir)!r} holds a run of {model}={old!r} ({path.name})"
                if path.parent == self.root
                else f"trainer.resume={str(path)!r} is a checkpoint of a run of {model}={old!r}"
            )
            raise CheckpointError(
                f"{where}, not {model}={new!r}: its weights do not fit this model; choose a new trainer.output_dir"
                + ("" if path.parent == self.root else " or a checkpoint of this model")
            ) from e
        self.step = int(state["step"])
        if not self._switch_controller(state["controller"]):
            self.controller.load_state_dict(state["controller"])
            self._apply_kl_coef(changed, state["controller"])
        if self.entropy_controller is not None:
            # a checkpoint of a run without algo.entropy_target (or from before it existed)
            if state.get("entropy_controller") is None:
                log.warning(
                    "resume: checkpoint %s holds no entropy coefficient (algo.entropy_target was not set): α starts "
                    "again at algo.entropy_coef=%g",
                    path.name,
                    self.cfg.algo.entropy_coef,
                )
            else:
                self.entropy_controller.load_state_dict(state["entropy_controller"])
        self.sampler.load_state_dict(state["data"])
        self.guard.load_state_dict(state["guard"])
        self.roles.reward.load_state_dict(state["reward"])
        last_val = state.get("last_val") or {}
        self.best_step, self.best_score = state["best"]["step"], state["best"]["score"]
        self._diagnostics_state = state.get("diagnostics")
        self._step_record = state.get("metrics")
        set_rng_state(read_json(path / "rng.json"))
        if self.async_rollout is not None:
            self.async_rollout.load(path, step=self.step)
        self.resumed_from = path.parent
        self._restore_metrics_line(state.get("metrics"))
        if state.get("stopped"):
            log.warning(
                "resume: checkpoint %s was saved when a guard stopped the run (see metrics.jsonl, guard/stop)",
                path.name,
            )
        return self.step, last_val

    def restore_diagnostics(self, diagnostics) -> list:
        """Give a resumed run's LiveDiagnostics its evaluation counter and reported findings back
        (its history comes from metrics.jsonl). The checkpoint is written before the step's own
        diagnostics update, so that update is replayed here; its findings (reported already) are returned,
        for the trainer to re-apply what guard.on_hacking did with them."""
        s = self._diagnostics_state
        if s:
            diagnostics.load_state_dict(s)
            if self._step_record is not None:
                return diagnostics.update(self.step, self._step_record)
        return []

    def _restore_metrics_line(self, record: dict | None) -> None:
        """Make metrics.jsonl hold the checkpoint's step exactly once: a crash after the checkpoint but
        before the step's line was written would otherwise lose that line (later steps are dropped by
        the MetricsLogger). Unreadable lines (an interrupted write) are dropped."""
        if record is None:
            return
        path = self.run_dir / "metrics.jsonl"
        kept, seen = [], set()
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= self.step:
                    kept.append(line)
                    seen.add(rec["step"])
        if self.step in seen:
            return
        if self.resumed_from is not None and self.resumed_from.resolve() != self.root.resolve():
            log.info(
                "resume: metrics.jsonl starts with step %d's line, from checkpoint %s of another run directory",
                self.step,
                self.resumed_from,
            )
        else:
            log.info(
                "resume: metrics.jsonl had no line for step %d (interrupted before it was written); restored it from "
                "the checkpoint",
                self.step,
            )
        kept.append(json.dumps({"step": self.step, **{k: v for k, v in sorted(record.items()) if k != "step"}}))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)

    def _clear_metrics(self) -> None:
        """A run starting from step 0 logs every step anew: drop the lines of an earlier start (e.g. one
        that crashed before its first checkpoint), so that no step appears twice."""
        path = self.run_dir / "metrics.jsonl"
        if path.exists() and path.stat().st_size:
            log.info(
                "starting from step 0: clearing the %d bytes of %s left by an earlier start", path.stat().st_size, path
            )
            path.write_text("")

    def _warn_config_changes(self, saved: dict | None, path: Path, saved_engine: str | None = None) -> dict:
        """Warn about the keys (outside :data:`RESUME_FREE_KEYS`) whose value differs from the
        checkpoint's config, local paths compared absolute, ``rollout.engine=auto`` as the engine it resolved to
        (``saved_engine``: the checkpoint's, recorded since it was; else resolved here as the run was set);
        returns them, key -> (old, new)."""
        if not saved:
            return {}
        old, new = _flatten(resolve_local_paths(saved)), _flatten(resolve_local_paths(self.cfg.to_dict()))
        key = "rollout.engine"
        if new.get(key) == AUTO:
            new[key] = self.roles.engine.engine.name
        if old.get(key) == AUTO:
            old[key] = (
                saved_engine
                or resolve_engine(
                    AUTO,
                    self.roles.actor_path,
                    on_ray=old.get("trainer.backend") == "ray",
                    async_steps=old.get("rollout.async_steps") or 0,
                )[0]
            )
        changed = {
            k: (old.get(k), new.get(k))
            for k in sorted(set(old) | set(new))
            if k not in RESUME_FREE_KEYS and old.get(k) != new.get(k)
        }
        if changed:
            shown = ", ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in list(changed.items())[:8])
            log.warning(
                "resume: the config differs from checkpoint %s's (%s); the run will not match an uninterrupted one",
                path.name,
                shown,
            )
        return changed

    def _check_estimator_change(self, changed: dict, path: Path) -> None:
        """``algo.adv_estimator`` changed on resume: from gae, the checkpoint's critic (its value model and AdamW state)
        is dropped, said in one warning; to gae, there is no critic to load: refused.

        Raises:
            CheckpointError: resuming a run without a critic as algo.adv_estimator=gae (naming both values).
        """
        if "algo.adv_estimator" not in changed:
            return
        before, after = changed["algo.adv_estimator"]
        if before == "gae":
            log.warning(
                "resume: algo.adv_estimator changed gae → %s: checkpoint %s's critic (its value model and its "
                "optimizer state) is dropped; advantages are %s's from the next step, and this run's checkpoints hold "
                "no critic",
                after,
                path.name,
                after,
            )
        elif after == "gae":
            raise CheckpointError(
                f"resume: checkpoint {path.name} is of a run with algo.adv_estimator={before}, which has no critic, "
                f"and algo.adv_estimator=gae needs one: resume with algo.adv_estimator={before}, or start a new run (a "
                "new trainer.output_dir)"
            )

    def _switch_controller(self, saved: dict) -> bool:
        """``kl.controller`` changed on resume: the new controller takes over from the checkpoint's β (``fixed``: from
        ``kl.coef``, its only β), with a fresh update count, and a warning says so. False when it did not change."""
        old_name = saved.get("name")
        if old_name == self.controller.name:
            return False
        old_beta = float(saved.get("value", self.cfg.kl.coef))
        fresh = self.controller.state_dict()
        if self.cfg.kl.controller == "scheduled":  # its β is the schedule's at the run's step
            beta = self.controller._clamp(self.controller.schedule(self.step))
            self.controller.load_state_dict(fresh | {"value": beta, "n_updates": self.step})
            where = f"kl.schedule at step {self.step}"
        elif self.cfg.kl.controller == "fixed":
            where = "kl.coef: a fixed β"
        else:
            self.controller.load_state_dict(fresh | {"value": old_beta, "n_updates": 0})
            where = "the checkpoint's β; the new controller's kl.* settings move it from there"
        log.warning(
            "resume: kl.controller %s → %s: the checkpoint's controller state does not carry over; β starts at %g (%s)",
            old_name,
            self.controller.name,
            self.controller.value,
            where,
        )
        return True

    def _apply_kl_coef(self, changed: dict, saved_controller: dict) -> None:
        """``kl.coef`` changed on resume. With ``kl.controller=fixed`` β is kl.coef: the new value applies from the next
        step (an info line says old → new). With a controller that moves β, kl.coef is only its starting value: the run
        goes on from the checkpoint's β (a warning says so)."""
        if "kl.coef" not in changed:
            return
        before, after = changed["kl.coef"]
        if self.cfg.kl.controller == "fixed":
            self.controller.load_state_dict(saved_controller | {"value": self.cfg.kl.coef})
            log.info(
                "resume: kl.coef %r → %r applied (kl.controller=fixed: β is kl.coef from the next step)", before, after
            )
        else:
            log.warning(
                "resume: kl.coef %r → %r is not applied: with kl.controller=%s it is only β's starting value, and the "
                "run goes on from the checkpoint's β=%g (start a new run for a new starting value)",
                before,
                after,
                self.cfg.kl.controller,
                self.controller.value,
            )

    def restore_weights(self, step: int) -> None:
        """Rollback: weights and optimizer moments of checkpoint ``step``; the data position, RNG,
        learning rates and LR schedule go on (the guard then lowers the learning rates)."""
        path = self.root / step_dir_name(step)
        if not path.is_dir() and self.resumed_from is not None:
            path = self.resumed_from / step_dir_name(step)
        verify_checkpoint(path)
        self._load_weights(path, schedule=False)
        if self.async_rollout is not None:
            # generated by the weights rolled back from: regenerated from the restored ones
            self.async_rollout.discard()

    def checkpoints(self) -> list[int]:
        """Steps of the checkpoint directories present, oldest first."""
        return sorted(s for s, _ in list_checkpoints(self.root))


def _clean(d: dict) -> dict:
    return {k: clean_value(v) for k, v in d.items() if isinstance(v, (int, float, str, bool)) or v is None}
