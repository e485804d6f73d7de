"""Scores and reranking: vLLM's /score (and /v1/score) and /rerank (and /v1/rerank,
/v2/rerank: Jina's and Cohere's body, `documents`), Text Embeddings Inference's /rerank
(`texts`), told apart by the body, and vLLM's /classify. An embedding model embeds every
text once and scores a pair by the cosine of its embeddings; a cross-encoder reads each
pair as one prompt (pooling/scoring.py)."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tessera.pooling.outputs import PoolingRequestOutput
from tessera.pooling.params import PoolingParams
from tessera.pooling.scoring import (PairingError, cosine_scores, cross_encoder_prompts, cross_encoder_score,
                                     encode_pair, label_probabilities, pair_indices)
from tessera.server.embeddings import embed_all, pooling_params, require_pooling, tei_fit, token_ids
from tessera.server.errors import ValidationFailed
from tessera.server.openai_common import state_of
from tessera.server.openai_validation import resolve_model
from tessera.server.protocol import ClassifyRequest, PredictRequest, RerankRequest, ScoreRequest, TEIRerankRequest
from tessera.server.state import ServerState
from tessera.server.tokenize_routes import read_json, validated_body

router = APIRouter()


async def _scores(request: Request, state: ServerState, first: list, second: list, params: PoolingParams,
                  priority: int = 0, fields: tuple[str, str] = ("text_1", "text_2"), pair_length: int | None = None,
                  raw: bool = False) -> tuple[list[float], int]:
    """Each pair's score (pair_indices' pairs) and the prompt tokens computed. `first` and
    `second` are texts (or, for an embedding model, token ids too); a cross-encoder cuts a
    pair's second text to `pair_length` tokens (default: the context), `raw`: its logit."""
    require_pooling(state, task=None)
    try:
        pairs = pair_indices(len(first), len(second))
        if state.pooler.task == "classify":
            prompts = cross_encoder_prompts(state.tokenizer, first, second, pairs, state.pooler,
                                            pair_length or state.limits.max_total_tokens)
    except PairingError as exc:
        raise ValidationFailed(str(exc)) from exc
    if state.pooler.task == "classify":
        outs = await embed_all(request, state, prompts, params, priority)
        scores = [float(o.outputs.data[0]) if raw else cross_encoder_score(o.outputs.data, state.pooler) for o in outs]
        return scores, sum(o.num_prompt_tokens for o in outs)
    ids = token_ids(state, first, fields[0]) + token_ids(state, second, fields[1])
    outs: list[PoolingRequestOutput] = await embed_all(request, state, ids, params, priority)
    vectors = [out.outputs.data for out in outs]
    return cosine_scores(vectors[:len(first)], vectors[len(first):], pairs), sum(o.num_prompt_tokens for o in outs)


@router.post("/score")
@router.post("/v1/score")
async def score(request: Request, body: ScoreRequest) -> JSONResponse:
    state = state_of(request)
    request.state.openai_errors = True  # vLLM's route: OpenAI's error shape
    served, _ = resolve_model(state, body.model)
    params, cut = _truncation(state, body.truncate_prompt_tokens)
    scores, used = await _scores(request, state, _listed(body.text_1), _listed(body.text_2), params, body.priority,
                                 pair_length=cut)
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
    served, _ = resolve_model(state, body.model)
    if body.top_n is not None and body.top_n < 0:
        raise ValidationFailed("`top_n` must be >= 0", param="top_n")
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    if not documents:
        raise ValidationFailed("`documents` cannot be empty", param="documents")
    params, cut = _truncation(state, body.truncate_prompt_tokens)
    scores, used = await _scores(request, state, [body.query], documents, params, body.priority,
                                 ("query", "documents"), cut)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:body.top_n or None]
    results = [{"index": i, **({"document": {"text": documents[i]}} if body.return_documents else {}),
                "relevance_score": scores[i]} for i in order]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": served, "usage": {"total_tokens": used},
                         "results": results})


