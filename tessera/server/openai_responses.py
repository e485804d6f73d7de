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
GET / DELETE /v1/responses/{id} fetch or drop it; `conversation` names a conversation of
the Conversations API (conversations.py) whose items come first and which the turn joins. The message's logprobs come with `include: ["message.output_text.logprobs"]` or
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
from tessera.server.responses_store import items_page, stored_items
from tessera.server.state import ServerState

router = APIRouter(prefix="/v1")


def _conversation_id(body: ResponsesRequest) -> str | None:
    """`conversation`: an id, or {"id": ...}."""
    given = body.conversation
    cid = given.get("id") if isinstance(given, dict) else given
    if given is not None and not isinstance(cid, str):
        raise ValidationFailed("`conversation` is a conversation's id or {\"id\": ...}", param="conversation")
    if cid is not None and body.previous_response_id is not None:
        raise ValidationFailed("give `conversation` or `previous_response_id`, not both", param="conversation")
    return cid


def _history(state: ServerState, body: ResponsesRequest, cid: str | None) -> list:
    """The items before this request's input: a conversation's, or a previous response's
    conversation and output (its instructions are not carried over, as in OpenAI's API)."""
    if cid is not None:
        conversation = state.conversations.get(cid)
        if conversation is None:
            raise NotFound(f"Conversation with id '{cid}' not found", param="conversation")
        return list(conversation.items)
    if body.previous_response_id is None:
        return []
    prior = state.responses.get(body.previous_response_id)
    if prior is None:
        raise ValidationFailed(f"Previous response with id '{body.previous_response_id}' not found: responses "
                               "are kept in memory while the server runs, the oldest dropped beyond "
                               f"{state.responses.capacity} (--responses-store-size), and not with store: false",
                               param="previous_response_id")
    return [*prior.conversation, *prior.response["output"]]


@router.post("/responses")
async def responses(request: Request, body: ResponsesRequest):
    state = state_of(request)
    cid = _conversation_id(body)
    new = stored_items(input_items(body))
    items = [*_history(state, body, cid), *new]
    chat = await prepare_chat(state, chat_request(body, items), logprobs_param="include")
    stores = body.store is not False and state.responses.capacity > 0

    def finished(response: dict) -> None:
        if stores:
            state.responses.put(response, items)
        if cid is not None:  # the turn joins the conversation: its input, then its output
            state.conversations.extend(cid, [*new, *response["output"]])

    writer = ResponseWriter(f"resp_{uuid.uuid4().hex}", chat.served, body, len(chat.ids),
                            lambda text: len(state.tokenizer(text, add_special_tokens=False).input_ids),
                            finished if stores or cid is not None else None, stored=stores)
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
    return items_page(_stored(state_of(request), rid).conversation, order, limit, after)


@router.delete("/responses/{rid}")
async def delete(request: Request, rid: str) -> dict:
    state = state_of(request)
    _stored(state, rid)
    state.responses.delete(rid)
    return {"id": rid, "object": "response", "deleted": True}
