"""A chat request run for an API whose reply is a list of items (OpenAI's Responses,
Anthropic's Messages): the request prepared as /v1/chat/completions prepares it (model,
tool plan, prompt, sampling, reasoning), and its output fed to an OutputItems writer,
whole or a step at a time, split as the chat route splits it (a reasoning parser's
reasoning, then the answer, a tool-call parser's calls)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera.engine.outputs import CompletionOutput, RequestOutput
from tessera.multimodal.inputs import MultimodalInputs
from tessera.sampling.params import SamplingParams
from tessera.server.errors import APIError, ValidationFailed
from tessera.server.openai_common import FINISH, admit, token_label
from tessera.server.openai_routes import chat_logprobs, chat_prompt, plan_reasoning
from tessera.server.openai_validation import output_limit, resolve_model, sampling_params
from tessera.server.output_items import OutputItems
from tessera.server.protocol import ChatCompletionRequest
from tessera.server.reasoning import reasoning_stream, split_reasoning
from tessera.server.state import ServerState
from tessera.server.tool_calls import ToolCallStream, ToolPlan, plan_tool_calls, tool_calls
from tessera.server.tracking import collect, run_request

logger = logging.getLogger(__name__)


@dataclass
class PreparedChat:
    """What running a chat request needs, and how its output splits."""

    served: str  # the model name the reply carries
    lora: str | None
    ids: list[int]
    images: MultimodalInputs | None
    params: SamplingParams
    tools: ToolPlan | None
    thinks: str | None  # the server's reasoning parser
    opened: bool  # the output starts inside the reasoning
    logprobs: Callable[[list[int], list | None], list[dict] | None]  # chat's entries, when asked for


async def prepare_chat(state: ServerState, chat: ChatCompletionRequest, logprobs_param: str,
                       fit_context: bool = False) -> PreparedChat:
    """`fit_context`: a max_tokens past the context's room is cut to the room (Anthropic's
    reading of it: a bound the model may stop before), not refused as vLLM refuses it."""
    served, lora = resolve_model(state, chat.model)
    tools = plan_tool_calls(chat.tools, chat.tool_choice, chat.parallel_tool_calls, state.tool_call_parser)
    thinks = state.reasoning_parser
    if chat.logprobs and (tools is not None or thinks):
        # a token's text may be reasoning, a call or the answer: only a plain answer's are given
        raise ValidationFailed("logprobs are given for plain answers only, not with tools or on a server with a "
                               "reasoning parser", param=logprobs_param)
    ids, prompt_text, images = await chat_prompt(state, chat)
    top, label = chat.top_logprobs or 0, token_label(state, chat)
    requested = chat.max_tokens
    if fit_context and requested is not None:
        requested = min(requested, max(state.limits.max_total_tokens - len(ids), 1))
    params = sampling_params(chat, output_limit(state, requested, len(ids)), top if chat.logprobs else None,
                             tools=tools, defaults=state.sampling_defaults)
    # (only the Messages API sets a budget here: its budget_tokens, enforced where it can be)
    opened = plan_reasoning(state, params, prompt_text, chat.thinking_token_budget, budget_required=False)

    def logprobs(token_ids: list[int], lps: list | None) -> list[dict] | None:
        return chat_logprobs(state, token_ids, lps, top, label)["content"] if chat.logprobs and lps else None

    return PreparedChat(served, lora, ids, images, params, tools, thinks, opened, logprobs)


def feed_whole(chat: PreparedChat, out: CompletionOutput, items: OutputItems) -> None:
    """A finished output's items (its events are not sent)."""
    thought, text = split_reasoning(out.text, chat.opened, chat.thinks) if chat.thinks else (None, out.text)
    content, made = tool_calls(chat.tools, text or "") if chat.tools is not None else (text, None)
    calls = [{"index": i, **call} for i, call in enumerate(made or [])]
    items.delta(thought or "", {"content": content, "tool_calls": calls}, chat.logprobs(out.token_ids, out.logprobs))


async def feed_stream(chat: PreparedChat, stream: AsyncIterator[RequestOutput],
                      items: OutputItems) -> AsyncIterator[tuple[CompletionOutput, list[str]]]:
    """Each step's output and the events its pieces make (a parser's calls once whole)."""
    thinking = reasoning_stream(chat.thinks, chat.opened) if chat.thinks else None
    calls = ToolCallStream(chat.tools) if chat.tools is not None else None
    async for result in stream:
        out = result.outputs[0]
        finish = FINISH.get(out.finish_reason) if out.finish_reason else None
        thought, text = thinking.delta(out.delta_text, finish is not None) if thinking else ("", out.delta_text)
        delta = calls.delta(text, finish)[0] if calls is not None else {"content": text}
        yield out, items.delta(thought, delta, chat.logprobs(out.delta_token_ids, out.delta_logprobs))


async def respond(request: Request, state: ServerState, chat: PreparedChat, items: OutputItems,
                  stream: bool) -> Response:
    """Run the request: the whole reply, or its events as they come."""
    outputs = run_request(state, items.id, chat.ids, chat.params, chat.lora, 0, chat.images)
    if stream:
        outputs = await admit(request, outputs)
        return StreamingResponse(_events(chat, outputs, items), media_type="text/event-stream")
    result = await collect(request, outputs)
    out, items.cached_tokens = result.outputs[0], result.num_cached_tokens
    feed_whole(chat, out, items)
    items.close_output(out)
    return JSONResponse(items.reply(out))


async def _events(chat: PreparedChat, outputs: AsyncIterator[RequestOutput], items: OutputItems) -> AsyncIterator[str]:
    try:
        first = await outputs.__anext__()  # (already here: `admit` waited for it)
        items.cached_tokens = first.num_cached_tokens  # the opening events report it
        for event in items.started():
            yield event
        out = None
        async for out, events in feed_stream(chat, _chain(first, outputs), items):
            for event in events:
                yield event
        if out is None:
            raise APIError("the request ended without output")
        for event in items.close_output(out) + items.ended(out):
            yield event
    except Exception as exc:  # the stream ends with the API's error events, never a cut connection
        if not isinstance(exc, APIError):
            logger.exception("streaming reply failed")
            exc = APIError(f"internal error: {type(exc).__name__}: {exc}")
        for event in items.failed(exc):
            yield event
    finally:
        await outputs.aclose()


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for result in rest:
        yield result
