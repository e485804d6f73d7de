"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air from a GGUF (arch "glm4moe", as llama.cpp's converter
writes it), which transformers' GGUF conversion does not know: Llama's keys, the experts'
(count, used count, shared count, width, the dense leading blocks, the weights' scale and
renormalisation), rotary over `rope.dimension_count` of each head, and the
multi-token-prediction layers counted into block_count (`nextn_predict_layers`: the last
blocks, which are not served). Q and K are not permuted (rotate-half rotary)."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys

ARCH = "glm4moe"


def glm4moe_config(fields: dict, tensors: list) -> Any:
    """A Glm4MoeConfig for the file (head_dim, biases and rope scaling completed after, as for
    every file: gguf_config.complete_gguf_config)."""
    from transformers import Glm4MoeConfig

    key = required_keys(fields, ARCH)

    nextn = int(key("nextn_predict_layers", 0))
    layers = int(key("block_count")) - nextn
    head_dim = int(key("attention.key_length", 0)) or int(key("embedding_length")) // int(key("attention.head_count"))
    rotary = int(key("rope.dimension_count", head_dim))
    names = {t.name for t in tensors}
    experts = dict(
        n_routed_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        n_shared_experts=int(key("expert_shared_count", 0)),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        first_k_dense_replace=int(key("leading_dense_block_count", 0)),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(key("expert_weights_norm", False)),
        n_group=int(key("expert_group_count", 1)), topk_group=int(key("expert_group_used_count", 1)))
    config = plain_decoder_config(
        Glm4MoeConfig, ARCH, fields, tensors, architectures=["Glm4MoeForCausalLM"], num_hidden_layers=layers,
        head_dim=head_dim, use_qk_norm="blk.0.attn_q_norm.weight" in names, num_nextn_predict_layers=nextn,
        **experts)
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": rotary / head_dim}
    return config
