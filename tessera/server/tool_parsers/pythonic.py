"""The pythonic parser: an output that is a Python list of calls, read with `ast`."""
from __future__ import annotations

import ast
import math
from decimal import Decimal
from typing import Any

from tessera.server.tool_parsers.base import Call, Parsed, PartialCall, json_text


class PythonicParser:
    """An output that is a Python list of calls with keyword arguments,
    `[get_weather(city="Oslo"), get_time()]` (Llama 3.2 and 4's templates; Llama 4 may wrap
    it in `<|python_start|>` ... `<|python_end|>`); argument values are Python literals
    (strings, numbers, True / False / None, lists, dicts). An output that starts otherwise
    is content."""

    START, END = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        if body.startswith(self.START):
            body = body[len(self.START):].removesuffix(self.END).strip()
        if not body.startswith("["):
            return text, None
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, None
            calls = [self.object_call(node, body) for node in tree.elts]
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, None
        return None, calls

    @classmethod
    def object_call(cls, node: ast.AST, source: str) -> Call:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise ValueError("not a call with keyword arguments")
        names = [k.arg for k in node.keywords]
        if len(set(names)) != len(names):
            raise ValueError("an argument given twice")
        arguments = {k.arg: _python_literal(k.value, source) for k in node.keywords}
        return cls._dotted(node.func), json_text(arguments)

    @classmethod
    def _dotted(cls, node: ast.AST) -> str:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return f"{cls._dotted(node.value)}.{node.attr}"
        raise ValueError("not a function name")

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("[") or body.startswith(self.START) or self.START.startswith(body):
            return 0  # may be a call: hold it all
        return len(text)

    def partial(self, text: str) -> list[PartialCall]:
        return []  # Python syntax, not JSON: its calls are sent once whole


def _python_literal(node: ast.AST, source: str) -> Any:
    """A literal argument value as `loads` would give it (numbers as Decimal, floats from
    their source text, so huge or precise ones survive into the JSON arguments)."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        if isinstance(value, int):
            return Decimal(value)
        if isinstance(value, float) and math.isfinite(value):
            return Decimal(ast.get_source_segment(source, node).replace("_", ""))
        raise ValueError(f"unsupported literal {value!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _python_literal(node.operand, source)
        if not isinstance(value, Decimal):
            raise ValueError("a sign before a non-number")
        return value.copy_negate() if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_python_literal(item, source) for item in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise ValueError("** in a dict")
        keys = [_python_literal(key, source) for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("dict keys must be strings")
        return dict(zip(keys, (_python_literal(value, source) for value in node.values)))
    raise ValueError(f"not a literal: {type(node).__name__}")
