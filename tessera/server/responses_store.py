"""Finished Responses kept in memory, so that a client can continue a conversation by
`previous_response_id` (sending only the new turn), fetch a response again
(GET /v1/responses/{id}), list the input items it answered (.../input_items) or delete it. OpenAI stores responses unless `store` is false;
here they live as long as the server, the oldest dropped beyond --responses-store-size."""
from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from threading import Lock

from tessera.server.errors import ValidationFailed


@dataclass
class StoredResponse:
    response: dict  # the response object as it was sent
    conversation: list  # the input items it answered, earlier turns included


class ResponseStore:
    """At most `capacity` responses by id, the least recently stored or used dropped first."""

    def __init__(self, capacity: int = 1000):
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = Lock()

    def put(self, response: dict, conversation: list) -> None:
        with self._lock:
            self._responses[response["id"]] = StoredResponse(response, conversation)
            self._responses.move_to_end(response["id"])
            while len(self._responses) > self.capacity:
                self._responses.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            stored = self._responses.get(rid)
            if stored is not None:
                self._responses.move_to_end(rid)
            return stored

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._responses.pop(rid, None) is not None


def stored_items(items: list) -> list[dict]:
    """Input items as the store keeps them, each with an id (what GET .../input_items lists,
    and what a later turn reads back): a message's text as parts, typed by its role (an
    assistant's as output_text), calls and their outputs marked completed."""
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            role, content = item.get("role"), item.get("content")
            text_part = "output_text" if role == "assistant" else "input_text"
            if isinstance(content, str) or content is None:
                item["content"] = [{"type": text_part, "text": content or ""}]
            if role == "assistant":
                item["content"] = [{**part, "annotations": part.get("annotations", [])}
                                   if part.get("type") == "output_text" else part for part in item["content"]]
            item.setdefault("id", f"msg_{uuid.uuid4().hex}")
        elif kind == "function_call_output":
            item.setdefault("id", f"fco_{uuid.uuid4().hex}")
        elif kind == "function_call":
            item.setdefault("id", f"fc_{uuid.uuid4().hex}")
        if kind in ("message", "function_call", "function_call_output"):
            item.setdefault("status", "completed")
        out.append(item)
    return out


def items_page(items: list[dict], order: str, limit: int, after: str | None) -> dict:
    """OpenAI's list page of `items` (oldest first): `order` asc or desc, at most `limit`
    (1-100), those after the item of id `after`."""
    if order not in ("asc", "desc"):
        raise ValidationFailed("`order` is asc or desc", param="order")
    if not 1 <= limit <= 100:
        raise ValidationFailed("`limit` must be in [1, 100]", param="limit")
    items = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise ValidationFailed(f"no item {after!r} in this list", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
