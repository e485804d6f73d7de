"""OpenAI's Responses API, `POST /v1/responses`, for text and image input and text output
(as the OpenAI Agents SDK and other newer clients call it; vLLM serves it too).

A request becomes a chat request: `instructions` the system message, `input` (a string,
or messages whose parts are input_text / input_image / output_text) the conversation,
`max_output_tokens` max_tokens, `text.format` the response_format. It then runs as
/v1/chat/completions runs (the chat template, images, sampling defaults, a reasoning
parser's split). The reply is a `response` object whose output is a message item (after
a reasoning item when the server has a reasoning parser), or, streamed, the event
sequence response.created ... response.completed. What it does not do is refused by name:
tools, stored conversations (`previous_response_id`, `conversation`: nothing is stored, and
`store` is taken but ignored), stored prompts, background runs. Reasoning items sent back
as input (a client replaying a response's output) are skipped, as chat templates drop
earlier turns' reasoning; logprobs are not returned."""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tessera.engine.outputs import CompletionOutput
from tessera.server.errors import APIError, ValidationFailed, openai_error_body
from tessera.server.openai_common import admit, state_of
from tessera.server.openai_routes import chat_prompt, plan_reasoning
from tessera.server.openai_validation import output_limit, resolve_model, sampling_params
from tessera.server.protocol import ChatCompletionRequest, ResponsesRequest
from tessera.server.reasoning import ReasoningStream, split_reasoning
from tessera.server.tracking import collect, run_request

router = APIRouter(prefix="/v1")
logger = logging.getLogger(__name__)

# Responses fields the endpoint refuses, with why
UNSUPPORTED = {"tools": "tools are not supported on /v1/responses yet; /v1/chat/completions takes them",
               "previous_response_id": "responses are not stored: send the whole conversation as `input`",
               "conversation": "conversations are not stored: send the whole conversation as `input`",
               "prompt": "stored prompts are not supported: send the text as `input` or `instructions`",
               "background": "background responses are not supported"}
