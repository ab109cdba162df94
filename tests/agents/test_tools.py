"""Tools: schemas from signatures and docstrings, loading errors, tool-call parsing, and every failure of a call
turning into an error observation."""

import textwrap

import pytest

from tether.agents import ToolCall, load_environment, load_tools, parse_tool_calls, resolve_format, run_tool, tool_text
from tether.config import ConfigError, load_config


def _write(tmp_path, body, name="tools.py"):
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return f


def test_a_typed_function_gives_the_openai_tools_schema(tmp_path):
    f = _write(
        tmp_path,
        '''
        from typing import Literal

        def search(query: str, k: int = 3, mode: Literal["fast", "exact"] = "fast", *, index: str) -> str:
            """Search the index.

            Args:
                query: what to look for,
                    over two lines.
                k: how many hits.
                mode: speed or exactness.
                index: set by the row, not the model.
            """
            return query
        ''',
    )
    (tool,) = load_tools([f"{f}:search"])
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the index.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for, over two lines."},
                    "k": {"type": "integer", "description": "how many hits."},
                    "mode": {"type": "string", "enum": ["fast", "exact"], "description": "speed or exactness."},
                },
                "required": ["query"],
            },
        },
    }
    assert tool.params == ("query", "k", "mode") and tool.hidden == ("index",)


@pytest.mark.parametrize(
    "body, message",
    [
        ('def f(x):\n    """Doc."""\n', "agent.tools=.*parameter 'x' of tool 'f' has no type annotation; annotate it"),
        ("def f(x: int):\n    return x\n", "tool 'f' has no docstring"),
        ('def f(*xs: int):\n    """Doc."""\n', r"tool 'f' takes \*xs"),
        ('def f(x: object):\n    """Doc."""\n', "parameter 'x' of tool 'f' is annotated .*object.*no JSON type"),
    ],
)
def test_a_tool_the_model_could_not_call_is_refused_naming_it(tmp_path, body, message):
    f = _write(tmp_path, body)
    with pytest.raises(ValueError, match=message):
        load_tools([f"{f}:f"])


def test_tool_and_environment_specs_are_checked_before_weights_load(tmp_path):
    with pytest.raises(ConfigError, match=r"agent.tools\[0\]='missing.py:f': file 'missing.py' not found"):
        load_config(None, ["agent.tools=[missing.py:f]"])
    with pytest.raises(ConfigError, match="agent.max_turns has no effect without agent.tools"):
        load_config(None, ["agent.max_turns=2"])
    f = _write(tmp_path, 'def f(x: int) -> int:\n    """Doc."""\n    return x\n')
    with pytest.raises(ConfigError, match="agent.tools=.* and agent.environment=.* are both set"):
        load_config(None, [f"agent.tools=[{f}:f]", f"agent.environment={f}:f"])
    cfg = load_config(None, [f"agent.tools=[{f}:f]", "agent.max_turns=2"])
    assert cfg.agent.enabled and cfg.agent.max_turns == 2 and not load_config(None, []).agent.enabled
    with pytest.raises(ValueError, match="agent.tools=.*has no 'g'; it defines: f"):
        load_tools([f"{f}:g"])
    e = _write(tmp_path, "class Env:\n    def reset(self, row):\n        return None\n", "env.py")
    with pytest.raises(ValueError, match="agent.environment=.*class Env has no step method"):
        load_environment(f"{e}:Env")


def test_qwen_and_plain_tool_calls_parse():
    text = (
        'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>{"name": "mul", "arguments": "{\\"a\\": 4}"}</tool_call>'
    )
    assert parse_tool_calls(text, "qwen") == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("mul", {"a": 4})]
    assert parse_tool_calls("no call here", "qwen") == []
    bad = parse_tool_calls("<tool_call>{name: add}</tool_call><tool_call>[1]</tool_call><tool_call>{", "qwen")
    assert [c.error is not None for c in bad] == [True, True, True]
    assert "never closed" in bad[2].error and "not JSON" in bad[0].error
    assert parse_tool_calls('Think.\nCALL add {"a": 1, "b": 2}\n  CALL now\nCALLx y', "plain") == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("now", {}),
    ]
    (bad_plain,) = parse_tool_calls("CALL add [1]", "plain")
    assert bad_plain.error == "the arguments of 'add' must be a JSON object, got list"
    # a bare CALL, or a JSON fragment where the name goes: a malformed call with no name, not a final answer
    no_name = ToolCall(None, {}, "the CALL line has no tool name (CALL name {json})")
    assert parse_tool_calls('CALL\nCALL {"a": 1}\n  CALL  ', "plain") == [no_name, no_name, no_name]
    assert resolve_format("auto", "...<tool_call>...") == "qwen" and resolve_format("auto", None) == "plain"


