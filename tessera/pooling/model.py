"""A text model as an embedding model: its backbone without the LM head.

Embedding checkpoints often hold the bare backbone (saved as Qwen3Model / MistralModel:
tensors named `layers.0...`, `norm.weight`, no `model.` prefix, no `lm_head`); a generative
checkpoint run with --runner pooling holds an LM head nothing reads. Both load: the LM head
is dropped before loading (an untied one would be vocabulary x hidden of memory for
nothing) and unprefixed names are taken as the backbone's."""
from __future__ import annotations

from torch import nn


def as_pooling_model(model: nn.Module) -> nn.Module:
    """`model` (a native causal LM: backbone `model`, head `lm_head`) changed in place."""
    if not isinstance(getattr(model, "model", None), nn.Module) or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} has no `model` backbone and `lm_head` to pool from")
    model.lm_head = None
    own = dict(getattr(model, "checkpoint_prefixes", {}))
    # first match wins: the head is skipped, the model's own renames apply, prefixed names
    # stay, and anything else is the bare backbone's
    model.checkpoint_prefixes = {"lm_head.": None, **own, "model.": "model.", "": "model."}
    return model
