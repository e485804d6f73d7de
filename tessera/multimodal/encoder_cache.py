"""Encoded images kept across requests, keyed by their pixels' hash: a picture sent again
(a new conversation about it, another system prompt before it) skips the vision encoder
even where the prefix cache has nothing to reuse. Least recently used first out, within a
byte budget; the features are held in host memory (a GPU's goes to the KV cache)."""
from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_BYTES = 512 * 2**20


class EncoderCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return features

    def put(self, key: bytes, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = features.to("cpu", copy=True)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def clear(self) -> int:
        """Forget every encoded image; returns how many there were."""
        count = len(self._entries)
        self._entries.clear()
        self.bytes = 0
        return count
