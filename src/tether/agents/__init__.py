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
)
from tether.agents.tools import (
    Environment,
    StepResult,
    Tool,
    ToolEnvironment,
    ToolOutcome,
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
    "check_turn_contexts",
    "first_mismatch",
    "load_environment",
    "load_tools",
    "mismatch_message",
    "parse_tool_calls",
    "resolve_format",
    "run_tool",
    "tool_schema",
    "tool_text",
]


@dataclass(frozen=True)
class AgentSpec:
    """The loaded ``agent`` section: what :class:`tether.rollout.agent.AgentRunner` runs.

    Attributes:
        tools: the tools (empty with an environment); environment: the environment factory, or None;
        max_turns, max_observation_tokens, tool_timeout_s, tool_format, on_prefix_mismatch: the ``agent.*`` keys.
    """

    tools: list[Tool] = field(default_factory=list)
    environment: Callable | None = None
    max_turns: int = 4
    max_observation_tokens: int | None = 256
    tool_timeout_s: float | None = 10.0
    tool_format: str = "auto"
    on_prefix_mismatch: str = "error"


def build_agent(agent, *, base_dir: str | Path | None = None) -> AgentSpec | None:
    """The :class:`AgentSpec` of an ``agent`` config section (None when it is off), its user code imported and its
    tools' signatures read: call it before loading weights.

    Raises:
        ValueError: one line naming the key (``agent.tools``, ``agent.environment``) and the spec.
    """
    if not agent.enabled:
        return None
    tools = load_tools(list(agent.tools), base_dir=base_dir) if agent.tools else []
    env = load_environment(agent.environment, base_dir=base_dir) if agent.environment else None
    return AgentSpec(
        tools,
        env,
        agent.max_turns,
        agent.max_observation_tokens,
        agent.tool_timeout_s,
        agent.tool_format,
        agent.on_prefix_mismatch,
    )
