"""Attention sinks for the C attention kernels (attention_sinks.h)."""
from __future__ import annotations

import torch


def sink_pointer(sinks: torch.Tensor | None) -> int | None:
    """The address of a layer's sink logits as the kernels read them ([heads] contiguous
    float32, which the layer keeps them as), or None (NULL: no sinks)."""
    if sinks is None:
        return None
    if sinks.dtype != torch.float32 or not sinks.is_contiguous():
        raise ValueError(f"attention sinks must be contiguous float32, got {sinks.dtype}")
    return sinks.data_ptr()
