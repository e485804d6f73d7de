"""What a Responses request sends back: the `response` object, and, streamed, the events
that build its output items one at a time (response.created ... response.completed):
a reasoning item, a message, a function_call item per call (output_items.py builds them)."""
from __future__ import annotations

import time
from typing import Any, Callable

from tessera.engine.outputs import CompletionOutput
from tessera.server.errors import APIError, openai_error_body
from tessera.server.output_items import OutputItem, OutputItems, named_event
from tessera.server.protocol import ResponsesRequest


def response_status(out: CompletionOutput) -> str:
    return {"length": "incomplete", "abort": "failed"}.get(out.finish_reason, "completed")


def wire_item(item: OutputItem) -> dict:
    done = item.status != "in_progress"
    if item.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": item.text}] if done else []
        return {"type": "reasoning", "id": item.id, "summary": [], "status": item.status, "content": content}
    if item.kind == "text":
        content = [{"type": "output_text", "text": item.text, "annotations": [], "logprobs": item.logprobs}] \
            if done else []
        return {"type": "message", "id": item.id, "status": item.status, "role": "assistant", "content": content}
    return {"type": "function_call", "id": item.id, "call_id": "call_" + item.id[3:27], "name": item.name,
            "arguments": item.text, "status": item.status}


class ResponseWriter(OutputItems):
    """One response: its objects, its output items and the events that make them."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest, n_prompt: int,
                 count_tokens: Callable[[str], int], keep: Callable[[dict], None] | None = None,
                 stored: bool | None = None):
        super().__init__()
        self.id, self.model, self.body, self.n_prompt = rid, model, body, n_prompt
        self.count_tokens = count_tokens  # of the reasoning's text: usage's reasoning_tokens
        self.keep = keep  # takes the finished response (stores it, adds it to its conversation)
        self.stored = keep is not None if stored is None else stored  # what the response says of `store`
        self.created = int(time.time())
        self.sequence = 0

    def event(self, kind: str, **fields) -> str:
        self.sequence += 1
        return named_event(kind, sequence_number=self.sequence - 1, **fields)

    @staticmethod
    def _at(item: OutputItem) -> dict:
        return {"output_index": item.index, "item_id": item.id, "content_index": 0}

    def opened(self, item: OutputItem) -> list[str]:
        events = [self.event("response.output_item.added", output_index=item.index, item=wire_item(item))]
        part = {"text": {"type": "output_text", "text": "", "annotations": []},
                "reasoning": {"type": "reasoning_text", "text": ""}}.get(item.kind)
        if part is not None:
            events.append(self.event("response.content_part.added", **self._at(item), part=part))
        return events

    def grown(self, item: OutputItem, text: str, logprobs: list[dict]) -> list[str]:
        if item.kind == "reasoning":
            return [self.event("response.reasoning_text.delta", **self._at(item), delta=text)]
        if item.kind == "text":
            return [self.event("response.output_text.delta", **self._at(item), delta=text, logprobs=logprobs)]
        return [self.event("response.function_call_arguments.delta", output_index=item.index, item_id=item.id,
                           delta=text)]

    def closed(self, item: OutputItem) -> list[str]:
        at = self._at(item)
        if item.kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **at, text=item.text),
                      self.event("response.content_part.done", **at, part=wire_item(item)["content"][0])]
        elif item.kind == "text":
            part = {"type": "output_text", "text": item.text, "annotations": []}
            events = [self.event("response.output_text.done", **at, text=item.text, logprobs=item.logprobs),
                      self.event("response.content_part.done", **at, part=part)]
        else:
            events = [self.event("response.function_call_arguments.done", output_index=item.index,
                                 item_id=item.id, arguments=item.text)]
        return events + [self.event("response.output_item.done", output_index=item.index, item=wire_item(item))]

    def started(self) -> list[str]:
        return [self.event("response.created", response=self.response(None)),
                self.event("response.in_progress", response=self.response(None))]

    def close_output(self, out: CompletionOutput) -> list[str]:
        return self.finish(response_status(out) == "completed", needs_text=True)

    def ended(self, out: CompletionOutput) -> list[str]:
        done = self.reply(out)
        return [self.event(f"response.{done['status']}", response=done)]

    def failed(self, exc: APIError) -> list[str]:
        """An error event, then the failed response."""
        error = openai_error_body(exc)["error"]
        failed = {**self.response(None), "status": "failed",
                  "error": {"code": "server_error", "message": error["message"]}}
        return [self.event("error", code=error["type"], message=error["message"], param=error["param"]),
                self.event("response.failed", response=failed)]

    def reply(self, out: CompletionOutput) -> dict:
        done = self.response(out)
        if self.keep is not None:
            self.keep(done)
        return done

    def response(self, out: CompletionOutput | None) -> dict:
        """The response object: in progress (`out` None), or done with the items made."""
        b = self.body
        fmt = (b.text or {}).get("format") or {"type": "text"}
        obj: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "in_progress", "error": None, "incomplete_details": None, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "output": [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": b.reasoning, "store": self.stored, "temperature": b.temperature,
            "text": {"format": fmt}, "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [], "top_p": b.top_p, "top_logprobs": b.top_logprobs,
            "truncation": "disabled", "usage": None, "user": b.user, "metadata": b.metadata or {}}
        if b.conversation is not None:  # (validated by the route: an id or {"id": ...})
            obj["conversation"] = {"id": b.conversation["id"] if isinstance(b.conversation, dict) else b.conversation}
        if out is None:
            return obj
        status = response_status(out)
        thought = "".join(item.text for item in self.items if item.kind == "reasoning")
        obj.update(status=status, incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
                   error={"code": "server_error", "message": "the request was aborted"} if status == "failed" else None,
                   output=[wire_item(item) for item in self.items],
                   usage={"input_tokens": self.n_prompt,
                          "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
                          "output_tokens": len(out.token_ids),
                          "output_tokens_details": {"reasoning_tokens": self.count_tokens(thought) if thought else 0},
                          "total_tokens": self.n_prompt + len(out.token_ids)})
        return obj
