"""OpenAI's /v1/completions: prompts as text or token ids (one engine request each), echo,
logprobs with text offsets, best_of, streamed in vLLM's chunk order."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera.engine.outputs import PositionLogprobs
from tessera.server.errors import ValidationFailed
from tessera.server.openai_common import (FINISH, admit, continuous_usage, merge_streams, state_of,
                                          stream_body, token_label, truncated, usage_of)
from tessera.server.openai_validation import (MAX_LOGPROBS, capped_max_tokens, output_limit, resolve_model,
                                              sampling_params, wire_prompt_logprobs)
from tessera.server.protocol import CompletionRequest, wire_logprob
from tessera.server.state import ServerState
from tessera.server.tracking import collect, run_request

router = APIRouter(prefix="/v1")


def _completion_logprobs(state: ServerState, ids: list[int], lps: list[PositionLogprobs | None],
                         offset: int, label: Callable[[int], str]) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, lp in zip(ids, lps):
        tokens.append(label(t))
        token_lps.append(wire_logprob(lp[t].logprob) if lp and t in lp else None)
        tops.append({label(a): wire_logprob(v.logprob) for a, v in lp.items()} if lp else None)
        offsets.append(offset)
        offset += len(state.token_text(t))
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
    state = state_of(request)
    served, lora = resolve_model(state, body.model)
    if body.suffix is not None:
        raise ValidationFailed("`suffix` is not supported", param="suffix")
    if body.stream and body.best_of not in (None, body.n):
        raise ValidationFailed("`best_of` must equal `n` when streaming", param="best_of")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise ValidationFailed(f"`logprobs` must be in [0, {MAX_LOGPROBS}]", param="logprobs")
    prompts = [(text, truncated(ids, body.truncate_prompt_tokens, state.limits.max_input_tokens))
               for text, ids in _prompts(state, body.prompt)]
    if len(prompts) > state.limits.max_concurrent_requests:  # each prompt is a request in flight
        raise ValidationFailed(f"{len(prompts)} prompts in one request exceed the server's "
                               f"--max-concurrent-requests ({state.limits.max_concurrent_requests}); "
                               "send them in smaller batches", param="prompt")
    for _, ids in prompts:  # no max_tokens: the rest of the context, as in vLLM
        output_limit(state, body.max_tokens, len(ids))
    # None: each sequence runs until its context is full (the engine stops every one there)
    max_tokens = capped_max_tokens(state, body.max_tokens)
    params = sampling_params(body, max_tokens, body.logprobs,
                             prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
                             best_of=body.best_of, defaults=state.sampling_defaults)
    rid, label = f"cmpl-{uuid.uuid4().hex}", token_label(state, body)
    created = int(time.time())
    streams = [run_request(state, f"{rid}-{i}", ids, params, lora, body.priority)
               for i, (_, ids) in enumerate(prompts)]
    if body.stream:
        admitted = []
        try:
            for s in streams:
                admitted.append(await admit(request, s))
        except BaseException:
            for s in [*admitted, *streams[len(admitted):]]:
                await s.aclose()
            raise
        streams = admitted
    n_prompt = sum(len(ids) for _, ids in prompts)

    def details(cached: int) -> int | None:  # usage's prompt_tokens_details, when the server gives them
        return cached if state.prompt_tokens_details else None

    def echo_text(i: int) -> str:
        text, ids = prompts[i]
        return text if text is not None else state.tokenizer.decode(ids)

    if body.stream:
        async def chunks() -> AsyncIterator[dict]:
            n_out = 0
            echoed: set[int] = set()
            offsets: dict[int, int] = {}  # a choice's next text_offset
            ended: set[int] = set()
            cached: dict[int, int] = {}  # per prompt: its tokens the prefix cache held
            async for i, out in merge_streams(streams):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    if (i, c.index) in ended or (not c.delta_token_ids and c.finish_reason is None):
                        continue
                    if c.finish_reason is not None:
                        ended.add((i, c.index))
                    n_out += len(c.delta_token_ids)
                    index = i * body.n + c.index
                    text, ids, lps = c.delta_text, c.delta_token_ids, c.delta_logprobs
                    if body.echo and index not in echoed:  # the first chunk carries the prompt
                        echoed.add(index)
                        text = echo_text(i) + text
                        if lps is not None and out.prompt_logprobs is not None:
                            ids, lps = out.prompt_token_ids + ids, out.prompt_logprobs + lps
                    logprobs = None
                    if body.logprobs is not None and lps is not None:
                        # offsets run on over the tokens' texts, as in the full reply
                        logprobs = _completion_logprobs(state, ids, lps, offsets.get(index, 0), label)
                        if ids:
                            offsets[index] = logprobs["text_offset"][-1] + len(state.token_text(ids[-1]))
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": served,
                             "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                          "finish_reason": FINISH.get(c.finish_reason) if c.finish_reason else None,
                                          "stop_reason": c.stop_reason}]}
                    if continuous_usage(body):
                        chunk["usage"] = usage_of(n_prompt, n_out, details(sum(cached.values())))
                    yield chunk
            if body.stream_options and body.stream_options.include_usage:
                yield {"id": rid, "object": "text_completion", "created": created, "model": served,
                       "choices": [], "usage": usage_of(n_prompt, n_out, details(sum(cached.values())))}

        return StreamingResponse(stream_body(chunks(), *streams), media_type="text/event-stream")

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
                logprobs = _completion_logprobs(state, ids, lps, 0, label)
            # with best_of, c.index is the candidate's; choices are numbered 0..n-1 per prompt
            choices.append({"index": len(choices), "text": text, "logprobs": logprobs,
                            "finish_reason": FINISH.get(c.finish_reason), "stop_reason": c.stop_reason,
                            **({"prompt_logprobs": wire_prompt_logprobs(out, state.token_text)}
                               if body.prompt_logprobs is not None else {})})
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": served,
                         "choices": choices,
                         "usage": usage_of(n_prompt, n_out, details(sum(f.num_cached_tokens for f in finals)))})
