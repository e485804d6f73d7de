"""Embeddings from an embedding model: OpenAI's /v1/embeddings (with vLLM's extras) and Text
Embeddings Inference's /embed. A POST to the server's root is TEI's too when the model pools
(app.py routes it here): huggingface_hub's InferenceClient.feature_extraction posts there.

Every input is one engine request; the engine batches them. Inputs enter the engine through
one server-wide gate of --max-concurrent-requests slots, in arrival order, so large batches
(LangChain sends 1000 texts per call), even several at once, wait for room instead of
failing with 429 part-way."""
from __future__ import annotations

import asyncio
import base64
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tessera.multimodal.inputs import MultimodalInputs
from tessera.pooling.outputs import PoolingRequestOutput
from tessera.pooling.params import PoolingParams, PoolingParamsError
from tessera.pooling.truncation import truncate_ids
from tessera.server.errors import ValidationFailed
from tessera.server.openai_common import state_of
from tessera.server.openai_routes import chat_prompt
from tessera.server.openai_validation import resolve_model
from tessera.server.protocol import EmbeddingInput, EmbeddingRequest, EmbedRequest
from tessera.server.state import ServerState
from tessera.server.tracking import final_output, run_request, until_done

router = APIRouter()

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


def require_pooling(state: ServerState, task: str | None = "embed") -> None:
    """The server's model pools (and, given `task`, does that task: "embed" or "classify")."""
    if not state.pooling:
        raise ValidationFailed("This model does not support the Embeddings API: it generates text. Serve an "
                               "embedding model (a sentence-transformers folder, or any text model with "
                               "--runner pooling)")
    if task is not None and state.pooler.task != task:
        raise ValidationFailed("this model is a classifier (a cross-encoder): POST /classify, /score or /rerank"
                               if state.pooler.task == "classify" else
                               "this model embeds: it has no classification head (POST /v1/embeddings)")


def pooling_params(**kwargs) -> PoolingParams:
    try:
        return PoolingParams(**kwargs)
    except PoolingParamsError as exc:
        raise ValidationFailed(str(exc), param=next(iter(k for k in kwargs if k in str(exc)), None)) from exc


def token_ids(state: ServerState, given: EmbeddingInput, field: str, add_special_tokens: bool = True) -> list[list[int]]:
    """Each input's token ids (texts tokenized here, token ids as given)."""
    items = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else given
    if not items:
        raise ValidationFailed(f"`{field}` cannot be empty", param=field)
    if len(items) > MAX_INPUTS:
        raise ValidationFailed(f"`{field}` holds {len(items)} inputs; at most {MAX_INPUTS} go in one request",
                               param=field)
    out = []
    for item in items:
        ids = (list(state.tokenizer(item, add_special_tokens=add_special_tokens).input_ids)
               if isinstance(item, str) else list(item))
        if not ids:
            raise ValidationFailed(f"`{field}` cannot hold an empty text or token list", param=field)
        out.append(ids)
    return out


async def embed_all(request: Request, state: ServerState, prompts: list[list[int]], params: PoolingParams,
                    priority: int = 0, images: MultimodalInputs | None = None) -> list[PoolingRequestOutput]:
    """The embeddings of `prompts`, in order; a failure (or the client leaving, watched once
    for the whole request) aborts the rest. `images`: the one prompt's (a chat's)."""
    gate = state.pooling_gate
    rid = f"embd-{uuid.uuid4().hex}"

    async def one(i: int, ids: list[int]) -> PoolingRequestOutput:
        async with gate:
            return await final_output(run_request(state, f"{rid}-{i}", ids, params, priority=priority, images=images))

    tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(prompts)]
    try:
        return await until_done(request, asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _encoded(vector, encoding_format: str) -> list[float] | str:
    """The vector as floats, or (base64) its little-endian float32 bytes: what OpenAI's
    clients decode, and the openai SDK asks for by default."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@router.post("/v1/embeddings")
async def embeddings(request: Request, body: EmbeddingRequest) -> JSONResponse:
    state = state_of(request)
    require_pooling(state)
    served, _ = resolve_model(state, body.model)
    params = pooling_params(dimensions=body.dimensions, normalize=body.normalize,
                             truncate_prompt_tokens=body.truncate_prompt_tokens)
    images = None
    if body.messages is not None:  # a conversation (its images too): the chat template writes its special tokens
        ids, _, images = await chat_prompt(state, body, add_special_tokens=bool(body.add_special_tokens))
        prompts = [ids]
    else:
        prompts = token_ids(state, body.input, "input", body.add_special_tokens is not False)
    outputs = await embed_all(request, state, prompts, params, body.priority, images)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(out.outputs.data, body.encoding_format)}
            for i, out in enumerate(outputs)]
    used = sum(out.num_prompt_tokens for out in outputs)
    return JSONResponse({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": served, "data": data, "usage": {"prompt_tokens": used, "total_tokens": used}})


def _with_prompt(state: ServerState, inputs: EmbeddingInput, name: str | None) -> EmbeddingInput:
    """TEI's `prompt_name`: the model's named prompt (config_sentence_transformers.json)
    before each text, as sentence-transformers' encode(prompt_name=...) puts it."""
    if name is None:
        return inputs
    if name not in state.embedding_prompts:
        known = ", ".join(map(repr, state.embedding_prompts)) or "none"
        raise ValidationFailed(f"prompt_name {name!r} is not one of the model's prompts ({known}; "
                               "config_sentence_transformers.json)", param="prompt_name")
    texts = [inputs] if isinstance(inputs, str) else inputs
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValidationFailed("`prompt_name` applies to texts, not token ids", param="prompt_name")
    prompt = state.embedding_prompts[name]
    return [prompt + text for text in texts]


def tei_fit(state: ServerState, prompts: list[list[int]], field: str, truncate: bool | None, direction: str) -> None:
    """TEI's rule for inputs past the context: a 413, or with `truncate` their first tokens
    (`truncation_direction` "Left": their last), the tokenizer's special tokens kept.
    Changes `prompts` in place."""
    limit = state.limits.max_total_tokens
    for i, ids in enumerate(prompts):
        if len(ids) <= limit:
            continue
        if not truncate:
            err = ValidationFailed(f"`{field}` must have at most {limit} tokens. Given: {len(ids)}", param=field)
            err.status = 413
            raise err
        prompts[i] = truncate_ids(state.tokenizer, ids, limit, "left" if direction.lower() == "left" else "right")


@router.post("/embed")
async def embed(request: Request, body: EmbedRequest) -> JSONResponse:
    """TEI's: a list of vectors; over-long inputs are an error (413) unless `truncate`,
    which keeps their first tokens (`truncation_direction` "Left": their last)."""
    state = state_of(request)
    require_pooling(state)
    prompts = token_ids(state, _with_prompt(state, body.inputs, body.prompt_name), "inputs")
    tei_fit(state, prompts, "inputs", body.truncate, body.truncation_direction)
    params = pooling_params(dimensions=body.dimensions, normalize=body.normalize)
    outputs = await embed_all(request, state, prompts, params)
    return JSONResponse([out.outputs.embedding for out in outputs])
