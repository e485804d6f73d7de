"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, streaming in
vLLM's chunk order and serialised like it (absent fields dropped, not null)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera.engine.outputs import PositionLogprobs, RequestOutput
from tessera.server.errors import APIError, ValidationFailed, openai_error_body
from tessera.server.openai_validation import check_length, resolve_model, sampling_params
from tessera.server.protocol import ChatCompletionRequest, CompletionRequest, _OpenAISampling, wire_logprob
from tessera.server.reasoning import (REASONING_PARSERS, ReasoningStream, prompt_closes_reasoning,
                                     prompt_opens_reasoning, split_reasoning)
from tessera.server.state import ServerState
from tessera.server.tool_calls import ToolCallStream, plan_tool_calls, tool_calls
from tessera.server.tracking import collect, run_request

router = APIRouter(prefix="/v1")
logger = logging.getLogger(__name__)

FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length", "abort": "abort"}


def _state(request: Request) -> ServerState:
    return request.app.state.tessera


def _usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def _continuous_usage(body: _OpenAISampling) -> bool:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far
    (with include_usage, as vLLM requires)."""
    options = body.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position. Each
    pump owns (and closes) its stream; on exit the pumps are only cancelled."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
            if not isinstance(exc, asyncio.CancelledError):
                await queue.put((i, exc))
            else:
                raise
        finally:
            await stream.aclose()
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _admitted(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Wait for the engine to accept the request (its first output) before the response
    starts, so that overload and engine-side validation get their HTTP status (429, 400)
    instead of an error chunk inside a 200 stream."""
    first = await stream.__anext__()

    async def rest() -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    return rest()


async def _stream_body(chunks: AsyncIterator[dict], *streams: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """SSE lines of `chunks`; an error ends the stream with an error event (never a cut
    connection), and the request streams are closed either way (an abandoned one would
    hold its in-flight slot until garbage collection)."""
    try:
        async for chunk in chunks:
            yield _sse(chunk)
    except APIError as exc:
        yield _sse(openai_error_body(exc))
    except Exception as exc:  # a bug: say so in the stream's own dialect
        logger.exception("streaming response failed")
        yield _sse(openai_error_body(APIError(f"internal error: {type(exc).__name__}: {exc}")))
    finally:
        for stream in streams:
            await stream.aclose()
    yield _sse("[DONE]")


# --- /v1/models ------------------------------------------------------------------------------

@router.get("/models")
async def models(request: Request) -> dict:
    state = _state(request)
    created = int(time.time())
    base = {"id": state.model_name, "object": "model", "created": created, "owned_by": "tessera",
            "max_model_len": state.limits.max_total_tokens}
    # LoRA adapters as vLLM lists them: their folder as `root`, the base model as `parent`
    adapters = [{**base, "id": adapter.name, "root": adapter.path, "parent": state.model_name}
                for adapter in state.engine.engine.list_loras()]
    return {"object": "list", "data": [base, *adapters]}


# --- /v1/completions --------------------------------------------------------------------------

def _completion_logprobs(state: ServerState, ids: list[int], lps: list[PositionLogprobs | None],
                         offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, lp in zip(ids, lps):
        text = state.token_text(t)
        tokens.append(text)
        token_lps.append(wire_logprob(lp[t].logprob) if lp and t in lp else None)
        tops.append({state.token_text(a): wire_logprob(v.logprob) for a, v in lp.items()} if lp else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _prompts(state: ServerState, prompt) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise ValidationFailed("`prompt` cannot be empty", param="prompt")
    out = []
    for p in prompt:
        ids = list(state.tokenizer(p).input_ids) if isinstance(p, str) else list(p)
        if not ids:
            raise ValidationFailed("`prompt` cannot be empty", param="prompt")
        out.append((p if isinstance(p, str) else None, ids))
    return out


@router.post("/completions")
async def completions(request: Request, body: CompletionRequest) -> Response:
    state = _state(request)
    served, lora = resolve_model(state, body.model)
    if body.suffix is not None:
        raise ValidationFailed("`suffix` is not supported", param="suffix")
    if body.stream and body.best_of not in (None, body.n):
        raise ValidationFailed("`best_of` must equal `n` when streaming", param="best_of")
    prompts = _prompts(state, body.prompt)
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    for _, ids in prompts:
        check_length(state, len(ids), max_tokens)
    params = sampling_params(body, max_tokens, body.logprobs,
                             prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
                             best_of=body.best_of)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = [run_request(state, f"{rid}-{i}", ids, params, lora, body.priority)
               for i, (_, ids) in enumerate(prompts)]
    if body.stream:
        admitted = []
        try:
            for s in streams:
                admitted.append(await _admitted(s))
        except BaseException:
            for s in [*admitted, *streams[len(admitted):]]:
                await s.aclose()
            raise
        streams = admitted
    n_prompt = sum(len(ids) for _, ids in prompts)

    def echo_text(i: int) -> str:
        text, ids = prompts[i]
        return text if text is not None else state.tokenizer.decode(ids)

    if body.stream:
        async def chunks() -> AsyncIterator[dict]:
            n_out = 0
            echoed: set[int] = set()
            ended: set[int] = set()
            async for i, out in _merge(streams):
                for c in out.outputs:
                    if (i, c.index) in ended or (not c.delta_token_ids and c.finish_reason is None):
                        continue
                    if c.finish_reason is not None:
                        ended.add((i, c.index))
                    n_out += len(c.delta_token_ids)
                    index = i * body.n + c.index
                    text = c.delta_text
                    if body.echo and index not in echoed:
                        echoed.add(index)
                        text = echo_text(i) + text
                    logprobs = None
                    if body.logprobs is not None and c.delta_logprobs is not None:
                        logprobs = _completion_logprobs(state, c.delta_token_ids, c.delta_logprobs,
                                                        len(c.text) - len(c.delta_text))
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": served,
                             "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                          "finish_reason": FINISH.get(c.finish_reason) if c.finish_reason else None,
                                          "stop_reason": c.stop_reason}]}
                    if _continuous_usage(body):
                        chunk["usage"] = _usage(n_prompt, n_out)
                    yield chunk
            if body.stream_options and body.stream_options.include_usage:
                yield {"id": rid, "object": "text_completion", "created": created, "model": served,
                       "choices": [], "usage": _usage(n_prompt, n_out)}

        return StreamingResponse(_stream_body(chunks(), *streams), media_type="text/event-stream")

    finals = await asyncio.gather(*(collect(request, s) for s in streams))
    choices, n_out = [], 0
    for i, out in enumerate(finals):
        for c in out.outputs:
            n_out += len(c.token_ids)
            text = (echo_text(i) + c.text) if body.echo else c.text
            logprobs = None
            if body.logprobs is not None and c.logprobs is not None:
                ids, lps = c.token_ids, c.logprobs
                if body.echo and out.prompt_logprobs is not None:
                    ids, lps = out.prompt_token_ids + ids, out.prompt_logprobs + lps
                logprobs = _completion_logprobs(state, ids, lps, 0)
            choices.append({"index": i * body.n + c.index, "text": text, "logprobs": logprobs,
                            "finish_reason": FINISH.get(c.finish_reason), "stop_reason": c.stop_reason})
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": served,
                         "choices": choices, "usage": _usage(n_prompt, n_out)})


