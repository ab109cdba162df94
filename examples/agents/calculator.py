"""A calculator tool for GSM8K: `agent.tools=[examples/agents/calculator.py:calculator]` (docs/agents.md).

Arithmetic only: numbers, + - * / // % ** and parentheses, parsed with :mod:`ast` (never ``eval``); anything else
raises, which the agent loop turns into an ``Error:`` observation counted in ``agent/tool_errors``.
"""

from __future__ import annotations

import ast
import operator

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers, + - * / // % ** and parentheses, e.g. "16 - 3 - 4".
    """
    x = _value(ast.parse(expression.replace(",", ""), mode="eval").body)
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"
