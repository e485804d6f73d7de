"""Tokenization routes, TGI's and vLLM's, on one server (as MindIE serves both dialects):

- POST /tokenize: TGI's (`{"inputs"}` -> a list of `{"id", "text", "start", "stop"}`) or
  vLLM's (`{"prompt"}` or chat `{"messages"}` -> `{"count", "max_model_len", "tokens",
  "token_strs"}`), told apart by the body (an object without `inputs` is vLLM's; a body
  that is not JSON, TGI's), and each answering errors in its own shape.
- POST /detokenize (vLLM): `{"tokens"}` -> `{"prompt"}`.
- POST /chat_tokenize (TGI): a chat request -> the template's text and its tokens.

Chat prompts are rendered as /v1/chat/completions renders them (images included: their
tokens count), so a count here is the prompt a chat request would run."""
from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from tessera.server.errors import ValidationFailed
from tessera.server.openai_routes import chat_prompt
from tessera.server.openai_validation import resolve_model
from tessera.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest, VllmTokenizeRequest
from tessera.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.tessera


async def read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body() or b"null")
    except json.JSONDecodeError as exc:
        raise ValidationFailed(f"the body is not JSON: {exc}") from None




def validated_body(raw: Any, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _spans(state: ServerState, text: str, add_special_tokens: bool) -> list[dict]:
    """TGI's tokens: each id with its text and character offsets in `text`."""
    enc = state.tokenizer(text, return_offsets_mapping=True, add_special_tokens=add_special_tokens)
    return [{"id": t, "text": text[a:b], "start": a, "stop": b} for t, (a, b) in zip(enc.input_ids, enc.offset_mapping)]


@router.post("/tokenize")
async def tokenize(request: Request) -> Any:
    state = _state(request)
    raw = await read_json(request)
    if not isinstance(raw, dict) or "inputs" in raw:
        # TGI's: the tokenizer's special tokens included, as its /generate adds them
        return _spans(state, validated_body(raw, TokenizeRequest).inputs, add_special_tokens=True)
    request.state.openai_errors = True
    body = validated_body(raw, VllmTokenizeRequest)
    resolve_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ValidationFailed("give either `prompt` or `messages`", param="prompt")
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(state.tokenizer(body.prompt, add_special_tokens=add).input_ids)
    else:
        ids, _, _ = await chat_prompt(state, body, add_special_tokens=bool(body.add_special_tokens))
    strs = state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.limits.max_total_tokens, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    state = _state(request)
    request.state.openai_errors = True  # vLLM's route: OpenAI's error shape (app.py reads it)
    body = validated_body(await read_json(request), DetokenizeRequest)
    resolve_model(state, body.model)
    vocab = len(state.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ValidationFailed(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}


@router.post("/chat_tokenize")
async def chat_tokenize(request: Request, body: ChatCompletionRequest) -> dict:
    state = _state(request)
    _, text, _ = await chat_prompt(state, body)
    return {"tokenize_response": _spans(state, text, add_special_tokens=False), "templated_text": text}
