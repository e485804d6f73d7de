"""One output as a list of items (OpenAI Responses' output items, Anthropic's content
blocks), built from the pieces the chat route makes: reasoning text, answer text and
tool-call deltas in chat's shape (ToolCallStream's, or a finished output's calls). Each
kind of piece opens its item and closes the one before: reasoning, then text, then one
item per call. A subclass renders the opening, growth and closing of an item as its
API's events; fed a whole output at once, the same class builds the whole reply, so a
streamed reply and a whole one hold the same items."""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from tessera.engine.outputs import CompletionOutput
from tessera.server.errors import APIError


def named_event(kind: str, **fields) -> str:
    """One server-sent event named after its type, as both APIs send them."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


@dataclass
class OutputItem:
    """An item being made: its kind, place and text so far."""

    kind: str  # "reasoning", "text" or "call"
    index: int
    id: str
    text: str = ""  # a call's: its arguments (JSON text)
    logprobs: list[dict] = field(default_factory=list)
    name: str = ""  # a call's function
    status: str = "in_progress"  # then "completed" or "incomplete"


class OutputItems(ABC):
    """The items of one output, and the events (rendered by a subclass: ResponseWriter,
    MessageWriter) that make them."""

    ID_PREFIXES = {"reasoning": "rs", "text": "msg", "call": "fc"}

    def __init__(self):
        self.cached_tokens = 0  # prompt tokens the prefix cache held (chat_items sets it)
        self.items: list[OutputItem] = []
        self.calls: dict[int, OutputItem] = {}  # chat's tool-call index -> its item
        self.pending: list[dict] = []  # logprobs of tokens whose text is not out yet (part of a character)

    # --- what a subclass renders ----------------------------------------------------------

    @abstractmethod
    def opened(self, item: OutputItem) -> list[str]:
        """The events that open `item`."""

    @abstractmethod
    def grown(self, item: OutputItem, text: str, logprobs: list[dict]) -> list[str]:
        """The events that add `text` (and its tokens' logprobs) to `item`."""

    @abstractmethod
    def closed(self, item: OutputItem) -> list[str]:
        """The events that close `item` (its status set)."""

    # --- and the reply around the items (chat_items.respond sends them) ---------------------

    id: str  # the reply's id, which the engine's request carries too

    @abstractmethod
    def started(self) -> list[str]:
        """The events before the first item."""

    @abstractmethod
    def close_output(self, out: CompletionOutput) -> list[str]:
        """Close the items once the output has ended (`finish` with the API's rules)."""

    @abstractmethod
    def ended(self, out: CompletionOutput) -> list[str]:
        """The events after the last item."""

    @abstractmethod
    def failed(self, exc: APIError) -> list[str]:
        """The events that end a stream that failed."""

    @abstractmethod
    def reply(self, out: CompletionOutput) -> dict:
        """The whole reply, once the items are closed."""

    # --- the items --------------------------------------------------------------------------

    @property
    def current(self) -> OutputItem | None:
        last = self.items[-1] if self.items else None
        return last if last is not None and last.status == "in_progress" else None

    def _open(self, kind: str, name: str = "") -> list[str]:
        events = self._close("completed")
        self.items.append(OutputItem(kind, len(self.items), f"{self.ID_PREFIXES[kind]}_{uuid.uuid4().hex}",
                                     name=name))
        return events + self.opened(self.items[-1])

    def _close(self, status: str) -> list[str]:
        item = self.current
        if item is None:
            return []
        item.status = "completed" if item.kind == "reasoning" else status
        return self.closed(item)

    def _grow(self, kind: str, text: str, logprobs: list[dict] | None = None) -> list[str]:
        events = self._open(kind) if self.current is None or self.current.kind != kind else []
        item = self.items[-1]
        item.text += text
        item.logprobs += logprobs or []
        return events + self.grown(item, text, logprobs or [])

    def tool_calls(self, calls: list[dict]) -> list[str]:
        """Chat's tool-call deltas: one naming a function opens its item; the rest add arguments."""
        events = []
        for call in calls:
            function = call.get("function") or {}
            if "name" in function:  # the opening events carry the name
                events += self._open("call", function["name"])
                self.calls[call["index"]] = self.items[-1]
            item = self.calls[call["index"]]
            if function.get("arguments"):
                item.text += function["arguments"]
                events += self.grown(item, function["arguments"], [])
        return events

    def delta(self, thought: str, delta: dict, logprobs: list[dict] | None = None) -> list[str]:
        """A step's pieces: reasoning, then answer text (with its tokens' logprobs), then
        tool calls (chat's delta: "content", "tool_calls")."""
        self.pending += logprobs or []
        events = self._grow("reasoning", thought) if thought else []
        if delta.get("content"):
            pending, self.pending = self.pending, []
            events += self._grow("text", delta["content"], pending)
        return events + self.tool_calls(delta.get("tool_calls") or [])

    def finish(self, complete: bool, needs_text: bool) -> list[str]:
        """Close the last item, as complete or cut short. `needs_text`: an output with no
        text and no call still gets an (empty) text item."""
        events = []
        if needs_text and not any(item.kind != "reasoning" for item in self.items):
            events += self._open("text")
        if self.pending and self.current is not None and self.current.kind == "text":
            self.current.logprobs += self.pending
        return events + self._close("completed" if complete else "incomplete")
