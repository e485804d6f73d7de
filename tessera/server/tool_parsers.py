"""Parsers of the tool-call syntax models are trained to write, for tool_choice "auto"
(`tessera serve --tool-call-parser NAME`). Each turns a finished output into its content
and its calls, and says how much of a partial output is surely content, so that a stream
can send it as it comes and hold back what may become a call.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen 2.5/3,
  Hermes and many fine-tunes); text before the first block is content; a last block may
  lack its closing tag.
- `llama3_json`: an output that is a JSON object `{"name": ..., "parameters": {...}}` (or
  several separated by `;`), optionally after `<|python_tag|>` (Llama 3.1-3.3's templates);
  an output that starts otherwise is content.
A malformed call leaves the whole output as content.
"""
from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any, Protocol

Call = tuple[str, str]  # function name, arguments as JSON text
Parsed = tuple[str | None, list[Call] | None]  # content, calls (None: no calls)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> Parsed: ...

    def content_end(self, text: str) -> int:
        """How many leading characters of a partial output are content whatever follows."""


def loads(text: str) -> Any:
    """JSON with its numbers kept as written (Decimal): re-serialised arguments must not turn
    1e999 into Infinity (not JSON) or lose digits."""
    return json.loads(text, parse_float=Decimal)


def json_text(value: Any) -> str:
    """`value` (from `loads`) as JSON text, numbers as they were written."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(json_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _call(obj: Any, arguments_key: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return obj["name"], arguments if isinstance(arguments, str) else json_text(arguments)


def _held_before(text: str, tag: str) -> int:
    """The end of the text before `tag`, or before a suffix that may be its beginning;
    trailing whitespace waits for what follows it (before a call it is not content)."""
    end = text.find(tag)
    if end < 0:
        end = len(text)
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-k:]):
                end -= k
                break
    return len(text[:end].rstrip())


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    # a last block may lack its closing tag (the model ended there, or was cut)
    BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        start = text.find(self.OPEN)
        if start < 0:
            return text, None
        calls = []
        for match in self.BLOCK.finditer(text, start):
            try:
                call = _call(loads(match.group(1)), "arguments")
            except (json.JSONDecodeError, RecursionError):
                call = None
            if call is None:  # malformed, or a last block cut mid-call (as vLLM: all content)
                return text, None
            calls.append(call)
        content = text[:start].rstrip()  # not lstripped: a stream has sent it as it came
        return (content if content.strip() else None), (calls or None)

    def content_end(self, text: str) -> int:
        return _held_before(text, self.OPEN)


class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return text, None
        decoder, calls, pos = json.JSONDecoder(parse_float=Decimal), [], 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (json.JSONDecodeError, RecursionError):
                return text, None
            call = _call(obj, "parameters")
            if call is None:
                return text, None
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(self.PYTHON_TAG) \
                or self.PYTHON_TAG.startswith(body):
            return 0  # may be a call: hold it all
        return len(text)


PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}
