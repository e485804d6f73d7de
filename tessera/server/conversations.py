"""OpenAI's Conversations API (`/v1/conversations`): a conversation's items kept on the
server, so that a Responses request names it (`conversation: "conv_..."`) instead of
sending its history; each response's input and output items are added to it (the Agents
SDK's OpenAIConversationsSession works this way).

Conversations live in memory as long as the server, at most --responses-store-size of
them, the least recently used dropped first. Items are the Responses API's (messages,
function calls and their outputs, reasoning), stored as the response store keeps input
items (responses_store.stored_items: each with an id)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from tessera.server.conversations_store import Conversation
from tessera.server.errors import NotFound, ValidationFailed
from tessera.server.openai_common import state_of
from tessera.server.responses_input import check_items
from tessera.server.responses_store import items_page, stored_items

router = APIRouter(prefix="/v1")
MAX_NEW_ITEMS = 20  # items a create or add request may carry (OpenAI's limit)
MAX_METADATA_KEYS = 16


class CreateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


class UpdateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any]


class AddItems(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[dict[str, Any]]


def _metadata(metadata: dict[str, Any] | None) -> dict[str, str]:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items()):
        raise ValidationFailed(f"`metadata` is at most {MAX_METADATA_KEYS} string keys (64 characters) with string "
                               "values (512 characters)", param="metadata")
    return dict(metadata)


def _items(items: list[dict[str, Any]] | None) -> list[dict]:
    items = items or []
    if len(items) > MAX_NEW_ITEMS:
        raise ValidationFailed(f"at most {MAX_NEW_ITEMS} items a request, got {len(items)}", param="items")
    check_items(items, param="items")
    return stored_items(items)


def conversation_of(request: Request, cid: str) -> Conversation:
    conversation = state_of(request).conversations.get(cid)
    if conversation is None:
        raise NotFound(f"Conversation with id '{cid}' not found (it was deleted, or dropped as the least recently "
                       "used beyond --responses-store-size)", param="conversation_id")
    return conversation


@router.post("/conversations")
async def create(request: Request, body: CreateConversation) -> dict:
    store = state_of(request).conversations
    return store.create(_items(body.items), _metadata(body.metadata)).public()


@router.get("/conversations/{cid}")
async def retrieve(request: Request, cid: str) -> dict:
    return conversation_of(request, cid).public()


@router.post("/conversations/{cid}")
async def update(request: Request, cid: str, body: UpdateConversation) -> dict:
    conversation = conversation_of(request, cid)
    conversation.metadata = _metadata(body.metadata)
    return conversation.public()


@router.delete("/conversations/{cid}")
async def delete(request: Request, cid: str) -> dict:
    conversation_of(request, cid)
    state_of(request).conversations.delete(cid)
    return {"id": cid, "object": "conversation.deleted", "deleted": True}


@router.post("/conversations/{cid}/items")
async def add_items(request: Request, cid: str, body: AddItems) -> dict:
    conversation = conversation_of(request, cid)
    items = _items(body.items)
    state_of(request).conversations.extend(conversation.id, items)
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}


@router.get("/conversations/{cid}/items")
async def list_items(request: Request, cid: str, order: str = "desc", limit: int = 20,
                     after: str | None = None) -> dict:
    return items_page(conversation_of(request, cid).items, order, limit, after)


def _item_index(conversation: Conversation, item_id: str) -> int:
    for i, item in enumerate(conversation.items):
        if item.get("id") == item_id:
            return i
    raise NotFound(f"Item with id '{item_id}' not found in conversation '{conversation.id}'", param="item_id")


@router.get("/conversations/{cid}/items/{item_id}")
async def retrieve_item(request: Request, cid: str, item_id: str) -> dict:
    conversation = conversation_of(request, cid)
    return conversation.items[_item_index(conversation, item_id)]


@router.delete("/conversations/{cid}/items/{item_id}")
async def delete_item(request: Request, cid: str, item_id: str) -> dict:
    conversation = conversation_of(request, cid)
    del conversation.items[_item_index(conversation, item_id)]
    return conversation.public()
