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
    return plain_decoder_config(
        GraniteConfig, ARCH, fields, tensors, architectures=["GraniteForCausalLM"],
        attention_multiplier=float(key("attention.scale")), embedding_multiplier=float(key("embedding_scale")),
        residual_multiplier=float(key("residual_scale")), logits_scaling=float(key("logit_scale")))
