"""Gemma 4's tool calls (`gemma4`): one block per call, its own notation rather than JSON,

    <|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,metric:true}<tool_call|>

keys bare, strings between `<|"|>` delimiters (nothing escaped inside), numbers, true /
false / null, lists in [...] and objects in {...} as the arguments are. Text before the first
block is content; the calls may be followed by `<|tool_response>` (where the model waits for
the results), nothing else. Each call's arguments become JSON text (the strings quoted, the
bare keys quoted) read as JSON. The markers are special tokens, which a request with tools
keeps in its text (openai_validation.py). A call is sent once whole (the notation is not JSON: no
arguments object grows in a stream); a malformed or unfinished call leaves the whole output
as content."""
from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

from tessera.server.tool_parsers.base import Call, Parsed, PartialCall, held_before, json_text

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
RESPONSE = "<|tool_response>"  # where the model waits for the results (an end-of-turn id)
_NAME = re.compile(r"call:([^{\s]+)\s*")
_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w.\-]*)(\s*:)")


def _as_json(arguments: str) -> str:
    """Gemma's notation as JSON text: each `<|"|>`-delimited string a JSON string, each bare
    key quoted; the rest (numbers, true / false / null, brackets) is JSON already."""
    parts = arguments.split(QUOTE)
    if len(parts) % 2 == 0:
        raise ValueError("an unclosed string")
    if any('"' in part for part in parts[::2]):
        raise ValueError("a JSON string outside Gemma's delimiters")
    return "".join(json.dumps(part, ensure_ascii=False) if i % 2 else _BARE_KEY.sub(r'\1"\2"\3', part)
                   for i, part in enumerate(parts))


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key given twice")
    return dict(pairs)


def _not_a_number(word: str) -> Any:
    raise ValueError(f"{word} is not a value")


def parse_call(block: str) -> Call:
    """`call:NAME{...}` -> (NAME, its arguments as JSON text, numbers as written)."""
    block = block.strip()
    match = _NAME.match(block)
    if match is None:
        raise ValueError("a block that is not call:NAME{...}")
    arguments = json.loads(_as_json(block[match.end():]), parse_float=Decimal, parse_int=Decimal,
                           parse_constant=_not_a_number, object_pairs_hook=_object)
    if not isinstance(arguments, dict):
        raise ValueError("arguments that are not an object")
    return match.group(1), json_text(arguments)


class Gemma4CallParser:
    def parse(self, text: str) -> Parsed:
        start = text.find(OPEN)
        if start < 0:
            return text, None
        calls: list[Call] = []
        rest = text[start:]
        try:
            while rest.strip() and not (calls and rest.lstrip().startswith(RESPONSE)):
                if not rest.lstrip().startswith(OPEN):
                    raise ValueError("text between or after the calls")
                body, closed, rest = rest.lstrip()[len(OPEN):].partition(CLOSE)
                if not closed:
                    raise ValueError("an unclosed call")
                calls.append(parse_call(body))
        except (ValueError, RecursionError):
            return text, None
        content = text[:start].rstrip()
        return (content if content.strip() else None), calls

    def content_end(self, text: str) -> int:
        return held_before(text, OPEN)

    def partial(self, text: str) -> list[PartialCall]:
        return []  # not JSON: calls are sent once whole
