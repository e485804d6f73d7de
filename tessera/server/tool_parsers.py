"""Parsers of the tool-call syntax models are trained to write, for tool_choice "auto"
(`tessera serve --tool-call-parser NAME`). Each turns a finished output into its content
and its calls, says how much of a partial output is surely content, so that a stream
can send it as it comes and hold back what may become a call, and (the JSON ones) which
calls a partial output has begun: each name once whole, its arguments object as written
so far, which a stream sends as it grows. A finished call's arguments object is that same
text, as the model wrote it.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen 2.5/3,
  Hermes and many fine-tunes); text before the first block is content; a last block may
  lack its closing tag.
- `llama3_json`: an output that is a JSON object `{"name": ..., "parameters": {...}}` (or
  several separated by `;`), optionally after `<|python_tag|>` (Llama 3.1-3.3's templates);
  an output that starts otherwise is content.
- `mistral`: `[TOOL_CALLS]` and a JSON list of calls, or `name[ARGS]{...}` per call (newer
  Mistral tokenizers); text before it is content.
- `pythonic`: an output that is a Python list of calls, `[f(x=1), g(y="a")]` (Llama 3.2
  and 4), parsed with `ast` (literal values only; nothing is evaluated).
- `openai`: gpt-oss's harmony calls, as `--reasoning-parser openai_gptoss` writes them into
  the content (harmony.py): `<|start|>assistant to=NAME<|message|>{...}<|call|>`.
A malformed call leaves the whole output as content.
"""
from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from tessera.server.harmony import CALL_END, CALL_OPEN, MESSAGE
from tessera.server.json_spans import scan_object

Call = tuple[str, str]  # function name, arguments as JSON text
Parsed = tuple[str | None, list[Call] | None]  # content, calls (None: no calls)


@dataclass
class PartialCall:
    """A call in an output still being written: its name once whole, and its arguments
    object as written so far ("" until it starts, or where they are no object)."""

    name: str | None
    arguments: str
    done: bool  # the arguments are whole


class ToolCallParser(Protocol):
    def parse(self, text: str) -> Parsed: ...

    def content_end(self, text: str) -> int:
        """How many leading characters of a partial output are content whatever follows."""

    def partial(self, text: str) -> list[PartialCall]:
        """The calls a partial output has begun, for a stream to send as they grow (a
        parser that cannot tell returns [] and its calls are sent once whole)."""


def _partial_object_call(text: str, start: int, arguments_key: str) -> tuple[PartialCall, int | None] | None:
    """The call an object opening at text[start] holds so far, and where the object ends
    (None while open); None where the text is no object."""
    try:
        scan = scan_object(text, start)
    except ValueError:
        return None
    name_span = scan.members.get("name")
    name = None
    if name_span is not None and name_span.end is not None:
        value = json.loads(text[name_span.start:name_span.end])
        name = value if isinstance(value, str) else None
    span = scan.members.get(arguments_key) or scan.members.get("arguments")
    if span is None or text[span.start] != "{":  # arguments as a string (or none yet): sent once whole
        return PartialCall(name, "", scan.end is not None), scan.end
    end = span.end if span.end is not None else len(text)
    return PartialCall(name, text[span.start:end], span.end is not None), scan.end


def _content_and_calls(parser: ToolCallParser, text: str, start: int, calls: list[Call]) -> Parsed:
    """A finished output whose calls begin at `start`: the text before them as content
    (None when blank; not lstripped: a stream has sent it as it came) and the calls' arguments
    as written; all content where a stream could not have followed them (_as_written)."""
    written = _as_written(calls, parser.partial(text))
    if not written:
        return text, None
    content = text[:start].rstrip()
    return (content if content.strip() else None), written


def _arguments_object(name: str, text: str) -> PartialCall:
    """A call whose arguments are the object `text` begins with, as written so far (none
    where `text` begins no object: such arguments come whole at the end)."""
    text = text.lstrip()
    try:
        scan = scan_object(text, 0) if text[:1] == "{" else None
    except ValueError:
        scan = None
    if scan is None:
        return PartialCall(name, "", False)
    return PartialCall(name, text[:scan.end if scan.end is not None else len(text)], scan.end is not None)


def _as_written(calls: list[Call], partials: list[PartialCall]) -> list[Call] | None:
    """Finished calls whose arguments objects are given as the model wrote them: the text
    a stream sent as it came (numbers, escapes and spacing as written). None where the
    stream could not follow them (a key given twice, which json reads as the last and a
    stream sent as the first): the output is then malformed, whole as streamed."""
    if len(partials) != len(calls) or any(p.name != name for (name, _), p in zip(calls, partials)):
        return None
    return [(name, p.arguments if p.done and p.arguments else arguments)
            for (name, arguments), p in zip(calls, partials)]


def loads(text: str) -> Any:
    """JSON with its numbers kept as written (Decimal): re-serialised arguments must not turn
    1e999 into Infinity (not JSON) or lose digits (nor hit Python's limit on int digits)."""
    return json.loads(text, parse_float=Decimal, parse_int=Decimal)


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
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                call = None
            if call is None:  # malformed, or a last block cut mid-call (as vLLM: all content)
                return text, None
            calls.append(call)
        return _content_and_calls(self, text, start, calls)

    def content_end(self, text: str) -> int:
        return _held_before(text, self.OPEN)

    def partial(self, text: str) -> list[PartialCall]:
        calls = []
        start = text.find(self.OPEN)
        while start >= 0:
            body = start + len(self.OPEN)
            close = text.find(self.CLOSE, body)
            block = text[body:close if close >= 0 else len(text)]
            first = len(block) - len(block.lstrip())
            found = _partial_object_call(block, first, "arguments") if block.strip() else None
            if found is None:
                break
            calls.append(found[0])
            if close < 0:
                break
            start = text.find(self.OPEN, close + len(self.CLOSE))
        return calls


