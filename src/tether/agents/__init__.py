"""Multi-turn, tool-using agents: tools and environments (:mod:`.tools`), tool-call formats (:mod:`.parsing`),
observations as tokens and the prefix check (:mod:`.templates`); the turn loop that runs them is
:class:`tether.rollout.agent.AgentRunner`. docs/agents.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tether.agents.parsing import FORMATS, ToolCall, parse_tool_calls, resolve_format
from tether.agents.templates import (
    ObservationRenderer,
    PrefixMismatch,
    check_turn_contexts,
    first_mismatch,
    mismatch_message,
    plain_observation_problem,
)
from tether.agents.tools import (
    Environment,
    StepResult,
    Tool,
    ToolEnvironment,
    ToolOutcome,
    check_environment_args,
    load_environment,
    load_tools,
    run_tool,
    tool_schema,
    tool_text,
)

__all__ = [
    "FORMATS",
    "AgentSpec",
    "Environment",
    "ObservationRenderer",
    "PrefixMismatch",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolOutcome",
    "build_agent",
    "check_environment_args",
    "check_row_environments",
    "check_turn_contexts",
    "environment_kwargs",
    "first_mismatch",
    "load_environment",
    "load_tools",
    "mismatch_message",
    "parse_tool_calls",
    "plain_observation_problem",
    "resolve_format",
    "row_environment",
    "run_tool",
    "tool_schema",
    "tool_text",
]


@dataclass(frozen=True)
class AgentSpec:
    """The loaded ``agent`` section: what :class:`tether.rollout.agent.AgentRunner` runs.

    Attributes:
        tools: the tools (empty with an environment); environment: the environment factory, or None (a row without
        ``extra_info.environment`` runs it); environments: the factories a row picks by name (``agent.environments``);
        max_turns, max_observation_tokens, tool_timeout_s, tool_format, on_prefix_mismatch, step_timeout_s: the
        ``agent.*`` keys.
    """

    tools: list[Tool] = field(default_factory=list)
    environment: Callable | None = None
    max_turns: int = 4
    max_observation_tokens: int | None = 256
    tool_timeout_s: float | None = 10.0
    tool_format: str = "auto"
    on_prefix_mismatch: str = "error"
    environments: dict[str, Callable] = field(default_factory=dict)
    step_timeout_s: float | None = 60.0

    def factory(self, row, index: int) -> Callable | None:
        """The environment factory of ``row`` (sample ``index``): ``environments[extra_info.environment]`` when
        :attr:`environments` is set and the row names one, else :attr:`environment` (None with tools).

        Raises:
            ValueError: :func:`row_environment`'s.
        """
        if not self.environments:
            return self.environment
        name = row_environment(row, index, sorted(self.environments), has_default=self.environment is not None)
        return self.environment if name is None else self.environments[name]


def row_environment(row, index: int, known: list[str], *, has_default: bool, where: str = "sample") -> str | None:
    """The name of the environment a row picks (``extra_info.environment``, one of ``agent.environments``), or None
    for the default (``agent.environment``). ``row`` is a dict or has ``extra_info``; ``where`` names its place in
    the message (``sample`` in a rollout, ``data.train_files row`` before training).

    Raises:
        ValueError: the name is not in ``known`` (one line: the row index, the name, the known names), or the row
            names none and there is no default.
    """
    extra = (row.get("extra_info") if isinstance(row, dict) else getattr(row, "extra_info", None)) or {}
    name = extra.get("environment") if isinstance(extra, dict) else None
    if name is None:
        if has_default:
            return None
        raise ValueError(
            f"{where} {index} has no extra_info.environment and agent.environment is null: name one of "
            f"agent.environments ({', '.join(known)}) in the row, or set agent.environment for rows without one"
        )
    if name not in known:
        raise ValueError(
            f"{where} {index} has extra_info.environment={name!r}, not one of agent.environments ({', '.join(known)}); "
            "fix the row or add the name to agent.environments"
        )
    return name


def environment_kwargs(row) -> dict:
    """The keyword arguments an environment is made with for ``row`` (a dict or with ``extra_info``): its
    ``extra_info.interaction_kwargs`` less ``name`` (verl's interaction name)."""
    extra = (row.get("extra_info") if isinstance(row, dict) else getattr(row, "extra_info", None)) or {}
    kwargs = extra.get("interaction_kwargs") if isinstance(extra, dict) else None
    return {k: v for k, v in (kwargs or {}).items() if k != "name"}


def check_row_environments(agent, rows: list, key: str, *, base_dir: str | Path | None = None) -> None:
    """Before training: every row of ``rows`` (from ``key``, e.g. ``data.train_files``) picks a known environment
    (:func:`row_environment`) when the ``agent`` config section sets ``agent.environments``, and the environment it
    runs can be called with the row's ``interaction_kwargs`` (:func:`environment_kwargs`) as the runner calls it.

    Raises:
        ValueError: the first bad row, naming ``key``, its index, the name and the known names; or the first row
            whose keyword arguments the environment's signature cannot bind, naming its ``agent.environment*`` key.
    """
    if agent.environment is None and not agent.environments:
        return
    known = sorted(agent.environments)
    specs = {None: agent.environment, **agent.environments}
    factories: dict = {}
    for i, row in enumerate(rows):
        name = (
            row_environment(row, i, known, has_default=agent.environment is not None, where=f"{key} row")
            if known
            else None
        )
        env_key = "agent.environment" if name is None else f"agent.environments.{name}"
        if name not in factories:
            factories[name] = load_environment(specs[name], base_dir=base_dir, key=env_key)
        check_environment_args(factories[name], environment_kwargs(row), key=env_key, where=f"{key} row {i}")


def build_agent(agent, *, base_dir: str | Path | None = None) -> AgentSpec | None:
    """The :class:`AgentSpec` of an ``agent`` config section (None when it is off), its user code imported and its
    tools' signatures read: call it before loading weights.

    Raises:
        ValueError: one line naming the key (``agent.tools``, ``agent.environment``, ``agent.environments.<name>``)
            and the spec.
    """
    if not agent.enabled:
        return None
    tools = load_tools(list(agent.tools), base_dir=base_dir) if agent.tools else []
    env = load_environment(agent.environment, base_dir=base_dir) if agent.environment else None
    named = {
        name: load_environment(spec, base_dir=base_dir, key=f"agent.environments.{name}")
        for name, spec in agent.environments.items()
    }
    return AgentSpec(
        tools,
        env,
        agent.max_turns,
        agent.max_observation_tokens,
        agent.tool_timeout_s,
        agent.tool_format,
        agent.on_prefix_mismatch,
        named,
        agent.step_timeout_s,
    )
