"""Scores and reranking from an embedding model: vLLM's /score (and /v1/score) and /rerank
(and /v1/rerank, /v2/rerank: Jina's and Cohere's body, `documents`), and Text Embeddings
Inference's /rerank (`texts`), told apart by the body. Every text is embedded once; a pair's
score is the cosine similarity of its two embeddings (pooling/scoring.py)."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tessera.pooling.outputs import PoolingRequestOutput
from tessera.pooling.params import PoolingParams
from tessera.pooling.scoring import PairingError, cosine_scores, pair_indices
from tessera.server.embeddings import embed_all, pooling_params, require_pooling, tei_fit, token_ids
from tessera.server.errors import ValidationFailed
from tessera.server.openai_common import state_of
from tessera.server.openai_validation import resolve_model
from tessera.server.protocol import RerankRequest, ScoreRequest, TEIRerankRequest
from tessera.server.state import ServerState
from tessera.server.tokenize_routes import read_json, validated_body

router = APIRouter()


async def _scores(request: Request, state: ServerState, first: list[list[int]], second: list[list[int]],
                  params: PoolingParams, priority: int = 0) -> tuple[list[float], int]:
    """Each pair's cosine similarity (pair_indices' pairs), and the prompt tokens embedded."""
    try:
        pairs = pair_indices(len(first), len(second))
    except PairingError as exc:
        raise ValidationFailed(str(exc)) from exc
    outs: list[PoolingRequestOutput] = await embed_all(request, state, first + second, params, priority)
    vectors = [out.outputs.data for out in outs]
    return cosine_scores(vectors[:len(first)], vectors[len(first):], pairs), sum(o.num_prompt_tokens for o in outs)


@router.post("/score")
@router.post("/v1/score")
async def score(request: Request, body: ScoreRequest) -> JSONResponse:
    state = state_of(request)
    request.state.openai_errors = True  # vLLM's route: OpenAI's error shape
    require_pooling(state)
    served, _ = resolve_model(state, body.model)
    params = pooling_params(truncate_prompt_tokens=body.truncate_prompt_tokens)
    scores, used = await _scores(request, state, token_ids(state, body.text_1, "text_1"),
                                 token_ids(state, body.text_2, "text_2"), params, body.priority)
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": served,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": {"prompt_tokens": used, "total_tokens": used}})


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request) -> JSONResponse:
    state = state_of(request)
    raw = await read_json(request)
    if request.url.path == "/rerank" and isinstance(raw, dict) and "texts" in raw and "documents" not in raw:
        return await _tei_rerank(request, state, validated_body(raw, TEIRerankRequest))
    request.state.openai_errors = True
    body = validated_body(raw, RerankRequest)
    require_pooling(state)
    served, _ = resolve_model(state, body.model)
    if body.top_n is not None and body.top_n < 0:
        raise ValidationFailed("`top_n` must be >= 0", param="top_n")
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    params = pooling_params(truncate_prompt_tokens=body.truncate_prompt_tokens)
    scores, used = await _scores(request, state, token_ids(state, body.query, "query"),
                                 token_ids(state, documents, "documents"), params, body.priority)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:body.top_n or None]
    results = [{"index": i, **({"document": {"text": documents[i]}} if body.return_documents else {}),
                "relevance_score": scores[i]} for i in order]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": served, "usage": {"total_tokens": used},
                         "results": results})


async def _tei_rerank(request: Request, state: ServerState, body: TEIRerankRequest) -> JSONResponse:
    """TEI's: [{"index", "score", "text"?}], best first; over-long texts as /embed treats them."""
    require_pooling(state)
    query, texts = token_ids(state, body.query, "query"), token_ids(state, body.texts, "texts")
    tei_fit(state, query, "query", body.truncate, body.truncation_direction)
    tei_fit(state, texts, "texts", body.truncate, body.truncation_direction)
    scores, _ = await _scores(request, state, query, texts, PoolingParams())
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    return JSONResponse([{"index": i, "score": scores[i], **({"text": body.texts[i]} if body.return_text else {})}
                         for i in order])