TEXT_PARTS = ("input_text", "output_text", "text")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request is (validated as one)."""
    for field, why in UNSUPPORTED.items():
        if getattr(body, field) not in (None, [], False):
            raise ValidationFailed(why, param=field)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and item.get("type") == "reasoning"):
            messages.append(_message(item, f"input[{i}]"))
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p}
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValueError as exc:
        raise ValidationFailed(str(exc), param="input") from None


def _message(item: Any, where: str) -> dict:
    if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise ValidationFailed(f"{where}: only messages are taken as input items, got {kind!r}", param="input")
    role = {"developer": "system"}.get(item["role"], item["role"])
    content = item.get("content")
    if isinstance(content, str) or content is None:
        return {"role": role, "content": content or ""}
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ValidationFailed(f"{where}.content[{j}]: parts are input_text, input_image (with an image_url) "
                                   f"or output_text, got {kind!r}", param="input")
    return {"role": role, "content": parts}


def _response_format(fmt: dict) -> dict:
    """Responses' text.format (name and schema beside the type) as chat's response_format."""
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return {"type": fmt.get("type")}


@router.post("/responses")
async def responses(request: Request, body: ResponsesRequest):
    state = state_of(request)
    chat = chat_request(body)
    served, lora = resolve_model(state, chat.model)
    ids, prompt_text, images = await chat_prompt(state, chat)
    params = sampling_params(chat, output_limit(state, chat.max_tokens, len(ids)), None, tools=None,
                             defaults=state.sampling_defaults)
    thinks = state.reasoning_parser is not None
    opened = plan_reasoning(state, params, prompt_text)
    reply = _Reply(f"resp_{uuid.uuid4().hex}", served, body, len(ids),
                   lambda text: len(state.tokenizer(text, add_special_tokens=False).input_ids))
    stream = run_request(state, reply.id, ids, params, lora, 0, images)
    if body.stream:
        stream = await admit(stream)
        return StreamingResponse(reply.events(stream, ReasoningStream(opened) if thinks else None),
                                 media_type="text/event-stream")
    out = (await collect(request, stream)).outputs[0]
    thought, text = split_reasoning(out.text, opened) if thinks else (None, out.text)
    return JSONResponse(reply.response(out, text, thought))


class _Reply:
    """One response's ids and the objects it sends."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest, n_prompt: int,
                 count_tokens: Callable[[str], int]):
        self.id, self.model, self.body, self.n_prompt = rid, model, body, n_prompt
        self.count_tokens = count_tokens  # of the reasoning's text: usage's reasoning_tokens
        self.created = int(time.time())
        self.message_id, self.reasoning_id = f"msg_{uuid.uuid4().hex}", f"rs_{uuid.uuid4().hex}"
        self.sequence = 0

    def message(self, text: str, status: str = "completed") -> dict:
        content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                          "logprobs": []}]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def reasoning(self, thought: str, status: str = "completed") -> dict:
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": thought}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status, "content": content}

    def response(self, out: CompletionOutput | None, text: str = "", thought: str | None = None) -> dict:
        """The response object: in progress (`out` None), or done with `text`."""
        b = self.body
        fmt = (b.text or {}).get("format") or {"type": "text"}
        obj: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "in_progress", "error": None, "incomplete_details": None, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "output": [], "parallel_tool_calls": True,
            "previous_response_id": None, "reasoning": b.reasoning, "store": False, "temperature": b.temperature,
            "text": {"format": fmt}, "tool_choice": "auto", "tools": [], "top_p": b.top_p,
            "truncation": "disabled", "usage": None, "user": b.user, "metadata": b.metadata or {}}
        if out is None:
            return obj
        status = self.status(out)
        obj.update(status=status, incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
                   error={"code": "server_error", "message": "the request was aborted"} if status == "failed" else None,
                   output=[*([self.reasoning(thought)] if thought else []), self.message(text, self.item_status(out))],
                   usage={"input_tokens": self.n_prompt,
                          "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                          "output_tokens": len(out.token_ids),
                          "output_tokens_details": {"reasoning_tokens": self.count_tokens(thought) if thought else 0},
                          "total_tokens": self.n_prompt + len(out.token_ids)})
        return obj

    @staticmethod
    def status(out: CompletionOutput) -> str:
        return {"length": "incomplete", "abort": "failed"}.get(out.finish_reason, "completed")

    def item_status(self, out: CompletionOutput | None) -> str:
        return "completed" if out is None or self.status(out) == "completed" else "incomplete"

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def events(self, stream: AsyncIterator, thinking: ReasoningStream | None) -> AsyncIterator[str]:
        """The streamed events: the reasoning item with its text deltas (under a reasoning
        parser, as the model thinks), then the message item with its text deltas, then the
        finished response."""
        text, thought, index, state = "", "", 0, "start"  # start -> thinking -> answering
        thinking_ids = {"item_id": self.reasoning_id, "content_index": 0}
        ids = {"item_id": self.message_id, "content_index": 0}
        try:
            yield self.event("response.created", response=self.response(None))
            yield self.event("response.in_progress", response=self.response(None))
            out = None
            async for result in stream:
                out = result.outputs[0]
                final = out.finish_reason is not None
                more_thought, delta = thinking.delta(out.delta_text, final) if thinking else ("", out.delta_text)
                if more_thought:
                    if state == "start":
                        yield self.event("response.output_item.added", output_index=0,
                                         item=self.reasoning("", "in_progress"))
                        yield self.event("response.content_part.added", output_index=0, **thinking_ids,
                                         part={"type": "reasoning_text", "text": ""})
                        state = "thinking"
                    thought += more_thought
                    yield self.event("response.reasoning_text.delta", output_index=0, **thinking_ids,
                                     delta=more_thought)
                if state != "answering" and (delta or final):
                    if state == "thinking":
                        part = {"type": "reasoning_text", "text": thought}
                        yield self.event("response.reasoning_text.done", output_index=0, **thinking_ids, text=thought)
                        yield self.event("response.content_part.done", output_index=0, **thinking_ids, part=part)
                        yield self.event("response.output_item.done", output_index=0, item=self.reasoning(thought))
                        index = 1
                    yield self.event("response.output_item.added", output_index=index,
                                     item=self.message("", "in_progress"))
                    yield self.event("response.content_part.added", output_index=index, **ids,
                                     part={"type": "output_text", "text": "", "annotations": []})
                    state = "answering"
                if delta:
                    text += delta
                    yield self.event("response.output_text.delta", output_index=index, **ids, delta=delta, logprobs=[])
            part = {"type": "output_text", "text": text, "annotations": []}
            yield self.event("response.output_text.done", output_index=index, **ids, text=text, logprobs=[])
            yield self.event("response.content_part.done", output_index=index, **ids, part=part)
            yield self.event("response.output_item.done", output_index=index,
                             item=self.message(text, self.item_status(out)))
            done = self.response(out, text, thought or None)
            yield self.event(f"response.{done['status']}", response=done)
        except Exception as exc:  # the stream ends with an error event and a failed response
            if not isinstance(exc, APIError):
                logger.exception("streaming response failed")
                exc = APIError(f"internal error: {type(exc).__name__}: {exc}")
            error = openai_error_body(exc)["error"]
            yield self.event("error", code=error["type"], message=error["message"], param=error["param"])
            failed = {**self.response(None), "status": "failed",
                      "error": {"code": "server_error", "message": error["message"]}}
            yield self.event("response.failed", response=failed)
        finally:
            await stream.aclose()
