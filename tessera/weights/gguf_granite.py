"""IBM Granite 3.x's config from a GGUF (arch "granite", as llama.cpp's converter writes it: a
Llama file, Q / K permuted, with Granite's four multipliers under its own names:
`attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale`). transformers'
conversion does not know the arch."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys

ARCH = "granite"


def granite_config(fields: dict, tensors: list) -> Any:
    from transformers import GraniteConfig

    key = required_keys(fields, ARCH)
    # the converter writes a multiplier only when it is set; llama.cpp's defaults stand for the others
    head_dim = int(key("embedding_length")) // int(key("attention.head_count"))
    return plain_decoder_config(
        GraniteConfig, ARCH, fields, tensors, architectures=["GraniteForCausalLM"],
        attention_multiplier=float(key("attention.scale", head_dim ** -0.5)),
        embedding_multiplier=float(key("embedding_scale", 1.0)), residual_multiplier=float(key("residual_scale", 1.0)),
        logits_scaling=float(key("logit_scale")))
