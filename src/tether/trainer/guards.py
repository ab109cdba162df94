"""Guards across steps: KL explosions, non-finite values, and rollback to the last stable checkpoint.

The within-step guard (early stop of PPO epochs on ``guard.target_kl``) lives in the actor update.
Every event is counted in a ``guard/<event>`` metric and logged as a console line.
"""

from __future__ import annotations

import logging
import math

import torch

from tether.config import GuardConfig

log = logging.getLogger("tether")


class TrainingStopped(RuntimeError):
    """A guard stopped the run; the message says which and why."""


class GuardMonitor:
    """Watches each step before its update, and each validation.

    State (checkpointed): ``coef_scale`` (β multiplier raised after KL explosions and rollbacks),
    ``rollbacks``, the last stable checkpoint's step and validation score.
    """

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.coef_scale = 1.0
        self.rollbacks = 0
        self.stable_step: int | None = None
        self.stable_score: float | None = None
        self._events: dict[str, float] = {}

    def _event(self, name: str, message: str) -> None:
        self._events[f"guard/{name}"] = self._events.get(f"guard/{name}", 0.0) + 1.0
        log.warning("guard/%s: %s", name, message)

    def pop_metrics(self) -> dict[str, float]:
        out = {"guard/coef_scale": self.coef_scale, "guard/rollbacks": float(self.rollbacks), **self._events}
        self._events = {}
        return out

    def before_update(self, step: int, kl_mean: float, scores: torch.Tensor, beta: float) -> str:
        """'update' or 'skip' for this step's update; raises TrainingStopped when configured to stop."""
        nonfinite = not math.isfinite(kl_mean) or not bool(torch.isfinite(scores).all())
        if nonfinite:
            msg = f"step {step}: non-finite KL ({kl_mean}) or scores; the update is not applied"
            if self.cfg.on_nonfinite == "stop":
                raise TrainingStopped(msg + " (guard.on_nonfinite=stop)")
            self._event("nonfinite", msg)
            return "skip"
        if kl_mean > self.cfg.max_kl:
            msg = f"step {step}: KL to the reference {kl_mean:.4f} nats/token > guard.max_kl={self.cfg.max_kl}"
            action = self.cfg.on_max_kl
            if action == "stop":
                raise TrainingStopped(msg + " (guard.on_max_kl=stop)")
            if action == "raise_coef":
                self.coef_scale *= self.cfg.coef_factor
                self._event("kl_explosion", f"{msg}; β {beta:.4g} → {beta * self.cfg.coef_factor:.4g}")
                return "update"
            self._event("kl_explosion", f"{msg}; update skipped")
            return "skip"
        return "update"

    def after_validation(self, trainer) -> None:
        """Roll back when the validation score fell more than ``rollback_drop`` below the last stable checkpoint's."""
        score = trainer.last_val.get("val/score_mean")
        if score is None or not self.cfg.rollback_drop or self.stable_score is None:
            return
        floor = self.stable_score - self.cfg.rollback_drop * abs(self.stable_score)
        if score >= floor:
            return
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise TrainingStopped(
                f"validation score {score:.4f} at step {trainer.step} fell below {floor:.4f} (stable checkpoint step "
                f"{self.stable_step}: {self.stable_score:.4f}) after {self.rollbacks} rollbacks (guard.max_rollbacks)"
            )
        self.rollbacks += 1
        self._event(
            "rollback",
            f"validation score {score:.4f} at step {trainer.step} < {floor:.4f}; restoring step {self.stable_step}, "
            f"β ×{self.cfg.coef_factor}, learning rates ×{self.cfg.rollback_lr_factor}",
        )
        trainer.ckpt.restore_weights(self.stable_step)
        self.coef_scale *= self.cfg.coef_factor
        trainer.roles.actor.scale_lr(self.cfg.rollback_lr_factor)
        if trainer.roles.critic is not None:
            trainer.roles.critic.scale_lr(self.cfg.rollback_lr_factor)

    def mark_stable(self, step: int, score: float | None) -> None:
        """A checkpoint at ``step`` with validation ``score`` is the new stable point (if not a drop)."""
        if score is None:
            return
        if self.stable_score is None or score >= self.stable_score - self.cfg.rollback_drop * abs(self.stable_score):
            self.stable_step, self.stable_score = step, score

    def state_dict(self) -> dict:
        return {"coef_scale": self.coef_scale, "rollbacks": self.rollbacks, "stable_step": self.stable_step, "stable_score": self.stable_score}

    def load_state_dict(self, state: dict) -> None:
        self.coef_scale = float(state["coef_scale"])
        self.rollbacks = int(state["rollbacks"])
        self.stable_step = state["stable_step"]
        self.stable_score = state["stable_score"]