# --- /v1/chat/completions ---------------------------------------------------------------------

def _chat_logprobs(state: ServerState, ids: list[int], lps: list[PositionLogprobs], top: int) -> dict:
    def entry(t: int, logprob: float) -> dict:
        text = state.token_text(t)
        return {"token": text, "logprob": wire_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for t, lp in zip(ids, lps):
        item = entry(t, lp[t].logprob)
        ranked = sorted((v.rank, a, v.logprob) for a, v in lp.items() if v.rank is not None and v.rank <= top)
        item["top_logprobs"] = [entry(a, logprob) for _, a, logprob in ranked[:top]]
        content.append(item)
    return {"content": content}


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> tuple[list[int], str]:
    """The prompt's token ids and its rendered text."""
    if not state.chat_template:
        raise ValidationFailed("this model has no chat template; start the server with "
                               "--chat-template FILE", param="messages")
    messages = []
    for m in body.messages:
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):  # content parts: text only
            parts = [p.get("text", "") for p in m.content if p.get("type") == "text"]
            if len(parts) != len(m.content):
                raise ValidationFailed("only text content parts are supported", param="messages")
            msg["content"] = "".join(parts)
        messages.append(msg)
    if not messages:
        raise ValidationFailed("`messages` cannot be empty", param="messages")
    try:
        text = state.tokenizer.apply_chat_template(
            messages, chat_template=state.chat_template, tokenize=False,
            add_generation_prompt=body.add_generation_prompt, tools=body.tools or None,
            **(body.chat_template_kwargs or {}))
    except Exception as exc:  # a template error names what the template disliked
        raise ValidationFailed(f"chat template error: {exc}", param="messages") from exc
    return list(state.tokenizer(text, add_special_tokens=False).input_ids), text