class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return text, None
        decoder, calls, pos = json.JSONDecoder(parse_float=Decimal, parse_int=Decimal), [], 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                return text, None
            call = _call(obj, "parameters")
            if call is None:
                return text, None
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        calls = _as_written(calls, self.partial(text))
        return (None, calls) if calls else (text, None)

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(self.PYTHON_TAG) \
                or self.PYTHON_TAG.startswith(body):
            return 0  # may be a call: hold it all
        return len(text)

    def partial(self, text: str) -> list[PartialCall]:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        calls, pos = [], 0
        while body[pos:pos + 1] == "{":
            found = _partial_object_call(body, pos, "parameters")
            if found is None:
                break
            calls.append(found[0])
            if found[1] is None:
                break
            pos = found[1]
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return calls


class MistralParser:
    """`[TOOL_CALLS]` then either a JSON list of {"name", "arguments"} objects (Mistral's v3
    tokenizer: Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo) or one `name[ARGS]{...}` per
    call, each after its own `[TOOL_CALLS]` (v11 and later: Mistral Small 3.2, Magistral,
    Devstral). Text before the first `[TOOL_CALLS]` is content."""

    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def parse(self, text: str) -> Parsed:
        start = text.find(self.TAG)
        if start < 0:
            return text, None
        calls: list[Call] = []
        for segment in text[start + len(self.TAG):].split(self.TAG):
            segment = segment.strip()
            try:
                if segment[:1] in ("[", "{"):  # the JSON list (whatever its strings hold)
                    items = loads(segment)
                    calls += [_call(item, "arguments") for item in (items if isinstance(items, list) else [items])]
                else:
                    name, found, arguments = segment.partition(self.ARGS)
                    name = name.partition(self.CALL_ID)[0].strip()  # v13: name[CALL_ID]id[ARGS]
                    arguments = loads(arguments) if found else None
                    calls.append(_call({"name": name, "arguments": arguments}, "arguments")
                                 if isinstance(arguments, dict) else None)
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                return text, None
        if not calls or any(call is None or not call[0] for call in calls):
            return text, None
        return _content_and_calls(self, text, start, calls)

    def content_end(self, text: str) -> int:
        return _held_before(text, self.TAG)

    def partial(self, text: str) -> list[PartialCall]:
        start = text.find(self.TAG)
        calls: list[PartialCall] = []
        if start < 0:
            return calls
        for segment in text[start + len(self.TAG):].split(self.TAG):
            body = segment.strip()
            if body[:1] in ("[", "{"):  # the JSON list (or one object)
                pos = 1 if body[0] == "[" else 0
                while True:
                    while pos < len(body) and body[pos] in " \t\r\n,":
                        pos += 1
                    found = _partial_object_call(body, pos, "arguments") if body[pos:pos + 1] == "{" else None
                    if found is None:
                        break
                    calls.append(found[0])
                    if found[1] is None:
                        return calls
                    pos = found[1]
            elif self.ARGS in body:  # name[ARGS]{...}: the name is whole once [ARGS] came
                name, _, arguments = body.partition(self.ARGS)
                calls.append(_arguments_object(name.partition(self.CALL_ID)[0].strip(), arguments))
                if not calls[-1].done:
                    return calls
            else:
                return calls
        return calls


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
            calls = [self._call(node, body) for node in tree.elts]
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, None
        return None, calls

    @classmethod
    def _call(cls, node: ast.AST, source: str) -> Call:
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


class HarmonyCallParser:
    """Calls in the form harmony.HarmonyStream writes them: the function's name, then its
    arguments object until `<|call|>`. Content is what comes before the first call."""

    def parse(self, text: str) -> Parsed:
        start = text.find(CALL_OPEN)
        if start < 0:
            return text, None
        calls: list[Call] = []
        for block in text[start + len(CALL_OPEN):].split(CALL_OPEN):
            name, found, rest = block.partition(MESSAGE)
            arguments = rest.partition(CALL_END)[0].strip()
            try:
                value = loads(arguments) if found else None
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                value = None
            if not isinstance(value, dict) or not name.strip():
                return text, None
            calls.append((name.strip(), json_text(value)))
        return _content_and_calls(self, text, start, calls)

    def content_end(self, text: str) -> int:
        return _held_before(text, CALL_OPEN)

    def partial(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        start = text.find(CALL_OPEN)
        if start < 0:
            return calls
        for block in text[start + len(CALL_OPEN):].split(CALL_OPEN):
            name, found, rest = block.partition(MESSAGE)
            if not found:  # the name is whole once <|message|> follows it
                return calls
            calls.append(_arguments_object(name.strip(), rest))
            if not calls[-1].done:
                return calls
        return calls


PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(),
                                      "mistral": MistralParser(), "pythonic": PythonicParser(),
                                      "openai": HarmonyCallParser()}
