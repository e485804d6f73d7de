"""What a Responses request sends back: the `response` object, and, streamed, the events
that build its output items one at a time (response.created ... response.completed).

The output is made of pieces as the chat route makes them: reasoning text, message text
and tool-call deltas (chat's shape, from ToolCallStream or a finished output's calls).
Each kind of piece opens its item, closing the one before: a reasoning item, a message,
then one function_call item per call. Streamed and whole, the same pieces give the same
items."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from tessera.engine.outputs import CompletionOutput
from tessera.server.protocol import ResponsesRequest


def response_status(out: CompletionOutput) -> str:
    return {"length": "incomplete", "abort": "failed"}.get(out.finish_reason, "completed")


@dataclass
class _Item:
    """An output item being made: its kind, place and text so far."""

    kind: str  # "reasoning", "message" or "function_call"
    index: int
    id: str
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"

    def wire(self) -> dict:
        done = self.status != "in_progress"
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": self.text}] if done else []
            return {"type": "reasoning", "id": self.id, "summary": [], "status": self.status, "content": content}
        if self.kind == "message":
            content = [{"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}] \
                if done else []
            return {"type": "message", "id": self.id, "status": self.status, "role": "assistant", "content": content}
        return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": self.status}


class ResponseWriter:
    """One response: its objects, its output items and the events that make them."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest, n_prompt: int,
                 count_tokens: Callable[[str], int]):
        self.id, self.model, self.body, self.n_prompt = rid, model, body, n_prompt
        self.count_tokens = count_tokens  # of the reasoning's text: usage's reasoning_tokens
        self.created = int(time.time())
        self.sequence = 0
        self.items: list[_Item] = []
        self.calls: dict[int, _Item] = {}  # chat's tool-call index -> its item
        self.pending: list[dict] = []  # logprobs of tokens whose text is not out yet (part of a character)

    # --- events ---------------------------------------------------------------------------

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _open(self, kind: str, prefix: str) -> list[str]:
        """Close the item being made, if any, and open one of `kind`."""
        events = self._close("completed")
        item = _Item(kind, len(self.items), f"{prefix}_{uuid.uuid4().hex}")
        self.items.append(item)
        events.append(self.event("response.output_item.added", output_index=item.index, item=item.wire()))
        part = {"message": {"type": "output_text", "text": "", "annotations": []},
                "reasoning": {"type": "reasoning_text", "text": ""}}.get(kind)
        if part is not None:
            events.append(self.event("response.content_part.added", **self._at(item), part=part))
        return events

    def _at(self, item: _Item) -> dict:
        return {"output_index": item.index, "item_id": item.id, "content_index": 0}

    @property
    def _current(self) -> _Item | None:
        last = self.items[-1] if self.items else None
        return last if last is not None and last.status == "in_progress" else None

    def _close(self, status: str) -> list[str]:
        item = self._current
        if item is None:
            return []
        item.status = "completed" if item.kind == "reasoning" else status
        at = self._at(item)
        if item.kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **at, text=item.text),
                      self.event("response.content_part.done", **at, part=item.wire()["content"][0])]
        elif item.kind == "message":
            part = {"type": "output_text", "text": item.text, "annotations": []}
            events = [self.event("response.output_text.done", **at, text=item.text, logprobs=item.logprobs),
                      self.event("response.content_part.done", **at, part=part)]
        else:
            events = [self.event("response.function_call_arguments.done", output_index=item.index,
                                 item_id=item.id, arguments=item.text)]
        return events + [self.event("response.output_item.done", output_index=item.index, item=item.wire())]

    def reasoning(self, text: str) -> list[str]:
        current = self._current
        events = self._open("reasoning", "rs") if current is None or current.kind != "reasoning" else []
        item = self.items[-1]
        item.text += text
        return events + [self.event("response.reasoning_text.delta", **self._at(item), delta=text)]

    def content(self, text: str) -> list[str]:
        current = self._current
        events = self._open("message", "msg") if current is None or current.kind != "message" else []
        item, logprobs, self.pending = self.items[-1], self.pending, []
        item.text += text
        item.logprobs += logprobs
        return events + [self.event("response.output_text.delta", **self._at(item), delta=text, logprobs=logprobs)]

    def tool_calls(self, calls: list[dict]) -> list[str]:
        """Chat's tool-call deltas: one naming a function opens its item; the rest add arguments."""
        events = []
        for call in calls:
            function = call.get("function") or {}
            if "name" in function:
                events += self._open("function_call", "fc")
                item = self.calls[call["index"]] = self.items[-1]
                item.call_id, item.name = f"call_{uuid.uuid4().hex[:24]}", function["name"]
            item = self.calls[call["index"]]
            arguments = function.get("arguments") or ""
            if arguments:
                item.text += arguments
                events.append(self.event("response.function_call_arguments.delta", output_index=item.index,
                                         item_id=item.id, delta=arguments))
        return events

    def delta(self, thought: str, delta: dict, logprobs: list[dict] | None = None) -> list[str]:
        """A step's pieces: reasoning, then message text (with its tokens' logprobs), then
        tool calls (chat's delta)."""
        self.pending += logprobs or []
        events = self.reasoning(thought) if thought else []
        if delta.get("content"):
            events += self.content(delta["content"])
        return events + self.tool_calls(delta.get("tool_calls") or [])

    def finish(self, out: CompletionOutput) -> list[str]:
        """Close the last item with the output's status; an output with no message and no
        call still has its (empty) message."""
        status = "completed" if response_status(out) == "completed" else "incomplete"
        events = []
        if not any(item.kind != "reasoning" for item in self.items):
            events += self._open("message", "msg")
        if self.pending and self._current is not None and self._current.kind == "message":
            self._current.logprobs += self.pending
        return events + self._close(status)

    # --- the response object ----------------------------------------------------------------

    def response(self, out: CompletionOutput | None) -> dict:
        """The response object: in progress (`out` None), or done with the items made."""
        b = self.body
        fmt = (b.text or {}).get("format") or {"type": "text"}
        obj: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "in_progress", "error": None, "incomplete_details": None, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "output": [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": b.reasoning, "store": False, "temperature": b.temperature,
            "text": {"format": fmt}, "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [], "top_p": b.top_p, "top_logprobs": b.top_logprobs,
            "truncation": "disabled", "usage": None, "user": b.user, "metadata": b.metadata or {}}
        if out is None:
            return obj
        status = response_status(out)
        thought = "".join(item.text for item in self.items if item.kind == "reasoning")
        obj.update(status=status, incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
                   error={"code": "server_error", "message": "the request was aborted"} if status == "failed" else None,
                   output=[item.wire() for item in self.items],
                   usage={"input_tokens": self.n_prompt,
                          "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                          "output_tokens": len(out.token_ids),
                          "output_tokens_details": {"reasoning_tokens": self.count_tokens(thought) if thought else 0},
                          "total_tokens": self.n_prompt + len(out.token_ids)})
        return obj
