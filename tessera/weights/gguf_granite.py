"""IBM Granite 3.x's config from a GGUF (arch "granite", as llama.cpp's converter writes it: a
Llama file, Q / K permuted, with Granite's four multipliers under its own names:
`attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale`). transformers'
conversion does not know the arch."""
from __future__ import annotations

from typing import Any, Callable

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys

ARCH = "granite"


def granite_config(fields: dict, tensors: list) -> Any:
    from transformers import GraniteConfig

    key = required_keys(fields, ARCH)
    return plain_decoder_config(GraniteConfig, ARCH, fields, tensors, architectures=["GraniteForCausalLM"],
                                **granite_multipliers(key))


def granite_multipliers(key: Callable[..., Any], logit_scale: float | None = None) -> dict:
    """Granite's muP multipliers under transformers' names, from a reader's `key`
    (gguf_plain_config.required_keys). The converter writes one only when it is set, so
    llama.cpp's defaults stand for the others; the logit scale takes `logit_scale` where
    it is missing, or is required (None)."""
    head_dim = int(key("embedding_length")) // int(key("attention.head_count"))
    return dict(attention_multiplier=float(key("attention.scale", head_dim ** -0.5)),
                embedding_multiplier=float(key("embedding_scale", 1.0)),
                residual_multiplier=float(key("residual_scale", 1.0)),
                logits_scaling=float(key("logit_scale", logit_scale)))