def test_what_a_tool_may_return():
    assert tool_text("x") == "x" and tool_text(5) == "5" and tool_text(2.5) == "2.5" and tool_text(True) == "True"
    assert tool_text({"a": [1, "é"]}) == '{"a": [1, "é"]}'
    for bad in (None, object(), {"a": object()}):
        with pytest.raises(TypeError):
            tool_text(bad)


def test_every_failing_call_becomes_an_error_observation(tmp_path):
    f = _write(
        tmp_path,
        '''
        import threading
        GATE = threading.Event()

        def add(a: int, b: int) -> int:
            """Add."""
            return a + b

        def boom(x: int) -> str:
            """Raise."""
            raise RuntimeError("no " + str(x))

        def hang() -> str:
            """Hang until released."""
            GATE.wait(30)
            return "late"

        def nothing() -> str:
            """Return None."""

        def secret(q: str, *, answer: str) -> str:
            """Compare with the row's answer."""
            return "yes" if q == answer else "no"
        ''',
    )
    tools = {t.name: t for t in load_tools([f"{f}:{n}" for n in ("add", "boom", "hang", "nothing", "secret")])}
    gate = tools["hang"].fn.__globals__["GATE"]

    def run(name, args, **kw):
        return run_tool(tools.get(name), ToolCall(name, args), timeout_s=kw.pop("timeout_s", 5.0), **kw)

    assert run("add", {"a": 2, "b": 3}) == ("5", False)
    assert run("boom", {"x": 1}) == ("Error: tool 'boom' raised RuntimeError: no 1", True)
    assert run("hang", {}, timeout_s=0.05) == ("Error: tool 'hang' timed out after 0.05 s", True)
    gate.set()
    assert run("nothing", {}) == (
        "Error: tool 'nothing' returned NoneType, not text (return a str, a number, or a JSON-able dict/list)",
        True,
    )
    assert run("mystery", {}) == ("Error: unknown tool 'mystery'", True)
    assert run("add", {"a": 2}) == ("Error: tool 'add' needs b", True)
    assert run("add", {"a": 2, "b": "3"}) == ("Error: argument 'b' of tool 'add' must be integer, got '3'", True)
    assert run("add", {"a": 2, "b": 3, "c": 4}) == ("Error: tool 'add' has no parameter(s) c", True)
    assert run_tool(None, ToolCall(None, {}, "bad JSON"), timeout_s=1) == ("Error: malformed tool call: bad JSON", True)
    assert run("secret", {"q": "7"}, row_kwargs={"answer": "7", "q": "ignored"}) == ("yes", False)


def test_an_unimportable_tool_module_is_named_as_a_tool_not_a_reward_function():
    from tether.rewards.registry import load_spec_attribute

    with pytest.raises(ValueError, match=r"^cannot import module 'tether_no_such_module' for tool 'tether_no_such"):
        load_spec_attribute("tether_no_such_module:add", key="agent.tools", what="tool")
    with pytest.raises(ValueError, match=r"has no attribute 'nope' \(tool 'tether.agents:nope'\)"):
        load_spec_attribute("tether.agents:nope", key="agent.tools", what="tool")


def test_arguments_are_checked_against_the_advertised_enum_item_types_and_null(tmp_path):
    f = _write(
        tmp_path,
        '''
        from typing import Literal

        def pick(
            mode: Literal["a", "b"], ids: list[int], scale: float | None = None, tags: list[str | None] = ()
        ) -> str:
            """Echo the arguments."""
            return f"{mode} {ids} {scale} {list(tags)}"
        ''',
    )
    (tool,) = load_tools([f"{f}:pick"])
    props = tool.schema["function"]["parameters"]["properties"]
    assert props["mode"] == {"type": "string", "enum": ["a", "b"]} and props["scale"] == {"type": "number"}

    def run(args):
        return run_tool(tool, ToolCall("pick", args), timeout_s=5.0)

    assert run({"mode": "b", "ids": [1, 2], "scale": None, "tags": ["x", None]}) == ("b [1, 2] None ['x', None]", False)
    assert run({"mode": "c", "ids": []}) == (
        "Error: argument 'mode' of tool 'pick' must be one of 'a', 'b', got 'c'",
        True,
    )
    assert run({"mode": "a", "ids": [1, "x"]}) == (
        "Error: argument 'ids' of tool 'pick' must be an array whose items are integer (item 1 is 'x'), got [1, 'x']",
        True,
    )
    assert run({"mode": "a", "ids": [1, True]})[1] is True  # a JSON true is not an integer
    assert run({"mode": "a", "ids": [None]}) == (  # null only where the annotation allows it
        "Error: argument 'ids' of tool 'pick' must be an array whose items are integer (item 0 is None), got [None]",
        True,
    )
    assert run({"mode": None, "ids": []}) == ("Error: argument 'mode' of tool 'pick' must be string, got None", True)
    assert run({"mode": "a", "ids": [], "scale": "2"}) == (
        "Error: argument 'scale' of tool 'pick' must be number, got '2'",
        True,
    )
