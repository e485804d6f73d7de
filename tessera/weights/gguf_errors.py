"""Errors of llama.cpp's files that callers tell apart."""
from __future__ import annotations


class MmprojError(ValueError):
    """A multimodal projector file (--mmproj) that cannot be read, or does not go with its
    language model's GGUF."""
