"""Tools as plain typed Python functions, environments with ``reset``/``step``, and a tool set as an environment.

A **tool** is a function with a type annotation on every parameter and a Google-style docstring; its schema (the
OpenAI / Qwen ``tools`` format that chat templates render into the system prompt) comes from both::

    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first addend.
            b: the second addend.
        \"\"\"
        return a + b

gives ``{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters":
{"type": "object", "properties": {"a": {"type": "integer", "description": "the first addend."}, ...},
"required": ["a", "b"]}}}``. Keyword-only parameters (after ``*``) are not shown to the model: a dataset row fills
them (verl's ``extra_info.tools_kwargs[<tool>].create_kwargs``), e.g. the ground truth a checker tool needs.

An **environment** is any object with ``reset(row) -> str | list[dict] | None`` (an optional first observation)
and ``step(model_turn: str) -> StepResult``; ``agent.environment`` names a class or factory called once per
trajectory with the row's ``extra_info.interaction_kwargs`` (verl's key; its ``name`` entry is dropped) as keyword
arguments. A tool set is one (:class:`ToolEnvironment`).

Source: the schema format is OpenAI's function-calling ``tools`` list, as Qwen2.5/Qwen3 chat templates take it and
as ``transformers.utils.get_json_schema`` derives it; the row keys are verl's (``tools_kwargs``,
``interaction_kwargs``); ``reset``/``step`` is OpenRLHF's and SkyRL's gym-style agent.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

from tether.agents.parsing import ToolCall, parse_tool_calls
from tether.rewards.registry import load_spec_attribute

__all__ = [
    "Environment",
    "StepResult",
    "Tool",
    "ToolEnvironment",
    "ToolOutcome",
    "load_environment",
    "load_tools",
    "run_tool",
    "tool_schema",
    "tool_text",
]

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass
class StepResult:
    """What an environment returns after a model turn.

    Attributes:
        observation: what the model sees next: a str (rendered as a ``user`` message), a list of chat messages
            (``{"role": "tool" | "user", "content": str}``), or None (nothing; with ``done`` False the model just
            takes another turn).
        reward: this turn's reward (placed at the turn's last model token), or None for none.
        done: the episode ends after this turn.
        events: counters for the metrics (``tool_calls``, ``tool_errors``); environments may leave it empty.
    """

    observation: str | list[dict] | None = None
    reward: float | None = None
    done: bool = False
    events: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """The protocol of ``agent.environment``: one instance per trajectory."""

    def reset(self, row: Any) -> str | list[dict] | None: ...

    def step(self, model_turn: str) -> StepResult: ...


def _docstring_args(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) of a Google-style docstring: the description is the text before the
    first section header; ``Args:`` entries are ``name: text`` or ``name (type): text``, continuation lines
    indented deeper."""
    doc = inspect.cleandoc(doc or "")
    lines = doc.splitlines()
    header = re.compile(r"^(Args|Arguments|Returns|Raises|Yields|Examples?|Notes?):\s*$")
    desc, args, i = [], {}, 0
    while i < len(lines) and not header.match(lines[i].strip()):
        desc.append(lines[i])
        i += 1
    current = None
    in_args = False
    for line in lines[i:]:
        if header.match(line.strip()) and not line.startswith((" ", "\t")):
            in_args = line.strip().rstrip(":") in ("Args", "Arguments")
            current = None
            continue
        if not in_args or not line.strip():
            continue
        m = re.match(r"^\s{1,8}(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
        if m and (current is None or len(line) - len(line.lstrip()) <= args[current][1]):
            current = m.group(1).lstrip("*")
            args[current] = (m.group(3).strip(), len(line) - len(line.lstrip()))
        elif current is not None:
            args[current] = ((args[current][0] + " " + line.strip()).strip(), args[current][1])
    return " ".join(x.strip() for x in desc if x.strip()), {k: v[0] for k, v in args.items()}


def _json_type(annotation, where: str) -> dict:
    """The JSON schema of a parameter's annotation: str/int/float/bool/list[X]/dict/Literal[...]/X | None."""
    origin, targs = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is typing.Literal:
        kinds = {type(a) for a in targs}
        if len(kinds) == 1 and next(iter(kinds)) in _JSON_TYPES:
            return {"type": _JSON_TYPES[next(iter(kinds))], "enum": list(targs)}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        rest = [a for a in targs if a is not type(None)]
        if len(rest) == 1:
            return {**_json_type(rest[0], where), "nullable": True}
    if origin in (list, tuple, set) or annotation in (tuple, set):
        return {"type": "array", **({"items": _json_type(targs[0], where)} if targs and targs[0] is not ... else {})}
    if origin is dict:
        return {"type": "object"}
    raise ValueError(
        f"{where} is annotated {annotation!r}, which has no JSON type; use str, int, float, bool, list[...], dict, "
        "Literal[...] or X | None"
    )


@dataclass(frozen=True)
class Tool:
    """A tool: the function, its name, its schema and the parameters the model sets (the rest come from the row).

    Attributes:
        fn: the function; name: its ``__name__`` (what the model calls); schema: the ``tools`` entry;
        params: the model's parameters; hidden: keyword-only parameters a row fills (``tools_kwargs``);
        nullable: the parameters annotated ``X | None``, which accept a JSON ``null``.
    """

    fn: Callable
    name: str
    schema: dict
    params: tuple[str, ...]
    hidden: tuple[str, ...]
    nullable: tuple[str, ...] = ()


def tool_schema(fn: Callable, *, spec: str = "", key: str = "agent.tools") -> Tool:
    """The :class:`Tool` of a typed function (schema from its signature and Google-style docstring).

    Raises:
        ValueError: one line naming ``key``, the spec and the parameter: an unannotated parameter, an annotation
            with no JSON type, ``*args``/``**kwargs``, or no docstring.
    """
    where = f"{key}={spec or fn.__name__!r}"
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as e:
        raise ValueError(f"{where}: cannot read the signature of {fn!r} ({e}); a tool is a typed function") from None
    description, arg_docs = _docstring_args(inspect.getdoc(fn) or "")
    if not description:
        raise ValueError(f"{where}: tool {fn.__name__!r} has no docstring; its first line is what the model reads")
    properties, required, params, hidden, nullable = {}, [], [], [], []
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"{where}: tool {fn.__name__!r} takes {p}; a tool's parameters are named and typed")
        if p.kind is p.KEYWORD_ONLY:
            hidden.append(name)
            continue
        if name not in hints:
            raise ValueError(
                f"{where}: parameter {name!r} of tool {fn.__name__!r} has no type annotation; annotate it "
                "(e.g. {name}: str) so its JSON schema can be given to the model".replace("{name}", name)
            )
        prop = _json_type(hints[name], f"{where}: parameter {name!r} of tool {fn.__name__!r}")
        if prop.pop("nullable", False):
            nullable.append(name)
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        properties[name] = prop
        params.append(name)
        if p.default is p.empty:
            required.append(name)
    schema = {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }
    return Tool(fn, fn.__name__, schema, tuple(params), tuple(hidden), tuple(nullable))


