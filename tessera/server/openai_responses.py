"""OpenAI's Responses API, `POST /v1/responses`, for text and image input, text output and
function tools (as the OpenAI Agents SDK, Codex and other newer clients call it; vLLM
serves it too).

A request becomes a chat request (responses_input.py) and runs as /v1/chat/completions
runs: the chat template, images, sampling defaults, a reasoning parser's split, and tool
calls planned as chat plans them (a named function or "required" constrain the output;
"auto" needs the server's --tool-call-parser). The reply is a `response` object whose
output items are built by responses_output.py: a reasoning item (under a reasoning
parser), a message, and a function_call item per call; streamed, the event sequence
response.created ... response.completed. Nothing is stored (`store` is taken and ignored);
the message's logprobs come with `include: ["message.output_text.logprobs"]` or
`top_logprobs`, for plain answers (not with tools or a reasoning parser)."""
from __future__ import annotations

import logging
import uuid
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tessera.server.errors import APIError, ValidationFailed, openai_error_body
from tessera.server.openai_common import FINISH, admit, state_of, token_label
from tessera.server.openai_routes import chat_logprobs, chat_prompt, plan_reasoning
from tessera.server.openai_validation import output_limit, resolve_model, sampling_params
from tessera.server.protocol import ResponsesRequest
from tessera.server.reasoning import ReasoningStream, split_reasoning
from tessera.server.responses_input import chat_request
from tessera.server.responses_output import ResponseWriter
from tessera.server.tool_calls import ToolCallStream, plan_tool_calls, tool_calls
from tessera.server.tracking import collect, run_request

router = APIRouter(prefix="/v1")
logger = logging.getLogger(__name__)


@router.post("/responses")
async def responses(request: Request, body: ResponsesRequest):
    state = state_of(request)
    chat = chat_request(body)
    served, lora = resolve_model(state, chat.model)
    tools = plan_tool_calls(chat.tools, chat.tool_choice, chat.parallel_tool_calls, state.tool_call_parser)
    thinks = state.reasoning_parser is not None
    if chat.logprobs and (tools is not None or thinks):
        # a token's text may be reasoning, a call or the answer: only a plain answer's are given
        raise ValidationFailed("logprobs are given for plain answers only, not with tools or on a server with a "
                               "reasoning parser", param="include")
    ids, prompt_text, images = await chat_prompt(state, chat)
    top = chat.top_logprobs or 0
    params = sampling_params(chat, output_limit(state, chat.max_tokens, len(ids)), top if chat.logprobs else None,
                             tools=tools, defaults=state.sampling_defaults)
    opened = plan_reasoning(state, params, prompt_text)
    writer = ResponseWriter(f"resp_{uuid.uuid4().hex}", served, body, len(ids),
                            lambda text: len(state.tokenizer(text, add_special_tokens=False).input_ids))
    label = token_label(state, chat)

    def logprobs(token_ids: list[int], lps) -> list[dict] | None:
        return chat_logprobs(state, token_ids, lps, top, label)["content"] if chat.logprobs and lps else None

    stream = run_request(state, writer.id, ids, params, lora, 0, images)
    if body.stream:
        stream = await admit(stream)
        return StreamingResponse(_events(writer, stream, ReasoningStream(opened) if thinks else None,
                                         ToolCallStream(tools) if tools is not None else None, logprobs),
                                 media_type="text/event-stream")
    out = (await collect(request, stream)).outputs[0]
    thought, text = split_reasoning(out.text, opened) if thinks else (None, out.text)
    content, made = tool_calls(tools, text or "") if tools is not None else (text, None)
    writer.delta(thought or "", {"content": content, "tool_calls": [{"index": i, **call}
                                                                    for i, call in enumerate(made or [])]},
                 logprobs(out.token_ids, out.logprobs))
    writer.finish_output(out)
    return JSONResponse(writer.response(out))


async def _events(writer: ResponseWriter, stream: AsyncIterator, thinking: ReasoningStream | None,
                  calls: ToolCallStream | None, logprobs: Callable) -> AsyncIterator[str]:
    """The streamed events: each step's reasoning, message text and tool-call pieces as
    they come (a parser's calls once they are whole), then the finished response."""
    try:
        yield writer.event("response.created", response=writer.response(None))
        yield writer.event("response.in_progress", response=writer.response(None))
        out = None
        async for result in stream:
            out = result.outputs[0]
            finish = FINISH.get(out.finish_reason) if out.finish_reason else None
            thought, text = thinking.delta(out.delta_text, finish is not None) if thinking else ("", out.delta_text)
            delta = calls.delta(text, finish)[0] if calls is not None else {"content": text}
            for event in writer.delta(thought, delta, logprobs(out.delta_token_ids, out.delta_logprobs)):
                yield event
        if out is None:
            raise APIError("the request ended without output")
        for event in writer.finish_output(out):
            yield event
        done = writer.response(out)
        yield writer.event(f"response.{done['status']}", response=done)
    except Exception as exc:  # the stream ends with an error event and a failed response
        if not isinstance(exc, APIError):
            logger.exception("streaming response failed")
            exc = APIError(f"internal error: {type(exc).__name__}: {exc}")
        error = openai_error_body(exc)["error"]
        yield writer.event("error", code=error["type"], message=error["message"], param=error["param"])
        failed = {**writer.response(None), "status": "failed",
                  "error": {"code": "server_error", "message": error["message"]}}
        yield writer.event("response.failed", response=failed)
    finally:
        await stream.aclose()
