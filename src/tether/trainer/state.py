"""What a checkpoint holds for the trainer, and resume / rollback (see ``tether.trainer.checkpoint``)."""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors.torch import load_file, save_file

from tether.trainer.checkpoint import (
    CheckpointError,
    latest_valid_checkpoint,
    load_torch,
    prune_checkpoints,
    read_json,
    rng_state,
    save_torch,
    set_rng_state,
    step_dir_name,
    verify_checkpoint,
    write_checkpoint,
    write_json,
)

log = logging.getLogger("tether")


class CheckpointManager:
    """Saves and restores every bit of a trainer's state.

    Saved: actor (and critic) weights, optimizer and LR-scheduler states, KL controller, RNG states,
    data position, guard state, reward normaliser, best validation score, step.
    """

    def __init__(self, trainer):
        self.t = trainer
        self.root = Path(trainer.run_dir) / "checkpoints"
        self.best_step: int | None = None
        self.best_score: float | None = None

    # -------------------------------------------------------------- saving
    def maybe_save(self) -> None:
        freq = self.t.cfg.trainer.save_freq
        if self.t.step == self.t.cfg.trainer.total_steps or (freq and self.t.step % freq == 0):
            self.save()

    def save(self, final: bool = False) -> Path:
        t = self.t
        score = t.last_val.get("val/score_mean") if t.last_val else None
        if score is not None and (self.best_score is None or score > self.best_score):
            self.best_step, self.best_score = t.step, score
        t.guard.mark_stable(t.step, score)
        roles = t.roles

        def weights(d: Path) -> None:
            roles.actor.model.save_pretrained(d / "actor", safe_serialization=True)
            t.tok.save_pretrained(d / "actor")
            if roles.critic is not None:
                save_file({k: v.contiguous() for k, v in roles.critic.model.state_dict().items()}, str(d / "critic.safetensors"))

        def optim(d: Path) -> None:
            state = {"actor": roles.actor.optimizer.state_dict(), "actor_sched": roles.actor.scheduler.state_dict()}
            if roles.critic is not None:
                state["critic"] = roles.critic.optimizer.state_dict()
            save_torch(state, d / "optim.pt")

        def trainer_state(d: Path) -> None:
            write_json(rng_state(), d / "rng.json")
            write_json(
                {
                    "step": t.step,
                    "controller": t.controller.state_dict(),
                    "data": t.sampler.state_dict(),
                    "guard": t.guard.state_dict(),
                    "reward": roles.reward.state_dict(),
                    "best": {"step": self.best_step, "score": self.best_score},
                    "last_val": t.last_val,
                    "val_score": score,
                },
                d / "trainer_state.json",
            )

        path = write_checkpoint(self.root, t.step, {"weights": weights, "optim": optim, "state": trainer_state})
        protect = {s for s in (self.best_step, t.guard.stable_step) if s is not None}
        prune_checkpoints(self.root, t.cfg.trainer.keep_last, protect)
        return path

    # -------------------------------------------------------------- loading
    def maybe_resume(self) -> None:
        """Apply ``trainer.resume``: auto (latest complete checkpoint here, if any), off, or a path."""
        mode = self.t.cfg.trainer.resume
        if mode == "off":
            return
        if mode == "auto":
            path = latest_valid_checkpoint(self.root)
            if path is None:
                return
        else:
            path = Path(mode)
            verify_checkpoint(path)
        self.load(path)
        log.info("resumed from %s (step %d)", path, self.t.step)

    def _load_weights(self, path: Path) -> None:
        roles = self.t.roles
        actor = roles.actor.model
        if hasattr(actor, "peft_config"):
            from peft import set_peft_model_state_dict

            files = sorted((path / "actor").glob("adapter_model.safetensors"))
            if not files:
                raise CheckpointError(f"checkpoint {path}: actor/adapter_model.safetensors is missing")
            set_peft_model_state_dict(actor, load_file(str(files[0])))
        else:
            state = {}
            for f in sorted((path / "actor").glob("*.safetensors")):
                state.update(load_file(str(f)))
            missing, unexpected = actor.load_state_dict(state, strict=False)
            missing = [k for k in missing if not _is_tied(actor, k)]
            if missing or unexpected:
                raise CheckpointError(f"checkpoint {path}: actor weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
        if roles.critic is not None:
            roles.critic.model.load_state_dict(load_file(str(path / "critic.safetensors")))
        optim = load_torch(path / "optim.pt")
        roles.actor.optimizer.load_state_dict(optim["actor"])
        roles.actor.scheduler.load_state_dict(optim["actor_sched"])
        if roles.critic is not None:
            roles.critic.optimizer.load_state_dict(optim["critic"])
        roles.engine.sync_weights(actor)

    def load(self, path: Path) -> None:
        """Restore everything from a verified checkpoint: the run continues exactly where it stopped."""
        self._load_weights(path)
        state = read_json(path / "trainer_state.json")
        t = self.t
        t.step = int(state["step"])
        t.controller.load_state_dict(state["controller"])
        t.sampler.load_state_dict(state["data"])
        t.guard.load_state_dict(state["guard"])
        t.roles.reward.load_state_dict(state["reward"])
        t.last_val = state.get("last_val") or {}
        self.best_step, self.best_score = state["best"]["step"], state["best"]["score"]
        set_rng_state(read_json(path / "rng.json"))

    def restore_weights(self, step: int) -> None:
        """Rollback: weights and optimizer state of checkpoint ``step``; data position and RNG go on."""
        path = self.root / step_dir_name(step)
        verify_checkpoint(path)
        self._load_weights(path)


def _is_tied(model, key: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or []
    if isinstance(tied, dict):
        tied = list(tied.keys())
    return key in tied or key.endswith("lm_head.weight")
