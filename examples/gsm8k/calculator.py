"""A calculator tool for the GSM8K-style example: arithmetic on numbers, nothing else.

Why an expression walker and not `eval`: the model writes the argument, and `eval` would run
whatever it writes. Only numbers, + - * / // % **, unary signs and parentheses are read;
anything else (names, calls, attributes) is an error the model sees as the tool's reply.

    rollout.multi_turn.tools: [examples/gsm8k/calculator.py:calculator]
"""

from __future__ import annotations

import ast
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # 10 ** 10 ** 10 would take the tool pool's time; a word problem needs no more
MAX_CHARACTERS = 200


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2"
    """
    if len(expression) > MAX_CHARACTERS:
        raise ValueError(f"the expression is longer than {MAX_CHARACTERS} characters")
    value = _value(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