async def _tei_rerank(request: Request, state: ServerState, body: TEIRerankRequest) -> JSONResponse:
    """TEI's: [{"index", "score", "text"?}], best first; over-long texts as /embed treats
    them (a cross-encoder's pair: its text cut to fit with `truncate`, else refused)."""
    require_pooling(state, task=None)
    if not body.texts:
        raise ValidationFailed("`texts` cannot be empty", param="texts")
    if state.pooler.task == "classify":
        scores, _ = await _scores(request, state, [body.query], body.texts, PoolingParams(),
                                  pair_length=None if body.truncate else 10**9, raw=body.raw_scores)
    else:
        query, texts = token_ids(state, body.query, "query"), token_ids(state, body.texts, "texts")
        tei_fit(state, query, "query", body.truncate, body.truncation_direction)
        tei_fit(state, texts, "texts", body.truncate, body.truncation_direction)
        scores, _ = await _scores(request, state, query, texts, PoolingParams())
    order = sorted(range(len(body.texts)), key=lambda i: -scores[i])
    return JSONResponse([{"index": i, "score": scores[i], **({"text": body.texts[i]} if body.return_text else {})}
                         for i in order])


@router.post("/classify")
@router.post("/v1/classify")
async def classify(request: Request, body: ClassifyRequest) -> JSONResponse:
    """A classifier's label probabilities per input (softmax over its labels)."""
    state = state_of(request)
    request.state.openai_errors = True
    require_pooling(state, task="classify")
    served, _ = resolve_model(state, body.model)
    params = pooling_params(truncate_prompt_tokens=body.truncate_prompt_tokens)
    outs = await embed_all(request, state, token_ids(state, body.input, "input", body.add_special_tokens), params,
                           body.priority)
    labels = state.pooler.labels
    data = []
    for i, out in enumerate(outs):
        probs = label_probabilities(out.outputs.data)
        data.append({"index": i, "label": labels[int(probs.argmax())], "probs": probs.tolist(),
                     "num_classes": len(labels)})
    used = sum(o.num_prompt_tokens for o in outs)
    return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": served, "data": data, "usage": {"prompt_tokens": used, "total_tokens": used}})


@router.post("/predict")
async def predict(request: Request, body: PredictRequest) -> JSONResponse:
    """TEI's classifier route: per input, every label with its score, best first (softmax
    over the labels, sigmoid for one label; `raw_scores`: the logits). An input is a text
    or a pair [a, b]; a list of three or more texts, or of pairs, is a batch."""
    state = state_of(request)
    require_pooling(state, task="classify")
    given = body.inputs
    single = isinstance(given, str) or (len(given) == 2 and all(isinstance(t, str) for t in given))
    items = [given] if single else given
    if not items:
        raise ValidationFailed("`inputs` cannot be empty", param="inputs")
    prompts = []
    for item in items:
        if isinstance(item, str):  # over-long: as /embed treats it
            prompt = token_ids(state, item, "inputs")
            tei_fit(state, prompt, "inputs", body.truncate, body.truncation_direction)
            prompts.append(prompt[0])
        elif len(item) == 2:  # a pair: its second text cut to fit with `truncate`
            prompts.append(encode_pair(state.tokenizer, item[0], item[1],
                                       state.limits.max_total_tokens if body.truncate else None,
                                       state.pooler.pair_segments, state.pooler.pair_template))
        else:
            raise ValidationFailed("an input is a text or a pair [a, b]", param="inputs")
    outs = await embed_all(request, state, prompts, PoolingParams())
    labels = state.pooler.labels
    answers = []
    for out in outs:
        logits = out.outputs.data
        scores = logits if body.raw_scores else label_probabilities(logits)
        ranked = sorted(zip(scores.tolist(), labels), key=lambda pair: -pair[0])
        answers.append([{"score": s, "label": label} for s, label in ranked])
    return JSONResponse(answers[0] if single else answers)


def _listed(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else texts


def _truncation(state: ServerState, keep: int | None) -> tuple[PoolingParams, int | None]:
    """vLLM's truncate_prompt_tokens: an embedding model keeps each text's last tokens, a
    cross-encoder cuts each pair's second text to fit."""
    if state.pooling and state.pooler.task == "classify":
        if keep is not None and keep != -1 and keep < 1:
            raise ValidationFailed("`truncate_prompt_tokens` must be -1 or positive", param="truncate_prompt_tokens")
        return PoolingParams(), None if keep in (None, -1) else keep
    return pooling_params(truncate_prompt_tokens=keep), None