def load_tools(specs: list[str], *, base_dir: str | Path | None = None, key: str = "agent.tools") -> list[Tool]:
    """Load ``agent.tools`` (each ``path.py:name`` or ``module:name``, as ``reward.function``) with their schemas.

    Raises:
        ValueError: one line naming ``key`` and the spec (file missing, import failure, missing name, untyped
            parameter, two tools of one name).
    """
    tools, seen = [], {}
    for spec in specs:
        try:
            fn = load_spec_attribute(spec, base_dir=base_dir, key=key, what="tool")
        except ValueError as e:
            raise ValueError(str(e) if key in str(e) else f"{key}={spec!r}: {e}") from e
        tool = tool_schema(fn, spec=spec, key=key)
        if tool.name in seen:
            raise ValueError(f"{key}: {spec!r} and {seen[tool.name]!r} are both named {tool.name!r}; rename one")
        seen[tool.name] = spec
        tools.append(tool)
    return tools


def load_environment(spec: str, *, base_dir: str | Path | None = None, key: str = "agent.environment") -> Callable:
    """The class or factory named by ``agent.environment``; a class must define ``reset`` and ``step``.

    Raises:
        ValueError: one line naming ``key`` and the spec.
    """
    try:
        factory = load_spec_attribute(spec, base_dir=base_dir, key=key, what="environment")
    except ValueError as e:
        raise ValueError(str(e) if key in str(e) else f"{key}={spec!r}: {e}") from e
    if inspect.isclass(factory):
        missing = [m for m in ("reset", "step") if not callable(getattr(factory, m, None))]
        if missing:
            raise ValueError(
                f"{key}={spec!r}: class {factory.__name__} has no {' or '.join(missing)} method; an environment "
                "defines reset(row) -> str | None and step(model_turn) -> StepResult"
            )
    return factory


def check_environment_args(factory: Callable, kwargs: dict, *, key: str, where: str) -> None:
    """The environment ``factory`` can be called with ``kwargs`` (a row's ``interaction_kwargs``), as the runner
    calls it; a factory whose signature cannot be read is not checked.

    Raises:
        ValueError: one line naming ``key``, ``where`` (the row) and why the arguments do not bind.
    """
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        name = getattr(factory, "__name__", type(factory).__name__)
        raise ValueError(
            f"{key}: {name}{sig} cannot be made for {where} with extra_info.interaction_kwargs {kwargs!r}: {e}; an "
            "environment is a class or factory called with the row's interaction_kwargs"
        ) from None


def tool_text(value: Any) -> str:
    """A tool's return value as the text the model reads: a str as is; an int/float/bool as ``str()``; a dict,
    list or tuple as JSON (``json.dumps``, ``ensure_ascii=False``).

    Raises:
        TypeError: anything else (None included), or a dict/list that is not JSON-able.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"returned a {type(value).__name__} that is not JSON-able ({e})") from None
    raise TypeError(f"returned {type(value).__name__}, not text (return a str, a number, or a JSON-able dict/list)")


class ToolOutcome(NamedTuple):
    """One call's result: the text the model reads and whether it is an error (counted in ``agent/tool_errors``)."""

    text: str
    error: bool


