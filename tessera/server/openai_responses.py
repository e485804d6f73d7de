"""OpenAI's Responses API, `POST /v1/responses`, for text and image input, text output and
function tools (as the OpenAI Agents SDK, Codex and other newer clients call it; vLLM
serves it too).

A request becomes a chat request (responses_input.py) and runs as /v1/chat/completions
runs: the chat template, images, sampling defaults, a reasoning parser's split, and tool
calls planned as chat plans them (a named function or "required" constrain the output;
"auto" needs the server's --tool-call-parser). The reply is a `response` object whose
output items are built by responses_output.py: a reasoning item (under a reasoning
parser), a message, and a function_call item per call; streamed, the event sequence
response.created ... response.completed. Finished responses are kept in memory
(responses_store.py) unless `store` is false: `previous_response_id` continues one, and
GET / DELETE /v1/responses/{id} fetch or drop it. The message's logprobs come with `include: ["message.output_text.logprobs"]` or
`top_logprobs`, for plain answers (not with tools or a reasoning parser)."""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from tessera.server.chat_items import prepare_chat, respond
from tessera.server.errors import NotFound, ValidationFailed
from tessera.server.openai_common import state_of
from tessera.server.protocol import ResponsesRequest
from tessera.server.responses_input import chat_request, input_items
from tessera.server.responses_output import ResponseWriter
from tessera.server.responses_store import stored_items
from tessera.server.state import ServerState

router = APIRouter(prefix="/v1")


def _conversation(state: ServerState, body: ResponsesRequest) -> list:
    """The input items the response answers: a previous response's conversation and output,
    then this request's input (its instructions are not carried over, as in OpenAI's API)."""
    items = stored_items(input_items(body))
    if body.previous_response_id is None:
        return items
    prior = state.responses.get(body.previous_response_id)
    if prior is None:
        raise ValidationFailed(f"Previous response with id '{body.previous_response_id}' not found: responses "
                               "are kept in memory while the server runs, the oldest dropped beyond "
                               f"{state.responses.capacity} (--responses-store-size), and not with store: false",
                               param="previous_response_id")
    return [*prior.conversation, *prior.response["output"], *items]


@router.post("/responses")
async def responses(request: Request, body: ResponsesRequest):
    state = state_of(request)
    items = _conversation(state, body)
    chat = await prepare_chat(state, chat_request(body, items), logprobs_param="include")
    stores = body.store is not False and state.responses.capacity > 0
    keep = (lambda response: state.responses.put(response, items)) if stores else None
    writer = ResponseWriter(f"resp_{uuid.uuid4().hex}", chat.served, body, len(chat.ids),
                            lambda text: len(state.tokenizer(text, add_special_tokens=False).input_ids), keep)
    return await respond(request, state, chat, writer, body.stream)


def _stored(state: ServerState, rid: str):
    stored = state.responses.get(rid)
    if stored is None:
        raise NotFound(f"Response with id '{rid}' not found (it was not stored, was deleted, or was dropped "
                       "as the oldest beyond --responses-store-size)", param="response_id")
    return stored


@router.get("/responses/{rid}")
async def retrieve(request: Request, rid: str) -> dict:
    return _stored(state_of(request), rid).response


@router.get("/responses/{rid}/input_items")
async def list_input_items(request: Request, rid: str, order: str = "desc", limit: int = 20,
                           after: str | None = None) -> dict:
    """The input items a stored response answered (earlier turns' included), OpenAI's page."""
    if order not in ("asc", "desc"):
        raise ValidationFailed("`order` is asc or desc", param="order")
    if not 1 <= limit <= 100:
        raise ValidationFailed("`limit` must be in [1, 100]", param="limit")
    items = list(_stored(state_of(request), rid).conversation)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise ValidationFailed(f"no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.delete("/responses/{rid}")
async def delete(request: Request, rid: str) -> dict:
    state = state_of(request)
    _stored(state, rid)
    state.responses.delete(rid)
    return {"id": rid, "object": "response", "deleted": True}
