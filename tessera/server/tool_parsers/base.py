"""What every tool-call parser shares: the call types, the parser protocol, and helpers that
follow a JSON call as it is written (json_spans.py) and keep a finished call's arguments as
the model wrote them."""
from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

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


def partial_object_call(text: str, start: int, arguments_key: str) -> tuple[PartialCall, int | None] | None:
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


def content_and_calls(parser: ToolCallParser, text: str, start: int, calls: list[Call]) -> Parsed:
    """A finished output whose calls begin at `start`: the text before them as content
    (None when blank; not lstripped: a stream has sent it as it came) and the calls' arguments
    as written; all content where a stream could not have followed them (as_written)."""
    written = as_written(calls, parser.partial(text))
    if not written:
        return text, None
    content = text[:start].rstrip()
    return (content if content.strip() else None), written


def arguments_object(name: str, text: str) -> PartialCall:
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


def as_written(calls: list[Call], partials: list[PartialCall]) -> list[Call] | None:
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


def object_call(obj: Any, arguments_key: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return obj["name"], arguments if isinstance(arguments, str) else json_text(arguments)


def held_before(text: str, tag: str) -> int:
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
