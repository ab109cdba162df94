"""The role interface: what the training loop calls on each role, and the set of roles of one run.

The loop (``tether.trainer.Trainer``) talks to its roles only through the protocols below, whatever
their placement: in this process (:class:`LocalPlacement`, the classes of ``tether.workers``) or on Ray
worker groups with FSDP2 (``tether.distributed.ray_backend``, whose driver-side roles forward each call
to the ranks, where the same ``tether.workers`` classes run). Placement wraps a role; it never re-creates
one: both placements build their roles with the factory of ``tether.workers.build`` (the HybridFlow
single-controller split, arXiv:2409.19256; torchtitan builds a model once, then applies parallelisms).

Units: log-probs in nats, (B, T) over a batch's response tokens; values V(s_t), (B, T).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from tether.batch import RolloutBatch
from tether.checkpoint import CheckpointError, load_torch, save_torch
from tether.rollout.engine import GenerationEngine

log = logging.getLogger("tether")


@runtime_checkable
class Policy(Protocol):
    """The actor role: π_θ and its optimizer (``tether.workers.ActorWorker``; ``RemoteActor`` under Ray)."""

    def compute_logprobs(self, batch: RolloutBatch, *, with_entropy: bool = True, full_kl_ref=None) -> tuple:
        """(old_logprobs (B, T), entropy (B, T) or None, exact KL to ``full_kl_ref`` (B, T) or None, ref_logprobs or
        None), nats.
        ``full_kl_ref`` is the run's reference role (``kl.estimator=full``): where the actor runs it computes the
        reference's logits itself (``ReferenceWorker.layout_logits``, on a Ray rank the rank's own reference)."""

    def update(self, batch: RolloutBatch, spec, step: int, ref=None) -> dict[str, float]:
        """PPO epochs over the batch (``ActorUpdateSpec``); the update's metrics."""

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rates by ``factor`` (a guard's rollback)."""

    @property
    def model(self) -> torch.nn.Module:
        """The whole policy as it is now (generation, validation, a LoRA checkpoint): pulled first where it lives
        elsewhere."""

    @property
    def model_as_is(self) -> torch.nn.Module:
        """The policy module for its config and parameter shapes only: never pulls weights."""

    def refresh(self) -> None:
        """Make ``model`` in this process the trained policy now (a lazy copy is pulled)."""

    @property
    def optimizer(self):
        """The optimizer, or a view of it: ``param_groups[0]["lr"]`` is the learning rate now (the guard's messages)."""


@runtime_checkable
class Reference(Protocol):
    """The frozen reference π_ref (``ReferenceWorker``; ``RemoteReference`` under Ray)."""

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """ref_logprobs (B, T), nats."""

    def reset_to(self, actor_model) -> None:
        """``ref.reset_every``: take the policy's weights."""

    def as_reference(self):
        """A context in which ``module``'s forward is π_ref (a LoRA policy's adapters disabled): exact/* enumerate
        it."""

    @property
    def module(self) -> torch.nn.Module | None:
        """The reference module in this process, or None where only the worker groups hold it."""


@runtime_checkable
class Teacher(Protocol):
    """The frozen teacher π_T of on-policy distillation (``distill.teacher``; a ``ReferenceWorker`` over its own
    model). It has no state to save: a checkpoint holds none of it."""

    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """teacher_logprobs (B, T), nats."""


@runtime_checkable
class Critic(Protocol):
    """The value model V(s_t) and its optimizer (``CriticWorker``; ``RemoteCritic`` under Ray)."""

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """V(s_t) (B, T)."""

    def update(self, batch: RolloutBatch, **kwargs) -> dict[str, float]:
        """Value-loss epochs over the batch; the update's metrics."""

    def scale_lr(self, factor: float) -> None:
        """Multiply the learning rate by ``factor``."""


@runtime_checkable
class Rollout(Protocol):
    """The rollout role (``tether.rollout.runner.RolloutRunner``, built whole by ``tether.workers.build.build_runner``
    over a :class:`~tether.rollout.engine.GenerationEngine`: HF, vLLM, or engine replicas as Ray actors)."""

    engine: GenerationEngine  # its ``name`` and ``capabilities`` say what it is and can do

    def rollout(self, prompts, indices, n: int) -> RolloutBatch:
        """``n`` responses for each prompt of ``prompts`` at ``indices``; ``generated_mask`` says which tokens the
        model wrote (``loss_mask`` starts from it)."""

    def sync_weights(self, model) -> None:
        """The engine takes the policy's weights after an update."""


@runtime_checkable
class Reward(Protocol):
    """The reward role (``tether.rewards.RewardManager``, or a dataset's stored scores)."""

    def __call__(self, rows, prompts, responses):
        """A ``tether.rewards.RewardResult``: scores (B,), which are valid, metrics, errors."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Placement(Protocol):
    """Where the model-owning roles run; it saves and loads them and ends them.

    ``trains_in_process``: the updates run in this process (their forward draws from this process's RNG).
    ``update_param_dtype``: the dtype the update's matmuls gather parameters in besides autocast (FSDP2's
    ``param_dtype`` under Ray), or None for the parameters' own.
    """

    trains_in_process: bool
    update_param_dtype: str | None

    def save_weights(self, roles: Roles, path: Path, *, with_ref: bool) -> None: ...

    def save_optimizer(self, roles: Roles, path: Path) -> None: ...

    def load(self, roles: Roles, path: Path, *, with_ref: bool, schedule: bool) -> None: ...

    def close(self) -> None: ...


@dataclass
class Roles:
    """The roles of one run, as the loop sees them, and their placement.

    ``engine`` is the rollout role, ``reward`` the training reward; ``val_reward`` scores generated
    validation responses when ``reward`` only replays dataset scores; ``gold`` is validation's gold reward
    (``tether.rewards.GoldReward``). ``model_paths``: {config key: model directory} of the models that run
    over whole sequences, for the start-up context-length check. ``teacher``: the frozen teacher of
    ``distill.teacher``, None when distillation is off.
    """

    tokenizer: Any
    actor: Policy
    ref: Reference
    critic: Critic | None
    engine: Rollout
    reward: Reward
    device: torch.device
    actor_path: Any
    val_reward: Any = None
    placement: Placement = field(default_factory=lambda: LocalPlacement())
    model_paths: dict = field(default_factory=dict)
    gold: Any = None
    teacher: Teacher | None = None

    def save_weights(self, path: Path, *, with_ref: bool) -> None:
        """The model-owning roles' weights into checkpoint directory ``path`` (``tether.checkpoint``'s layout)."""
        self.placement.save_weights(self, Path(path), with_ref=with_ref)

    def save_optimizer(self, path: Path) -> None:
        """Their optimizer and LR-scheduler states (under Ray: already in the sharded weights)."""
        self.placement.save_optimizer(self, Path(path))

    def load(self, path: Path, *, with_ref: bool, schedule: bool = True) -> None:
        """Weights and optimizer states from ``path``; ``schedule=False`` keeps the current learning rates
        and LR schedule (a rollback). The rollout engine then takes the policy's weights.

        Raises:
            CheckpointError: a file is missing, or the checkpoint was written by another placement.
        """
        self.placement.load(self, Path(path), with_ref=with_ref, schedule=schedule)

    def close(self) -> None:
        """End the placement's workers (and a Ray this run started); nothing for :class:`LocalPlacement`."""
        self.placement.close()