@router.post("/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    state = _state(request)
    served, lora = resolve_model(state, body.model)
    tools = plan_tool_calls(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_call_parser)
    ids, prompt_text = _chat_prompt(state, body)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = requested if requested is not None else max(state.limits.max_total_tokens - len(ids), 1)
    check_length(state, len(ids), max_tokens)
    if body.top_logprobs is not None and not body.logprobs:
        raise ValidationFailed("`top_logprobs` needs `logprobs` to be true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise ValidationFailed("`top_logprobs` must be in [0, 20]", param="top_logprobs")
    top = body.top_logprobs or 0
    params = sampling_params(body, max_tokens, top if body.logprobs else None, tools=tools)
    thinks = state.reasoning_parser is not None  # the reply has reasoning fields (null or not)
    opened = thinks and (REASONING_PARSERS[state.reasoning_parser].always_opened
                         or prompt_opens_reasoning(prompt_text))
    if thinks and params.structured_outputs is not None and not prompt_closes_reasoning(prompt_text):
        # a constrained output (a schema, a tool) of a reasoning model: the constraint waits
        # for </think>, where the tags are tokens (reasoning.py); an output the prompt has
        # not opened the reasoning for opens it with <think> first, or is the answer at once
        start, end = state.think_tokens
        if end is not None and (opened or start is not None):
            params.reasoning_end_token_id = end
            params.reasoning_start_token_id = None if opened else start
    # a constrained output that cannot reason first is the constraint's from its first token
    opened = opened and (params.structured_outputs is None or params.reasoning_end_token_id is not None)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = run_request(state, rid, ids, params, lora, body.priority)

    if body.stream:
        stream = await _admitted(stream)
        async def chunks() -> AsyncIterator[dict]:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served}
            usage = {"usage": _usage(len(ids), 0)} if _continuous_usage(body) else {}
            for i in range(body.n):
                yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], **usage}
            n_out = 0
            ended: set[int] = set()
            calls = {i: ToolCallStream(tools) for i in range(body.n)} if tools is not None else {}
            thinking = {i: ReasoningStream(opened) for i in range(body.n)} if thinks else {}
            async for out in stream:
                for c in out.outputs:
                    if c.index in ended or (not c.delta_token_ids and c.finish_reason is None):
                        continue
                    if c.finish_reason is not None:
                        ended.add(c.index)
                    n_out += len(c.delta_token_ids)
                    if not c.delta_text and c.finish_reason is None:
                        continue  # nothing to show yet (held back for a stop string)
                    logprobs = None
                    if body.logprobs and c.delta_logprobs is not None:
                        logprobs = _chat_logprobs(state, c.delta_token_ids, c.delta_logprobs, top)
                    finish = FINISH.get(c.finish_reason) if c.finish_reason else None
                    thought, text = "", c.delta_text
                    if thinks:
                        thought, text = thinking[c.index].delta(c.delta_text, final=finish is not None)
                    if tools is not None:
                        delta, finish = calls[c.index].delta(text, finish)
                    else:
                        delta = {"content": text} if text else {}
                    if thought:
                        delta = {"reasoning_content": thought, "reasoning": thought, **delta}
                    if not delta and finish is None and logprobs is None:
                        continue  # held back: a list of calls shows once complete, a tag once whole
                    if usage:
                        usage = {"usage": _usage(len(ids), n_out)}
                    yield {**base, "choices": [{"index": c.index, "delta": delta, "logprobs": logprobs,
                                                "finish_reason": finish, "stop_reason": c.stop_reason}], **usage}
            if body.stream_options and body.stream_options.include_usage:
                yield {**base, "choices": [], "usage": _usage(len(ids), n_out)}

        return StreamingResponse(_stream_body(chunks(), stream), media_type="text/event-stream")

    out = await collect(request, stream)
    choices, n_out = [], 0
    for c in out.outputs:
        n_out += len(c.token_ids)
        logprobs = _chat_logprobs(state, c.token_ids, c.logprobs, top) if body.logprobs and c.logprobs else None
        thought, text = split_reasoning(c.text, opened) if thinks else (None, c.text)
        message, finish = {"role": "assistant", "content": text}, FINISH.get(c.finish_reason)
        content, made = tool_calls(tools, text or "") if tools is not None else (text, None)
        if made is not None:
            message = {"role": "assistant", "content": content, "tool_calls": made}
            finish = tools.finish_reason if finish == "stop" else finish
        if thinks:
            message.update(reasoning_content=thought, reasoning=thought)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish, "stop_reason": c.stop_reason})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": served,
                         "choices": choices, "usage": _usage(len(ids), n_out)})
