"""The worked example's calculator tool (examples/agents/calculator.py, docs/agents.md): its schema, its answers,
and what it refuses (an error observation, counted)."""

from pathlib import Path

from tether.agents import ToolCall, load_tools, run_tool

CALC = Path(__file__).resolve().parents[2] / "examples" / "agents" / "calculator.py"


def test_the_calculator_tool_computes_and_refuses_what_is_not_arithmetic():
    (tool,) = load_tools([f"{CALC}:calculator"])
    assert tool.schema["function"]["parameters"]["required"] == ["expression"]

    def call(expr):
        return run_tool(tool, ToolCall("calculator", {"expression": expr}), timeout_s=2.0)

    assert call("16 - 3 - 4") == ("9", False)
    assert call("9 * 2") == ("18", False)
    assert call("(1,000 + 500) / 4") == ("375", False)
    assert call("7 / 2") == ("3.5", False)
    assert call("-2 ** 3") == ("-8", False)
    for bad in ("__import__('os')", "2 ** 1000", "x + 1"):
        text, error = call(bad)
        assert error and text.startswith("Error:")