def run_tool(
    tool: Tool | None, call: ToolCall, *, timeout_s: float | None, row_kwargs: dict | None = None
) -> ToolOutcome:
    """Run one parsed call; every failure becomes an error outcome whose text says what went wrong.

    The call runs in a daemon thread joined for ``timeout_s`` seconds (None: no limit); a call past it is
    abandoned (its thread cannot be killed and finishes, or not, on its own) and reported as timed out.
    Failures: a malformed call, an unknown tool, arguments that are not the tool's (unknown, missing, wrong JSON
    type, outside a ``Literal``'s enum, a list item of the wrong type; ``null`` only for ``X | None``), an exception,
    a timeout, a return value that is not text (:func:`tool_text`).
    """
    if call.error is not None:
        return ToolOutcome(f"Error: malformed tool call: {call.error}", True)
    if tool is None:
        return ToolOutcome(f"Error: unknown tool {call.name!r}", True)
    args = call.arguments
    unknown = sorted(set(args) - set(tool.params))
    if unknown:
        return ToolOutcome(f"Error: tool {tool.name!r} has no parameter(s) {', '.join(unknown)}", True)
    missing = [p for p in tool.schema["function"]["parameters"]["required"] if p not in args]
    if missing:
        return ToolOutcome(f"Error: tool {tool.name!r} needs {', '.join(missing)}", True)
    for name, value in args.items():
        prop = tool.schema["function"]["parameters"]["properties"][name]
        if value is None and name in tool.nullable:  # X | None: an explicit null is the None it allows
            continue
        if (want := _arg_problem(value, prop)) is not None:
            return ToolOutcome(f"Error: argument {name!r} of tool {tool.name!r} must be {want}, got {value!r}", True)
    kwargs = {**{k: v for k, v in (row_kwargs or {}).items() if k in tool.hidden}, **args}
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = tool.fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - a tool's failure is the model's observation
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name=f"tether-tool-{tool.name}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return ToolOutcome(f"Error: tool {tool.name!r} timed out after {timeout_s:g} s", True)
    if "error" in box:
        e = box["error"]
        return ToolOutcome(f"Error: tool {tool.name!r} raised {type(e).__name__}: {e}", True)
    try:
        return ToolOutcome(tool_text(box.get("value")), False)
    except TypeError as e:
        return ToolOutcome(f"Error: tool {tool.name!r} {e}", True)


def _arg_problem(value, prop: dict) -> str | None:
    """What ``value`` must be, when it breaks the advertised schema ``prop``: its JSON type, its ``enum`` (a
    ``Literal``), and each item of an array against ``items`` (a ``null`` item only where ``items`` is nullable);
    None when it fits."""
    want = prop.get("type")
    if not _is_json_type(value, want):
        return want
    if "enum" in prop and value not in prop["enum"]:
        return "one of " + ", ".join(repr(v) for v in prop["enum"])
    if want == "array" and "items" in prop:
        for i, item in enumerate(value):
            if item is None and prop["items"].get("nullable"):
                continue
            if (inner := _arg_problem(item, prop["items"])) is not None:
                return f"an array whose items are {inner} (item {i} is {item!r})"
    return None


def _is_json_type(value, want: str | None) -> bool:
    if want is None:
        return True
    if want == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if want == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "array": list, "object": dict}[want])


class ToolEnvironment:
    """A tool set as an environment: each model turn is parsed for tool calls (:func:`parse_tool_calls`); a turn
    with none ends the episode (it is the answer); otherwise every call runs (:func:`run_tool`) and their outputs
    are the observation, one ``tool`` message per call, in order. Per-turn rewards: none (the final reward comes
    from ``reward.function``).

    Args:
        tools: the tools; fmt: ``"qwen"`` or ``"plain"`` (:mod:`tether.agents.parsing`); timeout_s: per call;
        tools_kwargs: verl's ``extra_info.tools_kwargs`` of the row: ``{tool: {"create_kwargs": {...}}}``, the
            keyword-only parameters of each tool.
    """

    def __init__(self, tools: list[Tool], *, fmt: str, timeout_s: float | None, tools_kwargs: dict | None = None):
        self.tools = {t.name: t for t in tools}
        self.fmt, self.timeout_s = fmt, timeout_s
        self.tools_kwargs = tools_kwargs or {}

    def reset(self, row: Any) -> None:
        return None

    def step(self, model_turn: str) -> StepResult:
        calls = parse_tool_calls(model_turn, self.fmt)
        if not calls:
            return StepResult(None, None, True)
        outcomes = []
        for call in calls:
            extra = self.tools_kwargs.get(call.name, {})
            extra = extra.get("create_kwargs", {}) if isinstance(extra, dict) else {}
            outcomes.append(run_tool(self.tools.get(call.name), call, timeout_s=self.timeout_s, row_kwargs=extra))
        messages = [{"role": "tool", "content": o.text} for o in outcomes]
        events = {"tool_calls": len(outcomes), "tool_errors": sum(o.error for o in outcomes)}
        return StepResult(messages, None, False, events)
