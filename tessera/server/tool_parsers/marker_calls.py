"""Parsers of calls written between special-token markers: gpt-oss's harmony calls (as
harmony.py writes them into the content) and DeepSeek's (V3 / R1: `function<｜tool▁sep｜>NAME`
then the arguments in a ```json fence; V3.1 on: `NAME<｜tool▁sep｜>ARGUMENTS`). Each call is
its function's name and then its arguments object; content is what comes before the calls."""
from __future__ import annotations

from abc import ABC, abstractmethod

from tessera.server.harmony import CALL_END, CALL_OPEN, MESSAGE
from tessera.server.tool_parsers.base import (Call, Parsed, PartialCall, arguments_object, content_and_calls,
                                              held_before, json_text, loads)


class MarkedCallParser(ABC):
    """OPEN begins the calls (and ends the content), CALL each call, END its arguments."""

    OPEN = CALL = END = ""

    @abstractmethod
    def name_and_arguments(self, block: str) -> tuple[str | None, str]:
        """A call's name once whole (else None), and its arguments text so far (a stream
        sends it as it grows: only what precedes the object may be cut from it)."""

    def whole_arguments(self, arguments: str) -> str:
        """A finished call's arguments text, ready for JSON."""
        return arguments.strip()

    def _calls(self, text: str, start: int) -> list[tuple[str | None, str]]:
        blocks = text[start + len(self.OPEN):].split(self.CALL)
        if self.OPEN != self.CALL:
            blocks = blocks[1:]  # what precedes the first call's marker
        return [self.name_and_arguments(block.partition(self.END)[0]) for block in blocks]

    def parse(self, text: str) -> Parsed:
        start = text.find(self.OPEN)
        if start < 0:
            return text, None
        calls: list[Call] = []
        for name, arguments in self._calls(text, start):
            try:
                value = loads(self.whole_arguments(arguments))
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                value = None
            if not isinstance(value, dict) or not name:
                return text, None
            calls.append((name, json_text(value)))
        return content_and_calls(self, text, start, calls)

    def content_end(self, text: str) -> int:
        return held_before(text, self.OPEN)

    def partial(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        start = text.find(self.OPEN)
        for name, arguments in self._calls(text, start) if start >= 0 else ():
            if name is None:
                break
            calls.append(arguments_object(name, arguments))
            if not calls[-1].done:
                break
        return calls


class HarmonyCallParser(MarkedCallParser):
    """`<|start|>assistant to=NAME<|message|>{...}<|call|>`, as harmony.HarmonyStream writes it."""

    OPEN = CALL = CALL_OPEN
    END = CALL_END

    def name_and_arguments(self, block: str) -> tuple[str | None, str]:
        name, found, arguments = block.partition(MESSAGE)
        return (name.strip() if found else None), arguments


class DeepSeekCallParser(MarkedCallParser):
    OPEN, CALL, END, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    FENCE = "```"

    def name_and_arguments(self, block: str) -> tuple[str | None, str]:
        head, found, rest = block.partition(self.SEP)
        if not found:
            return None, ""
        if head.strip() != "function":  # V3.1 on: the name, then the arguments
            return head.strip(), rest
        name, newline, arguments = rest.partition("\n")  # V3 / R1: the name's line, then a fence
        if not newline:
            return None, ""
        arguments = arguments.lstrip()
        if arguments.startswith(self.FENCE):
            arguments = arguments[len(self.FENCE):].removeprefix("json").lstrip()
        return name.strip(), arguments

    def whole_arguments(self, arguments: str) -> str:
        return arguments.strip().removesuffix(self.FENCE).strip()
