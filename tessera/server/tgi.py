"""TGI's routes: /generate, /generate_stream, / (compat), /info (/tokenize: tokenize_routes.py)."""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera import __version__
from tessera.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tessera.multimodal.inputs import MultimodalInputs
from tessera.sampling.params import SamplingParams
from tessera.server.errors import APIError
from tessera.server.images import prompt_with_images
from tessera.server.protocol import (CompatGenerateRequest, GenerateParameters, GenerateRequest,
                                     wire_logprob)
from tessera.server.state import ServerState
from tessera.server.tgi_validation import adapter_of, validate_generate
from tessera.server.tracking import collect, run_request

router = APIRouter()

# how TGI's inputs carry images: markdown with an empty alt text
MARKDOWN_IMAGE = re.compile(r"!\[\]\(([^)\s]+)\)")


def _state(request: Request) -> ServerState:
    return request.app.state.tessera


def _token(state: ServerState, token_id: int, lp: PositionLogprobs | None, text: str) -> dict:
    """A generated token; `text` is its share of the output text (TokenTexts)."""
    logprob = lp[token_id].logprob if lp and token_id in lp else None
    return {"id": token_id, "text": text, "logprob": wire_logprob(logprob), "special": token_id in state.special_ids}


def _top_tokens(state: ServerState, chosen: int, lp: PositionLogprobs | None, n: int) -> list[dict]:
    if not lp or not n:
        return []
    alternatives = sorted(((t, v) for t, v in lp.items() if v.rank is not None and v.rank <= n),
                          key=lambda item: item[1].rank)
    return [{"id": t, "text": state.token_text(t), "logprob": wire_logprob(v.logprob), "special": t in state.special_ids}
            for t, v in alternatives[:n]]


def _sequence_details(state: ServerState, c: CompletionOutput, p: GenerateParameters,
                      prefill: list[dict], seed: int | None, prompt_ids: list[int]) -> dict:
    lps = c.logprobs or [None] * len(c.token_ids)
    texts = state.token_texts(prompt_ids)
    last = len(c.token_ids) - 1
    tokens = [_token(state, t, lp, texts.push(t, final=k == last)) for k, (t, lp) in enumerate(zip(c.token_ids, lps))]
    details = {"finish_reason": c.finish_reason, "generated_tokens": len(c.token_ids), "seed": seed,
               "prefill": prefill, "tokens": tokens}
    if p.top_n_tokens:
        details["top_tokens"] = [_top_tokens(state, t, lp, p.top_n_tokens) for t, lp in zip(c.token_ids, lps)]
    return details


def _reported_seed(params: SamplingParams) -> int | None:
    """TGI reports the seed of a sampled request only (a greedy one's seed changed nothing)."""
    return None if params.greedy else params.seed


def _prefill(state: ServerState, out: RequestOutput, p: GenerateParameters) -> list[dict]:
    if not p.decoder_input_details:
        return []
    lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return [{"id": t, "text": state.token_text(t), "logprob": wire_logprob(lp[t].logprob) if lp and t in lp else None}
            for t, lp in zip(out.prompt_token_ids, lps)]


def _headers(state: ServerState, start: float, validated: float, out: RequestOutput, n_in: int,
             n_out: int, inputs: str) -> dict[str, str]:
    """TGI's timing headers: validation, queue (until first scheduled), inference (from then
    to the last token); milliseconds except x-compute-time (seconds)."""
    end = time.monotonic()
    total = end - start
    scheduled = out.metrics.get("first_scheduled_time", validated)
    queue = max(scheduled - out.metrics.get("arrival_time", validated), 0.0)
    inference = max(out.metrics.get("time", end) - scheduled, 0.0)
    return {"x-compute-type": "cpu" if state.engine.engine.device.type == "cpu" else "gpu",
            "x-compute-time": f"{total:.6f}", "x-compute-characters": str(len(inputs)),
            "x-total-time": str(int(total * 1000)),
            "x-validation-time": str(int((validated - start) * 1000)),
            "x-queue-time": str(int(queue * 1000)), "x-inference-time": str(int(inference * 1000)),
            "x-time-per-token": str(int(inference * 1000 / max(n_out, 1))),
            "x-prompt-tokens": str(n_in), "x-generated-tokens": str(n_out)}


