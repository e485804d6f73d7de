"""LFM2's config from a GGUF (arch "lfm2", or "lfm2moe" for LFM2-MoE, as llama.cpp's converter
writes them): which layers
attend and which convolve is the per-layer `attention.head_count_kv` (0 for a convolution
layer), the convolution's width `shortconv.l_cache`, and the feed-forward width the file
gives is already the one transformers' block_auto_adjust_ff_dim rule computes (so the rule
is off here). Read by tessera: transformers' conversion takes the per-layer head counts as
one number."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys
from tessera.weights.gguf_rope import field_value

ARCHES = ("lfm2", "lfm2moe")  # LFM2; LFM2-MoE (its experts past the dense first layers)


def lfm2_config(fields: dict, tensors: list) -> Any:
    from transformers import Lfm2Config, Lfm2MoeConfig

    arch = field_value(fields, "general.architecture")
    key = required_keys(fields, arch)
    kv_heads = field_value(fields, f"{arch}.attention.head_count_kv")
    width = field_value(fields, f"{arch}.shortconv.l_cache")
    if not isinstance(kv_heads, (list, tuple)) or width is None:
        raise ValueError(f"{arch} GGUF: the file lacks per-layer {arch}.attention.head_count_kv or "
                         f"{arch}.shortconv.l_cache")
    names = {t.name for t in tensors}
    common = dict(layer_types=["full_attention" if heads else "conv" for heads in kv_heads], conv_L_cache=int(width),
                  conv_bias=any(n.endswith("shortconv.in_proj.bias") for n in names),
                  norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)))
    if arch == "lfm2":
        return plain_decoder_config(Lfm2Config, arch, fields, tensors, architectures=["Lfm2ForCausalLM"],
                                    block_auto_adjust_ff_dim=False, **common)
    # (routing renormalised, unscaled: the released configs' values, which the file does not carry)
    return plain_decoder_config(
        Lfm2MoeConfig, arch, fields, tensors, architectures=["Lfm2MoeForCausalLM"],
        num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        num_dense_layers=int(key("leading_dense_block_count", 0)),
        use_expert_bias=any(n.endswith("exp_probs_b.bias") for n in names), **common)
