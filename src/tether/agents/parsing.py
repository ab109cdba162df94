"""Tool calls in a model turn's text, in two formats.

* ``qwen``: the ``<tool_call>`` JSON blocks of Qwen2.5's and Qwen3's chat templates (Hermes-style),
  ``<tool_call>\\n{"name": "add", "arguments": {"a": 1, "b": 2}}\\n</tool_call>``, any number per turn, anywhere in
  it. ``arguments`` may also be a JSON string holding the object (some models write it so).
* ``plain``, for models whose template has no tool-call format: one call per line, the line starting with
  ``CALL`` then the tool name then, optionally, a JSON object of arguments: ``CALL add {"a": 1, "b": 2}``.

A block or line that starts a call but cannot be read (bad JSON, no name, arguments not an object, a
``<tool_call>`` never closed) is a :class:`ToolCall` with ``error`` set: the tool runner turns it into an error
observation (``agent/tool_errors``), so the model learns from it and the run goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

__all__ = ["FORMATS", "ToolCall", "parse_tool_calls", "resolve_format"]

#: ``agent.tool_format``'s values besides ``auto``.
FORMATS = ("qwen", "plain")

_QWEN = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
_PLAIN = re.compile(r"^[ \t]*CALL(?:[ \t]+(\S+)[ \t]*(.*?))?[ \t]*$", re.M)
#: What a tool name starts with: a JSON fragment in its place (``CALL {"a": 1}``) is a call with no name.
_NOT_A_NAME = tuple('{["')


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` and ``arguments`` (a dict), or ``error`` (why the text is not a call)."""

    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None


def resolve_format(fmt: str, chat_template: str | None) -> str:
    """``auto`` is ``qwen`` when the chat template mentions ``<tool_call>``, else ``plain``."""
    if fmt != "auto":
        return fmt
    return "qwen" if chat_template and "<tool_call>" in chat_template else "plain"


def _call(name, arguments, what: str) -> ToolCall:
    if not isinstance(name, str) or not name:
        return ToolCall(None, {}, f"{what} has no tool name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(name, {}, f"the arguments of {name!r} are not JSON ({e.msg})")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
    """The calls in ``text``, in order (empty: the turn calls no tool).

    Args:
        text: the model's turn, decoded. fmt: ``"qwen"`` or ``"plain"``.

    Raises:
        ValueError: an unknown ``fmt``.
    """
    if fmt == "qwen":
        calls = []
        for m in _QWEN.finditer(text):
            if not m.group(2):
                calls.append(ToolCall(None, {}, "<tool_call> is never closed by </tool_call>"))
                continue
            try:
                obj = json.loads(m.group(1).strip())
            except json.JSONDecodeError as e:
                calls.append(ToolCall(None, {}, f"the <tool_call> block is not JSON ({e.msg})"))
                continue
            if not isinstance(obj, dict):
                calls.append(ToolCall(None, {}, "the <tool_call> block must be a JSON object with name and arguments"))
                continue
            calls.append(_call(obj.get("name"), obj.get("arguments", obj.get("parameters")), "the <tool_call> block"))
        return calls
    if fmt == "plain":
        calls = []
        for m in _PLAIN.finditer(text):
            name = m.group(1)
            if not name or name.startswith(_NOT_A_NAME):  # a bare CALL, or CALL {json}: no name
                calls.append(ToolCall(None, {}, "the CALL line has no tool name (CALL name {json})"))
            else:
                calls.append(_call(name, m.group(2), "the CALL line"))
        return calls
    raise ValueError(f"tool format must be one of {FORMATS}, got {fmt!r}")
