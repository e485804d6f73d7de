"""GLM-4-0414 and GLM-Z1's config from a GGUF (arch "glm4", as llama.cpp's converter writes
it: Q / K not permuted, the rotary over `rope.dimension_count` of each head, the norms after
attention and MLP as post_attention_norm / post_ffw_norm, gate and up fused in ffn_up).
transformers' conversion does not know the arch."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys

ARCH = "glm4"


def glm4_config(fields: dict, tensors: list) -> Any:
    from transformers import Glm4Config

    key = required_keys(fields, ARCH)
    head_dim = int(key("attention.key_length", 0)) or int(key("embedding_length")) // int(key("attention.head_count"))
    config = plain_decoder_config(Glm4Config, ARCH, fields, tensors, architectures=["Glm4ForCausalLM"],
                                  head_dim=head_dim,  # (Glm4Config's default has biases: the tensors say)
                                  attention_bias=any(t.name == "blk.0.attn_q.bias" for t in tensors))
    rotary = int(key("rope.dimension_count", head_dim // 2))
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": rotary / head_dim}
    return config