class LocalPlacement:
    """Every role in this process: each saves and loads its own files of the checkpoint layout
    (``actor/`` a ``save_pretrained`` directory, ``critic.safetensors``, ``ref.safetensors``, ``optim.pt``)."""

    trains_in_process = True
    update_param_dtype = None

    def save_weights(self, roles: Roles, path: Path, *, with_ref: bool) -> None:
        roles.actor.save(path / "actor", roles.tokenizer)
        if roles.critic is not None:
            roles.critic.save(path / "critic.safetensors")
        if with_ref:
            roles.ref.save(path / "ref.safetensors")

    def save_optimizer(self, roles: Roles, path: Path) -> None:
        state = roles.actor.optimizer_state()
        if roles.critic is not None:
            state |= roles.critic.optimizer_state()
        save_torch(state, path / "optim.pt")

    def load(self, roles: Roles, path: Path, *, with_ref: bool, schedule: bool) -> None:
        if (path / "dcp").is_dir():
            raise CheckpointError(
                f"checkpoint {path} holds sharded dcp/ weights written by trainer.backend=ray; resume it with "
                "trainer.backend=ray (any trainer.n_workers), or `tether export` it to a model directory"
            )
        roles.actor.load(path / "actor", path)
        if roles.critic is not None:  # a checkpoint's critic this run does not use: tether.trainer.state says so
            roles.critic.load(path / "critic.safetensors")
        if with_ref:
            roles.ref.load(path / "ref.safetensors")
        optim = load_torch(path / "optim.pt")
        roles.actor.load_optimizer_state(optim, schedule=schedule)
        if roles.critic is not None:
            if "critic" not in optim:
                raise CheckpointError(f"checkpoint {path}: optim.pt has no critic optimizer state")
            roles.critic.load_optimizer_state(optim, schedule=schedule)
        roles.engine.sync_weights(roles.actor.model)

    def close(self) -> None:
        pass
