"""gpt-oss's config from a GGUF (arch "gpt-oss", as llama.cpp's converter writes it). transformers
has a conversion for the arch, but it reads the rope scaling keys' values wrongly (it takes
each key's name length) and fails on every released file, so tessera reads the config
itself: the shared decoder keys, the experts' count and width, the head size, the sliding
window (every other layer, from the first, as in the released configs). Rope scaling and
the MXFP4 experts are completed after, as for every file (gguf_config.py)."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys

ARCH = "gpt-oss"


def gpt_oss_config(fields: dict, tensors: list) -> Any:
    from transformers import GptOssConfig

    key = required_keys(fields, ARCH)
    if any("ffn_gate_up_exps" in t.name for t in tensors):
        raise ValueError("a gpt-oss GGUF with its experts' gate and up fused (convert_hf_to_gguf.py "
                         "--fuse-gate-up-exps) is not read yet; convert it without that option")

    layers = int(key("block_count"))
    return plain_decoder_config(
        GptOssConfig, ARCH, fields, tensors, architectures=["GptOssForCausalLM"],
        head_dim=int(key("attention.key_length")), num_local_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        intermediate_size=int(key("expert_feed_forward_length")), sliding_window=int(key("attention.sliding_window")),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        attention_bias=True)
