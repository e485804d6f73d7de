"""Cohere 2's config from a GGUF (arch "cohere2": Command R7B, Command A, as llama.cpp's
converter writes it), which transformers' conversion does not know: the logit scale and the
sliding window from their keys, every fourth layer full attention (llama.cpp's fixed pattern
for the arch: the file has no key for it), the LayerNorm's epsilon; Q / K not permuted."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys

ARCH = "cohere2"
PATTERN = 4  # every fourth layer attends to the whole context, without rotary


def cohere2_config(fields: dict, tensors: list) -> Any:
    from transformers import Cohere2Config

    key = required_keys(fields, ARCH)
    layers = int(key("block_count"))
    return plain_decoder_config(
        Cohere2Config, ARCH, fields, tensors, architectures=["Cohere2ForCausalLM"],
        logit_scale=float(key("logit_scale")), sliding_window=int(key("attention.sliding_window")),
        layer_norm_eps=float(key("attention.layer_norm_epsilon", 1e-5)),
        layer_types=["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(layers)])
