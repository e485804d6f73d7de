"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, so
that the `anthropic` SDK and tools built on it (pointed here by ANTHROPIC_BASE_URL) run on
a tessera server. The request runs as the chat completion of the same conversation
(anthropic_input.py); the reply is a `message` whose content blocks are a thinking block
(under a reasoning parser), a text block and a tool_use block per call, or, streamed, the
events message_start, content_block_start / _delta / _stop per block, message_delta
(stop_reason, usage) and message_stop. Errors are Anthropic's
`{"type": "error", "error": {"type", "message"}}` (app.py renders them for these paths)."""
from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Request

from tessera.engine.outputs import CompletionOutput
from tessera.server.anthropic_input import MessagesRequest, chat_request
from tessera.server.chat_items import prepare_chat, respond
from tessera.server.errors import APIError, ValidationFailed, anthropic_error_body
from tessera.server.openai_common import state_of
from tessera.server.openai_routes import chat_prompt
from tessera.server.openai_validation import resolve_model
from tessera.server.output_items import OutputItem, OutputItems, named_event
from tessera.server.protocol import ChatCompletionRequest
from tessera.server.state import ServerState
from tessera.server.partial_json import partial_object

router = APIRouter(prefix="/v1")


class MessageWriter(OutputItems):
    """One message: its content blocks and the events that make them."""

    ID_PREFIXES = {"reasoning": "thinking", "text": "text", "call": "toolu"}

    def __init__(self, model: str, n_prompt: int, stop_sequences: list[str] | None, context_bound: bool = False):
        super().__init__()
        self.id, self.model, self.n_prompt = f"msg_{uuid.uuid4().hex}", model, n_prompt
        self.stop_sequences = stop_sequences or []
        self.context_bound = context_bound  # the context's room, not max_tokens, bounds the output

    event = staticmethod(named_event)

    def opened(self, item: OutputItem) -> list[str]:
        block = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""},
                 "text": {"type": "text", "text": ""}}.get(item.kind)
        if block is None:
            block = {"type": "tool_use", "id": item.id, "name": item.name, "input": {}}
        return [self.event("content_block_start", index=item.index, content_block=block)]

    def grown(self, item: OutputItem, text: str, logprobs: list[dict]) -> list[str]:
        delta = {"reasoning": {"type": "thinking_delta", "thinking": text},
                 "text": {"type": "text_delta", "text": text}}.get(item.kind)
        return [self.event("content_block_delta", index=item.index,
                           delta=delta or {"type": "input_json_delta", "partial_json": text})]

    def closed(self, item: OutputItem) -> list[str]:
        return [self.event("content_block_stop", index=item.index)]

    def _block(self, item: OutputItem) -> dict:
        if item.kind == "reasoning":
            return {"type": "thinking", "thinking": item.text, "signature": ""}
        if item.kind == "call":
            # arguments cut short (max_tokens, a stop sequence) give what the SDK reads from
            # the same stream: their complete members
            try:
                arguments = json.loads(item.text)
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                arguments = partial_object(item.text)
            return {"type": "tool_use", "id": item.id, "name": item.name, "input": arguments}
        return {"type": "text", "text": item.text}

    def stop(self, out: CompletionOutput) -> dict:
        """stop_reason and stop_sequence, as Anthropic says them."""
        if out.finish_reason == "length":
            reason = "model_context_window_exceeded" if self.context_bound else "max_tokens"
            return {"stop_reason": reason, "stop_sequence": None}
        if out.finish_reason == "stop_sequence" and out.stop_reason in self.stop_sequences:
            return {"stop_reason": "stop_sequence", "stop_sequence": out.stop_reason}
        if any(item.kind == "call" for item in self.items):
            return {"stop_reason": "tool_use", "stop_sequence": None}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def started(self) -> list[str]:
        return [self.event("message_start", message=self.message(None))]

    def close_output(self, out: CompletionOutput) -> list[str]:
        return self.finish(complete=out.finish_reason != "length", needs_text=False)

    def ended(self, out: CompletionOutput) -> list[str]:
        return [self.event("message_delta", delta=self.stop(out), usage={"output_tokens": len(out.token_ids)}),
                self.event("message_stop")]

    def failed(self, exc: APIError) -> list[str]:
        return [self.event("error", error=anthropic_error_body(exc)["error"])]

    def reply(self, out: CompletionOutput) -> dict:
        return self.message(out)

    def message(self, out: CompletionOutput | None) -> dict:
        """The message: as it starts (`out` None), or done with its blocks."""
        # Anthropic counts the prompt as input_tokens + cache reads (+ cache writes, which
        # prefix caching does not charge for: 0)
        usage = {"input_tokens": self.n_prompt - self.cached_tokens,
                 "output_tokens": 0 if out is None else len(out.token_ids),
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": self.cached_tokens}
        stop = {"stop_reason": None, "stop_sequence": None} if out is None else self.stop(out)
        content = [] if out is None else [self._block(item) for item in self.items]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                **stop, "usage": usage}


def _chat_request(state: ServerState, body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request, with what the chat route would refuse in its words said in Anthropic's."""
    chat = chat_request(body)
    auto = body.tool_choice is None or body.tool_choice.get("type") == "auto"
    if body.tools and auto and state.tool_call_parser is None:
        raise ValidationFailed("tool_choice auto (the default with tools) needs a parser of the model's own "
                               "tool-call syntax: start the server with --tool-call-parser (hermes for Qwen and "
                               "Hermes models, llama3_json, mistral, pythonic), or send tool_choice "
                               "{\"type\": \"any\"} or {\"type\": \"tool\", \"name\": ...}", param="tool_choice")
    return chat


@router.post("/messages")
async def messages(request: Request, body: MessagesRequest):
    state = state_of(request)
    if body.max_tokens is None:
        raise ValidationFailed("max_tokens: Field required", param="max_tokens")
    if body.max_tokens < 1:  # 0 warms Anthropic's prompt cache; here prefix caching needs no warming
        raise ValidationFailed("max_tokens: must be at least 1", param="max_tokens")
    chat = await prepare_chat(state, _chat_request(state, body), logprobs_param="messages", fit_context=True)
    writer = MessageWriter(chat.served, len(chat.ids), body.stop_sequences,
                           context_bound=body.max_tokens > state.limits.max_total_tokens - len(chat.ids))
    return await respond(request, state, chat, writer, body.stream)


@router.post("/messages/count_tokens")
async def count_tokens(request: Request, body: MessagesRequest) -> dict:
    """The prompt's tokens, as a /v1/messages request of the same body would run it."""
    state = state_of(request)
    resolve_model(state, body.model)
    ids, _, _ = await chat_prompt(state, _chat_request(state, body))
    return {"input_tokens": len(ids)}
