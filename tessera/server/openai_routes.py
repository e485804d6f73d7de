"""OpenAI-compatible routes: /v1/models and /v1/chat/completions here, /v1/completions in
openai_completions.py, streaming in vLLM's chunk order and
serialised like it (absent fields dropped, not null)."""
from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera import __version__
from tessera.engine.outputs import PositionLogprobs
from tessera.multimodal.chat import ContentPartError, template_content
from tessera.multimodal.inputs import MultimodalInputs
from tessera.sampling.params import SamplingParams
from tessera.server.errors import ValidationFailed
from tessera.server.images import prompt_with_images
from tessera.server.openai_common import (FINISH, admit, continuous_usage, state_of, stream_body,
                                          token_label, truncated, usage_of)
from tessera.server.openai_validation import (MAX_LOGPROBS, output_limit, resolve_model, sampling_params,
                                              wire_prompt_logprobs)
from tessera.server.protocol import ChatCompletionRequest, ChatMessage, VllmTokenizeRequest, wire_logprob
from tessera.server.reasoning import (keeps_special_tokens, output_opens_inside,
                                     prompt_closes_reasoning, reasoning_stream, split_reasoning)
from tessera.server.state import ServerState
from tessera.server.tool_calls import ToolCallStream, plan_tool_calls, tool_calls
from tessera.server.tracking import collect, run_request

router = APIRouter(prefix="/v1")
# TGI's chat objects carry one (its text_generation client requires it); vLLM's may
SYSTEM_FINGERPRINT = f"{__version__}-native"


# --- /v1/models ------------------------------------------------------------------------------

@router.get("/models")
async def models(request: Request) -> dict:
    state = state_of(request)
    created = int(time.time())
    # as vLLM lists them: the base model's `root` is what --model named, with no `parent`;
    # LoRA adapters have their folder as `root` and the base model as `parent`
    base = {"id": state.model_name, "object": "model", "created": created, "owned_by": "tessera",
            "root": state.model_root, "parent": None, "max_model_len": state.limits.max_total_tokens}
    adapters = [{**base, "id": adapter.name, "root": adapter.path, "parent": state.model_name}
                for adapter in state.engine.engine.list_loras()]
    return {"object": "list", "data": [base, *adapters]}


# --- /v1/chat/completions ---------------------------------------------------------------------

def chat_logprobs(state: ServerState, ids: list[int], lps: list[PositionLogprobs], top: int,
                   label: Callable[[int], str]) -> dict:
    def entry(t: int, logprob: float) -> dict:
        return {"token": label(t), "logprob": wire_logprob(logprob),
                "bytes": list(state.token_text(t).encode("utf-8"))}

    content = []
    for t, lp in zip(ids, lps):
        item = entry(t, lp[t].logprob)
        ranked = sorted((v.rank, a, v.logprob) for a, v in lp.items() if v.rank is not None and v.rank <= top)
        item["top_logprobs"] = [entry(a, logprob) for _, a, logprob in ranked[:top]]
        content.append(item)
    return {"content": content}


def _template_message(m: ChatMessage, takes_images: bool) -> tuple[dict, list]:
    """A message as chat templates expect it, as vLLM hands it over, and the images it holds:
    content always present ("" for none), text parts joined by newlines (a model that takes
    images gets transformers' text and image parts), tool-call arguments as objects
    (templates write them with `tojson` or iterate them; OpenAI clients send them as JSON
    text)."""
    msg = m.model_dump(exclude_none=True)
    try:
        content, images = template_content(m.content, takes_images)
    except ContentPartError as exc:
        raise ValidationFailed(str(exc), param="messages") from exc
    msg["content"] = content or ""
    for call in msg.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass  # not JSON: the template gets the text as sent
    return msg, images


