"""Placement: where a run's roles live, chosen once from ``trainer.backend``.

``local``: every role in this process (:func:`tether.workers.build.build_local_roles`). ``ray``:
:func:`tether.distributed.ray_backend.build_ray_roles` has the same factory build the driver's share (tokenizer,
its copy of the policy, reward), puts actor, reference and critic on Ray worker groups whose ranks build their
roles with the same factory and model recipe (:class:`tether.distributed.worker.RankWorker`), and builds the
rollout role whole (over engine replicas as Ray actors, or the engine on the driver's copy). The loop
sees one :class:`~tether.workers.roles.Roles` either way; besides the config's validation and the memory planner's
notes, this module and the factory are the only places that read ``trainer.backend`` (``tests/test_architecture.py``).
"""

from __future__ import annotations

from transformers import AutoConfig

from tether.config import EXACT_TEACHER, ConfigError, TetherConfig
from tether.distributed.parallel import ParallelDims
from tether.distributed.ray_backend import build_ray_roles, check_ray_installed, probe_ray_address
from tether.models import resolve_model_path
from tether.workers.build import build_local_roles
from tether.workers.roles import Roles


def build_roles(cfg: TetherConfig) -> Roles:
    """Load every model once and place the roles as ``trainer.backend`` says.

    Raises:
        ConfigError: Ray missing or not answering at ``trainer.ray_address``, an ``actor.tp_size`` that does not
            split a model's heads, or a bad model directory: each before any model loads where it can be.
    """
    if cfg.trainer.backend == "ray":
        check_ray_installed()  # a one-line error naming the extra, before any model loads
        # a cluster that does not answer: one line in seconds, not Ray's 14 minutes of retries
        if cfg.trainer.ray_address:
            probe_ray_address(cfg.trainer.ray_address)
        if cfg.actor.tp_size > 1:
            # before any model loads or Ray starts
            check_tp_heads(cfg, resolve_model_path(cfg.actor.model, "actor.model", task=cfg.data.embedded_task))
        return build_ray_roles(cfg)  # actor, ref and critic run on Ray worker groups; the rest stays here
    return build_local_roles(cfg)


def check_tp_heads(cfg: TetherConfig, actor_path) -> None:
    """``actor.tp_size`` must split the attention and KV heads of every model the worker groups shard (the actor,
    and a separate ``ref.model`` / ``critic.model`` / ``distill.teacher``), read from their config.json before anything
    loads.

    Raises:
        ConfigError: naming ``actor.tp_size``, the model's key and the count it does not divide.
    """
    dims = ParallelDims.from_world(cfg.actor.tp_size, cfg.actor.tp_size)
    models = {"actor.model": actor_path}
    for key, value in (
        ("ref.model", cfg.ref.model),
        ("critic.model", cfg.critic.model if cfg.algo.adv_estimator == "gae" else None),
        ("distill.teacher", cfg.distill.teacher if cfg.distill.teacher != EXACT_TEACHER else None),
    ):
        if value is not None:
            models[key] = resolve_model_path(value, key, task=cfg.data.embedded_task)
    for key, path in models.items():
        try:
            dims.check_model(AutoConfig.from_pretrained(path, trust_remote_code=cfg.actor.trust_remote_code))
        except ConfigError as e:
            raise ConfigError(f"{e} ({key}={path})") from None
