"""tessera's paged attention as a transformers attention implementation.

transformers lets a library register an attention function by name
(`AttentionInterface.register`) and routes every attention call of a model built with that
`attn_implementation` through it. Ours hands the call to the model's tessera `Attention`
layer for that index, which writes K/V into the paged cache and runs the registry's prefill
and decode ops under the step's metadata. A name that transformers has no mask function for
also makes it skip building masks: causality and windows are ours to apply.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from transformers import AttentionInterface

from tessera.ops.attention import Attention

ATTN_IMPLEMENTATION = "tessera_paged"

# the tessera layers of the model running right now (one forward at a time per process)
_active: list[Sequence[Attention]] = []
_calls = [0]


@contextmanager
def paged_layers(layers: Sequence[Attention]) -> Iterator[list[int]]:
    """Route attention calls to `layers` for one forward; yields [calls made]."""
    _active.append(layers)
    _calls[0] = 0
    try:
        yield _calls
    finally:
        _active.pop()


def tessera_paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hk, T, D] (all of this step's rows packed into one
    batch row) -> ([1, T, Hq, D], no weights)."""
    if not _active:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention called outside a tessera forward pass")
    layer_idx = getattr(module, "layer_idx", None)
    layers = _active[-1]
    if layer_idx is None or not 0 <= layer_idx < len(layers):
        raise RuntimeError(f"{type(module).__name__} has layer_idx {layer_idx!r}; "
                           f"expected one of 0..{len(layers) - 1}")
    layer = layers[layer_idx]
    _refuse_unknown_math(kwargs, type(module).__name__)
    if query.shape[0] != 1:
        raise RuntimeError(f"expected one packed batch row, got {query.shape[0]}")
    _check(layer, query, key, sliding_window, softcap, type(module).__name__)
    if scaling is not None:
        layer.scale = scaling
    num_tokens = query.shape[2]
    q = query[0].transpose(0, 1).reshape(num_tokens, -1)
    k = key[0].transpose(0, 1).reshape(num_tokens, -1)
    v = value[0].transpose(0, 1).reshape(num_tokens, -1)
    out = layer(q, k, v)
    _calls[0] += 1
    return out.view(1, num_tokens, layer.num_heads, layer.head_size), None


class UnsupportedAttentionError(ValueError):
    """The model's attention asks for something tessera's paged attention does not do."""


def _refuse_unknown_math(kwargs: dict, module_name: str) -> None:
    """Arguments that change what attention computes, which the paged ops do not implement:
    attention sinks (gpt-oss passes `s_aux`), non-causal attention. Silently dropping them
    would serve wrong outputs."""
    sinks = [k for k in ("s_aux", "sinks") if kwargs.get(k) is not None]
    if sinks:
        raise UnsupportedAttentionError(f"{module_name} uses attention sinks ({sinks[0]}), which tessera's "
                                        "paged attention does not implement; this model cannot be served")
    if kwargs.get("is_causal") is False:
        raise UnsupportedAttentionError(f"{module_name} asks for non-causal attention; only causal "
                                        "decoder attention is served")


def _check(layer: Attention, query: torch.Tensor, key: torch.Tensor, sliding_window: int | None,
           softcap: float | None, module_name: str) -> None:
    """The layer was built from the config; the model's call must agree with it."""
    got = (query.shape[1], key.shape[1], query.shape[3])
    want = (layer.num_heads, layer.num_kv_heads, layer.head_size)
    if got != want:
        raise RuntimeError(f"{module_name}: (heads, kv heads, head size) {got} != the paged cache's {want}")
    if (sliding_window or None) != layer.sliding_window or (softcap or None) != layer.softcap:
        raise RuntimeError(f"{module_name}: sliding_window={sliding_window}, softcap={softcap} "
                           f"differ from the config's ({layer.sliding_window}, {layer.softcap})")


AttentionInterface.register(ATTN_IMPLEMENTATION, tessera_paged_attention)
