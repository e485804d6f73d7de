"""Conversations of the Conversations API (conversations.py), kept in memory: at most
`capacity` of them, the least recently used dropped first."""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from threading import Lock


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: list[dict] = field(default_factory=list)

    def public(self) -> dict:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


class ConversationStore:
    def __init__(self, capacity: int = 1000):
        self.capacity = capacity
        self._conversations: OrderedDict[str, Conversation] = OrderedDict()
        self._lock = Lock()

    def create(self, items: list[dict], metadata: dict[str, str]) -> Conversation:
        conversation = Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), metadata, items)
        with self._lock:
            self._conversations[conversation.id] = conversation
            while len(self._conversations) > self.capacity:
                self._conversations.popitem(last=False)
        return conversation

    def get(self, cid: str) -> Conversation | None:
        with self._lock:
            conversation = self._conversations.get(cid)
            if conversation is not None:
                self._conversations.move_to_end(cid)
            return conversation

    def extend(self, cid: str, items: list[dict]) -> None:
        """Add items to a conversation (gone since: nothing to add to)."""
        with self._lock:
            conversation = self._conversations.get(cid)
            if conversation is not None:
                conversation.items.extend(items)

    def delete(self, cid: str) -> bool:
        with self._lock:
            return self._conversations.pop(cid, None) is not None