async def _generate(request: Request, body: GenerateRequest) -> tuple[dict, dict[str, str]]:
    state = _state(request)
    start = time.monotonic()
    p = body.parameters
    ids, images = await _inputs_with_images(state, body.inputs)
    ids, params = validate_generate(body.inputs, p, state, stream=False, ids=ids)
    validated = time.monotonic()
    out = await collect(request, run_request(state, f"tgi-{uuid.uuid4().hex}", ids, params, adapter_of(p, state),
                                             images=images))
    completions = sorted(out.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))
    best = completions[0]
    prefix = body.inputs if p.return_full_text else ""
    response: dict = {"generated_text": prefix + best.text}
    if p.details or p.decoder_input_details:
        prefill = _prefill(state, out, p)
        details = _sequence_details(state, best, p, prefill, _reported_seed(params), ids)
        if len(completions) > 1:
            details["best_of_sequences"] = [
                {"generated_text": prefix + c.text, **_sequence_details(state, c, p, prefill, _reported_seed(params), ids)}
                for c in completions[1:]]
        response["details"] = details
    return response, _headers(state, start, validated, out, len(ids), len(best.token_ids), body.inputs)


@router.post("/generate")
async def generate(request: Request, body: GenerateRequest) -> Response:
    response, headers = await _generate(request, body)
    return JSONResponse(response, headers=headers)


async def _inputs_with_images(state: ServerState, inputs: str) -> tuple[list[int] | None, MultimodalInputs | None]:
    """TGI's images in `inputs`: markdown `![](url)` (data URLs too), each the model's image
    placeholder in the prompt; (None, None) for a prompt without them, or a model that takes
    none (whose prompt is text as written)."""
    if not state.supports_images or not MARKDOWN_IMAGE.search(inputs):
        return None, None
    sources = [m.group(1) for m in MARKDOWN_IMAGE.finditer(inputs)]
    text = MARKDOWN_IMAGE.sub(lambda _: state.image_placeholder, inputs)
    return await prompt_with_images(state, text, sources, add_special_tokens=True, param="inputs")


async def _stream_events(state: ServerState, body: GenerateRequest, ids: list[int], params,
                         images: MultimodalInputs | None) -> AsyncIterator[str]:
    p = body.parameters
    index = 0
    texts = state.token_texts(ids)
    try:
        async for out in run_request(state, f"tgi-{uuid.uuid4().hex}", ids, params, adapter_of(p, state),
                                     images=images):
            c = out.outputs[0]
            lps = c.delta_logprobs or [None] * len(c.delta_token_ids)
            for k, (token_id, lp) in enumerate(zip(c.delta_token_ids, lps)):
                index += 1
                last = out.finished and k == len(c.delta_token_ids) - 1
                event = {"index": index, "token": _token(state, token_id, lp, texts.push(token_id, final=last)),
                         "top_tokens": _top_tokens(state, token_id, lp, p.top_n_tokens or 0),
                         "generated_text": None, "details": None}
                if last:
                    event["generated_text"] = (body.inputs if p.return_full_text else "") + c.text
                    if p.details:
                        event["details"] = {"finish_reason": c.finish_reason, "generated_tokens": len(c.token_ids),
                                            "seed": _reported_seed(params), "input_length": len(ids)}
                yield f"data:{json.dumps(event)}\n\n"
    except APIError as exc:
        yield f"data:{json.dumps({'error': exc.tgi_message, 'error_type': exc.error_type})}\n\n"


async def _stream_response(request: Request, body: GenerateRequest) -> StreamingResponse:
    state = _state(request)
    ids, images = await _inputs_with_images(state, body.inputs)
    ids, params = validate_generate(body.inputs, body.parameters, state, stream=True, ids=ids)
    headers = {"x-compute-type": "cpu" if state.engine.engine.device.type == "cpu" else "gpu",
               "x-compute-characters": str(len(body.inputs)), "X-Accel-Buffering": "no"}
    return StreamingResponse(_stream_events(state, body, ids, params, images), media_type="text/event-stream",
                             headers=headers)


@router.post("/generate_stream")
async def generate_stream(request: Request, body: GenerateRequest) -> Response:
    return await _stream_response(request, body)


@router.post("/")
@router.post("/invocations")  # TGI's SageMaker route: the same compat request
async def compat_generate(request: Request, body: CompatGenerateRequest) -> Response:
    if body.stream:
        return await _stream_response(request, body)
    response, headers = await _generate(request, body)
    return JSONResponse([response], headers=headers)


@router.get("/info")
async def info(request: Request) -> dict:
    state = _state(request)
    lim = state.limits
    return {"model_id": state.model_name, "model_sha": None, "model_pipeline_tag": state.pipeline_tag,
            "max_concurrent_requests": lim.max_concurrent_requests, "max_best_of": lim.max_best_of,
            "max_stop_sequences": lim.max_stop_sequences, "max_input_tokens": lim.max_input_tokens,
            "max_total_tokens": lim.max_total_tokens, "validation_workers": 1,
            "max_client_batch_size": lim.max_client_batch_size, "router": "tessera",
            "version": __version__, "sha": None, "docker_label": None}
