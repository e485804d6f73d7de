"""The XML tool calls of Qwen3-Coder and Qwen3.5 (`qwen3_coder`, also `qwen3_xml`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text: each becomes the JSON type the tool's schema gives that
parameter (integer, number, boolean, object or array when the text parses as one; a string
otherwise, and for parameters the schema does not type). So the parser is bound to the
request's tools (`for_tools`). A stream sends a call's arguments object one closed
parameter at a time, each piece final: `{"city": "Paris"`, then `, "unit": "celsius"`,
then `}`. A call must close its parameters; a last one may lack `</function>` and
`</tool_call>` (the model ended there). The `<tool_call>` wrapper may be missing."""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from tessera.server.tool_parsers.base import Parsed, PartialCall, as_written, held_before, json_text, loads

TOOL_OPEN, FUNCTION_OPEN = "<tool_call>", "<function="
FUNCTION = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
FUNCTION_CLOSE, PARAMETER_CLOSE = "</function>", "</parameter>"


@dataclass
class _Scanned:
    name: str
    parameters: list[tuple[str, str]] = field(default_factory=list)
    open_parameter: bool = False  # a parameter began and has not closed
    done: bool = False            # </function> seen


class Qwen3XmlParser:
    def __init__(self, functions: dict[str, dict[str, Any]] | None = None):
        self.functions = functions or {}

    def for_tools(self, functions: dict[str, dict[str, Any]]) -> Qwen3XmlParser:
        """This parser, typing values by the request's tools' parameter schemas."""
        return Qwen3XmlParser(functions)

    def parse(self, text: str) -> Parsed:
        start = self._start(text)
        if start < 0:
            return text, None
        scanned = self._scan(text, start)
        if not scanned or any(call.open_parameter or (not call.done and call is not scanned[-1]) for call in scanned):
            return text, None  # malformed, or cut inside a value: all content (as vLLM)
        calls = [(call.name, self._arguments(call, closed=True)) for call in scanned]
        written = as_written(calls, self.partial(text))
        if not written:
            return text, None
        content = text[:start].rstrip()
        return (content if content.strip() else None), written

    def content_end(self, text: str) -> int:
        return min(held_before(text, TOOL_OPEN), held_before(text, FUNCTION_OPEN))

    def partial(self, text: str) -> list[PartialCall]:
        start = self._start(text)
        if start < 0:
            return []
        return [PartialCall(call.name, self._arguments(call, closed=call.done) if call.parameters or call.done else "",
                            call.done) for call in self._scan(text, start)]

    @staticmethod
    def _start(text: str) -> int:
        found = [i for i in (text.find(TOOL_OPEN), text.find(FUNCTION_OPEN)) if i >= 0]
        return min(found) if found else -1

    @staticmethod
    def _scan(text: str, start: int) -> list[_Scanned]:
        calls: list[_Scanned] = []
        position = start
        while (match := FUNCTION.search(text, position)) is not None:
            call = _Scanned(match.group(1).strip())
            calls.append(call)
            close = text.find(FUNCTION_CLOSE, match.end())
            body_end = close if close >= 0 else len(text)
            cursor = match.end()
            while (param := PARAMETER.search(text, cursor, body_end)) is not None:
                end = text.find(PARAMETER_CLOSE, param.end(), body_end)
                if end < 0:
                    call.open_parameter = True
                    break
                call.parameters.append((param.group(1).strip(), _unwrap(text[param.end():end])))
                cursor = end + len(PARAMETER_CLOSE)
            if close < 0:
                break
            call.done = True
            position = close + len(FUNCTION_CLOSE)
        return calls

    def _arguments(self, call: _Scanned, closed: bool) -> str:
        """The arguments object of the closed parameters (and its brace once `closed`)."""
        schema = self.functions.get(call.name, {}).get("properties", {})
        members = [f"{json.dumps(name, ensure_ascii=False)}: {_typed(value, schema.get(name))}"
                   for name, value in call.parameters]
        return "{" + ", ".join(members) + ("}" if closed else "")


def _unwrap(value: str) -> str:
    """A value as written between its tags, less the newline after the opening tag and the
    one before the closing tag."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: Any) -> str:
    """`value` as the JSON the parameter's schema type asks for (a string where it cannot
    be read as one, or where the schema gives no type)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else [k for k in kinds or () if isinstance(k, str)]
    text = value.strip()
    for kind in kinds:
        if kind == "null" and text == "null":
            return "null"
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower()
        if kind in ("integer", "number", "object", "array"):
            parsed = _literal(text)
            if (kind == "integer" and isinstance(parsed, int) and not isinstance(parsed, bool)
                    and "." not in text and "e" not in text.lower()) or \
                    (kind == "number" and isinstance(parsed, (int, float)) and not isinstance(parsed, bool)) or \
                    (kind == "object" and isinstance(parsed, dict)) or (kind == "array" and isinstance(parsed, list)):
                if _is_json(text):  # as written: numbers keep their digits
                    return text if kind in ("integer", "number") else json_text(loads(text))
                try:
                    return json.dumps(parsed, ensure_ascii=False, allow_nan=False)
                except ValueError:  # a Python literal beyond JSON (an infinite float): a string
                    break
    return json.dumps(value, ensure_ascii=False)


def _literal(text: str) -> Any:
    """JSON, else a Python literal (models write {'a': 1} or True in objects too); None."""
    try:
        return json.loads(text, parse_constant=_refuse)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def _is_json(text: str) -> bool:
    """Standard JSON (not the NaN / Infinity json reads)."""
    try:
        json.loads(text, parse_constant=_refuse)
    except ValueError:
        return False
    return True


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")
