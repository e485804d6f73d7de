"""The parsers of JSON calls behind a tag: hermes, llama3_json, mistral."""
from __future__ import annotations

import json
import re
from decimal import Decimal

from tessera.server.tool_parsers.base import (Call, Parsed, PartialCall, arguments_object, as_written,
                                              content_and_calls, held_before, loads, object_call,
                                              partial_object_call)


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
                call = object_call(loads(match.group(1)), "arguments")
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                call = None
            if call is None:  # malformed, or a last block cut mid-call (as vLLM: all content)
                return text, None
            calls.append(call)
        return content_and_calls(self, text, start, calls)

    def content_end(self, text: str) -> int:
        return held_before(text, self.OPEN)

    def partial(self, text: str) -> list[PartialCall]:
        calls = []
        start = text.find(self.OPEN)
        while start >= 0:
            body = start + len(self.OPEN)
            close = text.find(self.CLOSE, body)
            block = text[body:close if close >= 0 else len(text)]
            first = len(block) - len(block.lstrip())
            found = partial_object_call(block, first, "arguments") if block.strip() else None
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
            call = object_call(obj, "parameters")
            if call is None:
                return text, None
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        calls = as_written(calls, self.partial(text))
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
            found = partial_object_call(body, pos, "parameters")
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
                    calls += [object_call(item, "arguments") for item in (items if isinstance(items, list) else [items])]
                else:
                    name, found, arguments = segment.partition(self.ARGS)
                    name = name.partition(self.CALL_ID)[0].strip()  # v13: name[CALL_ID]id[ARGS]
                    arguments = loads(arguments) if found else None
                    calls.append(object_call({"name": name, "arguments": arguments}, "arguments")
                                 if isinstance(arguments, dict) else None)
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                return text, None
        if not calls or any(call is None or not call[0] for call in calls):
            return text, None
        return content_and_calls(self, text, start, calls)

    def content_end(self, text: str) -> int:
        return held_before(text, self.TAG)

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
                    found = partial_object_call(body, pos, "arguments") if body[pos:pos + 1] == "{" else None
                    if found is None:
                        break
                    calls.append(found[0])
                    if found[1] is None:
                        return calls
                    pos = found[1]
            elif self.ARGS in body:  # name[ARGS]{...}: the name is whole once [ARGS] came
                name, _, arguments = body.partition(self.ARGS)
                calls.append(arguments_object(name.partition(self.CALL_ID)[0].strip(), arguments))
                if not calls[-1].done:
                    return calls
            else:
                return calls
        return calls