async def chat_prompt(state: ServerState, body: ChatCompletionRequest | VllmTokenizeRequest,
                      add_special_tokens: bool = False) -> tuple[list[int], str, MultimodalInputs | None]:
    """The prompt's token ids, its rendered text and its images' inputs (if it has any).
    The template writes the special tokens (`add_special_tokens`: add the tokenizer's too)."""
    if not state.chat_template:
        raise ValidationFailed("this model has no chat template; start the server with "
                               "--chat-template FILE", param="messages")
    messages, images = [], []
    for m in body.messages:
        message, found = _template_message(m, state.supports_images)
        messages.append(message)
        images += found
    if not messages:
        raise ValidationFailed("`messages` cannot be empty", param="messages")
    if body.continue_final_message and body.add_generation_prompt:
        raise ValidationFailed("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                               param="continue_final_message")
    try:
        text = state.tokenizer.apply_chat_template(
            messages, chat_template=state.chat_template, tokenize=False,
            add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
            tools=body.tools or None, **template_kwargs(body))
    except Exception as exc:  # a template error names what the template disliked
        raise ValidationFailed(f"chat template error: {exc}", param="messages") from exc
    if images:
        ids, inputs = await prompt_with_images(state, text, images, add_special_tokens=add_special_tokens,
                                               param="messages")
        return ids, text, inputs
    return list(state.tokenizer(text, add_special_tokens=add_special_tokens).input_ids), text, None


def template_kwargs(body: ChatCompletionRequest | VllmTokenizeRequest) -> dict:
    """What the chat template gets beyond the messages and tools: `reasoning_effort` where
    given, then the request's chat_template_kwargs (which win, as vLLM's do)."""
    effort = getattr(body, "reasoning_effort", None)
    return {**({"reasoning_effort": effort} if effort else {}), **(body.chat_template_kwargs or {})}


def plan_reasoning(state: ServerState, params: SamplingParams, prompt_text: str,
                   thinking_token_budget: int | None = None, budget_required: bool = True) -> bool:
    """Under a reasoning parser: whether the output starts inside the reasoning. A
    constrained output (a schema, a tool) of a reasoning model gets its constraint set to
    wait for </think> (Gemma 4's <channel|>), where the tags are tokens (reasoning.py); an
    output the prompt has not opened the reasoning for opens it with <think> (<|channel>)
    first, or is the answer at once. A thinking budget forces that end tag once spent; one
    the server cannot enforce is an error, or (`budget_required` False: Anthropic's
    budget_tokens, which its clients always send) not enforced."""
    opened = output_opens_inside(state.reasoning_parser, prompt_text)
    if keeps_special_tokens(state.reasoning_parser):  # harmony's markers are special tokens
        params.skip_special_tokens = False
    closed = state.reasoning_parser is not None and prompt_closes_reasoning(prompt_text, state.reasoning_parser)
    budget = thinking_token_budget is not None
    if state.reasoning_parser is not None and (params.structured_outputs is not None or budget) and not closed:
        start, end = state.reasoning_tokens(state.reasoning_parser)
        if end is not None and (opened or start is not None):
            params.reasoning_end_token_id = end
            params.reasoning_start_token_id = None if opened else start
    if budget and not closed:  # (a prompt that closes the reasoning leaves none to limit)
        if params.reasoning_end_token_id is not None:
            params.thinking_token_budget = thinking_token_budget
        elif budget_required:
            raise ValidationFailed("thinking_token_budget needs a reasoning parser (--reasoning-parser) whose "
                                   "reasoning tags are tokens of the model", param="thinking_token_budget")
    # a constrained output that cannot reason first is the constraint's from its first token
    return opened and (params.structured_outputs is None or params.reasoning_end_token_id is not None)


@router.post("/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    state = state_of(request)
    served, lora = resolve_model(state, body.model)
    tools = plan_tool_calls(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_call_parser)
    ids, prompt_text, images = await chat_prompt(state, body)
    if images is not None and body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens < len(ids):
        raise ValidationFailed("truncate_prompt_tokens cannot cut a prompt with images", param="truncate_prompt_tokens")
    ids = truncated(ids, body.truncate_prompt_tokens, state.limits.max_input_tokens)
    # vLLM's reply role: the assistant's, or, when no generation prompt opens a new turn,
    # the role of the message being continued
    role = "assistant" if body.add_generation_prompt else body.messages[-1].role
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = output_limit(state, requested, len(ids))
    if body.top_logprobs is not None and not body.logprobs:
        raise ValidationFailed("`top_logprobs` needs `logprobs` to be true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise ValidationFailed(f"`top_logprobs` must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
    top = body.top_logprobs or 0
    params = sampling_params(body, max_tokens, top if body.logprobs else None, tools=tools,
                             defaults=state.sampling_defaults)
    thinks = state.reasoning_parser is not None  # the reply has reasoning fields (null or not)
    opened = plan_reasoning(state, params, prompt_text, body.thinking_token_budget)
    rid, label = f"chatcmpl-{uuid.uuid4().hex}", token_label(state, body)
    created = int(time.time())
    stream = run_request(state, rid, ids, params, lora, body.priority, images)

    if body.stream:
        stream = await admit(request, stream)
        async def chunks() -> AsyncIterator[dict]:
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served,
                    "system_fingerprint": SYSTEM_FINGERPRINT}
            cached = 0 if state.prompt_tokens_details else None  # from the outputs
            usage = {"usage": usage_of(len(ids), 0, cached)} if continuous_usage(body) else {}
            for i in range(body.n):
                yield {**base, "choices": [{"index": i, "delta": {"role": role, "content": ""},
                                            "logprobs": None, "finish_reason": None}], **usage}
            n_out = 0
            ended: set[int] = set()
            calls = {i: ToolCallStream(tools) for i in range(body.n)} if tools is not None else {}
            thinking = {i: reasoning_stream(state.reasoning_parser, opened) for i in range(body.n)} if thinks else {}
            async for out in stream:
                cached = out.num_cached_tokens if cached is not None else None
                for c in out.outputs:
                    if c.index in ended or (not c.delta_token_ids and c.finish_reason is None):
                        continue
                    if c.finish_reason is not None:
                        ended.add(c.index)
                    n_out += len(c.delta_token_ids)
                    logprobs = None
                    if body.logprobs and c.delta_logprobs is not None:
                        logprobs = chat_logprobs(state, c.delta_token_ids, c.delta_logprobs, top, label)
                    finish = FINISH.get(c.finish_reason) if c.finish_reason else None
                    thought, text = "", c.delta_text
                    if thinks:
                        thought, text = thinking[c.index].delta(c.delta_text, final=finish is not None)
                    if tools is not None:
                        delta, finish = calls[c.index].delta(text, finish)
                    else:  # a token with no text yet (held back, part of a character) keeps its logprobs
                        delta = {"content": text} if text or logprobs is not None else {}
                    if thought:
                        delta = {"reasoning_content": thought, "reasoning": thought, **delta}
                    if not delta and finish is None and logprobs is None:
                        continue  # held back: a list of calls shows once complete, a tag once whole
                    if usage:
                        usage = {"usage": usage_of(len(ids), n_out, cached)}
                    yield {**base, "choices": [{"index": c.index, "delta": delta, "logprobs": logprobs,
                                                "finish_reason": finish, "stop_reason": c.stop_reason}], **usage}
            if body.stream_options and body.stream_options.include_usage:
                yield {**base, "choices": [], "usage": usage_of(len(ids), n_out, cached)}

        return StreamingResponse(stream_body(chunks(), stream), media_type="text/event-stream")

    out = await collect(request, stream)
    choices, n_out = [], 0
    for c in out.outputs:
        n_out += len(c.token_ids)
        logprobs = chat_logprobs(state, c.token_ids, c.logprobs, top, label) if body.logprobs and c.logprobs else None
        thought, text = split_reasoning(c.text, opened, state.reasoning_parser) if thinks else (None, c.text)
        message, finish = {"role": role, "content": text}, FINISH.get(c.finish_reason)
        content, made = tool_calls(tools, text or "") if tools is not None else (text, None)
        if made is not None:
            message = {"role": role, "content": content, "tool_calls": made}
            finish = tools.finish_reason if finish == "stop" else finish
        if thinks:
            message.update(reasoning_content=thought, reasoning=thought)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish, "stop_reason": c.stop_reason})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": served,
                         "system_fingerprint": SYSTEM_FINGERPRINT,
                         "choices": choices,
                         "usage": usage_of(len(ids), n_out, out.num_cached_tokens if state.prompt_tokens_details else None),
                         **({"prompt_logprobs": wire_prompt_logprobs(out, state.token_text)} if body.prompt_logprobs is not None else {})})
