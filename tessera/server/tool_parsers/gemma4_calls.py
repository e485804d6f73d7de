"""Gemma 4's tool calls (`gemma4`): one block per call, its own notation rather than JSON,

    <|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,metric:true}<tool_call|>

keys bare, strings between `<|"|>` delimiters (nothing escaped inside), numbers, true /
false / null, lists in [...] and objects in {...} as the arguments are. Text before the first
block is content; the calls may be followed by `<|tool_response>` (where the model waits for
the results), nothing else. The markers are special tokens, which a request with tools keeps in its
text (openai_validation.py). A call is sent once whole (the notation is not JSON: no
arguments object grows in a stream); a malformed or unfinished call leaves the whole output
as content."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from tessera.server.tool_parsers.base import Call, Parsed, PartialCall, held_before, json_text

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
RESPONSE = "<|tool_response>"  # where the model waits for the results (an end-of-turn id)
_NAME = re.compile(r"call:([^{\s]+)\s*")
_KEY = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*:")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None}


class _Reader:
    """A recursive-descent reader of one arguments value; ValueError where it breaks."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def skip(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def value(self) -> Any:
        self.skip()
        text, at = self.text, self.at
        if text.startswith(QUOTE, at):
            end = text.find(QUOTE, at + len(QUOTE))
            if end < 0:
                raise ValueError("an unclosed string")
            self.at = end + len(QUOTE)
            return text[at + len(QUOTE):end]
        if text.startswith("{", at):
            return self.object()
        if text.startswith("[", at):
            return self.array()
        for word, value in _WORDS.items():
            if text.startswith(word, at):
                self.at += len(word)
                return value
        match = _NUMBER.match(text, at)
        if match is None:
            raise ValueError(f"no value at {text[at:at + 20]!r}")
        self.at = match.end()
        try:
            return Decimal(match.group())
        except InvalidOperation as exc:
            raise ValueError(str(exc)) from exc

    def _items(self, close: str, item) -> None:
        self.at += 1  # the opening bracket
        self.skip()
        if self.text.startswith(close, self.at):
            self.at += 1
            return
        while True:
            item()
            self.skip()
            if self.text.startswith(",", self.at):
                self.at += 1
                continue
            if self.text.startswith(close, self.at):
                self.at += 1
                return
            raise ValueError(f"expected ',' or {close!r}")

    def object(self) -> dict:
        out: dict[str, Any] = {}

        def member() -> None:
            self.skip()
            if self.text.startswith(QUOTE, self.at):  # a key written as a string
                key = self.value()
                self.skip()
                if not self.text.startswith(":", self.at):
                    raise ValueError("a key without ':'")
                self.at += 1
            else:
                match = _KEY.match(self.text, self.at)
                if match is None:
                    raise ValueError("a member without a key")
                key, self.at = match.group(1), match.end()
            if key in out:
                raise ValueError(f"key {key!r} given twice")
            out[key] = self.value()

        self._items("}", member)
        return out

    def array(self) -> list:
        out: list[Any] = []
        self._items("]", lambda: out.append(self.value()))
        return out


def parse_call(block: str) -> Call:
    """`call:NAME{...}` -> (NAME, its arguments as JSON text)."""
    match = _NAME.match(block.strip())
    if match is None:
        raise ValueError("a block that is not call:NAME{...}")
    reader = _Reader(block.strip())
    reader.at = match.end()
    if not reader.text.startswith("{", reader.at):
        raise ValueError("arguments that are not an object")
    arguments = reader.object()
    reader.skip()
    if reader.at != len(reader.text):
        raise ValueError("text after the arguments")
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
