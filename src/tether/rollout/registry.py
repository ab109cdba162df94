"""Acting on the engine registry (:mod:`tether.engines`): resolve ``rollout.engine=auto``, build an engine, and the
sampling settings a run's rollouts use.

An engine's implementation module (:attr:`tether.engines.EngineEntry.module`) provides:

``check_usable(model_path, *, key, value) -> str``
    What will run (a phrase for the log), or ConfigError naming why the engine cannot run here (not installed, no
    GPU for a GPU build, a model it does not support), before any model loads. ``model_path`` None checks the
    install alone; ``key``/``value``: the model's config key and value as the user wrote it, for the message.
``build(cfg, *, model, tokenizer, model_path, eos_token_ids) -> GenerationEngine``
    The engine in this process: over the policy module ``model`` itself, or loading ``model_path`` when it holds
    its own weights (``capabilities.holds_weights``; the policy's reach it by ``sync_weights``).
``build_replica(cfg, *, index, model_path, tokenizer, eos_token_ids, sleeps) -> GenerationEngine``
    Only for ``on_ray="replicas"``: replica ``index`` inside a Ray actor; it must also satisfy
    :class:`~tether.rollout.engine.StreamsWeights` (its weights stream from the actor's shards), and its
    settings section has ``replicas``, ``tensor_parallel_size`` and ``sync_bucket_mib``
    (:class:`tether.distributed.rollout_workers.ReplicaGroup`).
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from tether.config import ConfigError
from tether.engines import AUTO, auto_order, entry, passed_over_by_auto
from tether.rollout.engine import GenerationEngine, SamplingParams

log = logging.getLogger("tether")


def engine_module(name: str) -> ModuleType:
    """The implementation module of engine ``name`` (imported on first use: vLLM's never loads for an HF run)."""
    return importlib.import_module(entry(name).module)


def resolve(
    engine: str,
    model_path,
    *,
    on_ray: bool = False,
    async_steps: int = 0,
    agent: bool = False,
    key: str = "actor.model",
    value: str | None = None,
) -> tuple[str, str]:
    """The engine ``rollout.engine`` runs, and why. Never raises for ``auto``: what rules an engine out becomes
    the reason.

    Args:
        engine: ``rollout.engine``: an engine's name, or ``auto``.
        model_path: the actor's model directory; key, value: its config key and value, for messages.
        on_ray: the roles run on Ray worker groups (``trainer.backend=ray``): auto never picks an engine that runs
            as Ray replicas (they are asked for by name).
        async_steps: ``rollout.async_steps``: auto picks only an engine that generates on a policy snapshot.
        agent: ``agent.tools`` / ``agent.environment`` set: auto picks only an engine that runs the multi-turn loop.
    Returns:
        ``(name, reason)``: a named engine as given (its checks run when it is built); for ``auto`` the first engine
        of :func:`tether.engines.auto_order` that the run allows and that :func:`check_usable` accepts, the reason
        naming why each one before it was passed over.
    """
    if engine != AUTO:
        return engine, f"rollout.engine={engine}"
    passed: list[str] = []
    for e in auto_order():
        why = passed_over_by_auto(e, on_ray=on_ray, async_steps=async_steps, agent=agent)
        if why is None:
            try:
                found = engine_module(e.name).check_usable(model_path, key=key, value=value)
            except ConfigError as err:
                why = unusable_reason(err, e.name)
            else:
                return e.name, "; ".join([*passed, found]) if passed else found
        passed.append(f"not {e.name}: {why}")
    raise RuntimeError(f"rollout.engine=auto: no engine can run ({'; '.join(passed)})")  # the fallback always can


def unusable_reason(err: ConfigError, name: str) -> str:
    """The reason of a ``check_usable`` error without its ``rollout.engine=<name>:`` prefix and the advice after its
    first sentence (which names config keys): what a log line or ``tether eval`` quotes."""
    return str(err).removeprefix(f"rollout.engine={name}").lstrip(": ").split(". ")[0]


def check_usable(name: str, model_path, *, key: str = "actor.model", value: str | None = None) -> str:
    """Engine ``name`` can run here with this model (before any model loads); what will run.

    Raises:
        ConfigError: naming why not (e.g. vLLM not installed, a head size its CPU kernels lack).
    """
    return engine_module(name).check_usable(model_path, key=key, value=value)


def build_engine(name: str, cfg, *, model, tokenizer, model_path, eos_token_ids: list[int]) -> GenerationEngine:
    """Engine ``name`` (resolved: not ``auto``) in this process, by its module's ``build``.

    Raises:
        ConfigError: the engine cannot run here (:func:`check_usable`).
    """
    engine = engine_module(name).build(
        cfg, model=model, tokenizer=tokenizer, model_path=model_path, eos_token_ids=eos_token_ids
    )
    if engine.name != name:
        raise RuntimeError(f"{entry(name).module}.build returned the engine {engine.name!r}, not {name!r}")
    return engine


def sampling_params(cfg) -> SamplingParams:
    """A run's rollout sampling: ``rollout.engine_temperature`` (else ``rollout.temperature``), ``top_p``,
    ``top_k``, ``max_new_tokens``, ``do_sample``; no log-probs (the runner asks for them where they are used)."""
    r = cfg.rollout
    return SamplingParams(
        temperature=r.engine_temperature or r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        do_sample=r.do_sample,
    )


def wants_logprobs(cfg, engine: GenerationEngine) -> bool:
    """Whether a run's rollouts ask for the sampled tokens' log-probs: ``actor.old_logprobs_source=rollout`` and
    ``algo.rollout_correction`` need them; an engine that holds its own weights (vLLM) returns them always, to
    measure the training-inference mismatch (``rollout/logprob_diff_*``); never from an engine without them."""
    needed = cfg.actor.old_logprobs_source == "rollout" or cfg.algo.rollout_correction.active
    return engine.capabilities.logprobs and (needed or engine.capabilities.holds_weights)
