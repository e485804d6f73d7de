"""Falcon-H1's config from a GGUF (arch "falcon-h1", as llama.cpp's converter writes it),
which transformers' conversion does not know.

The converter folds every muP multiplier into the weights (the attention's input multiplier
into Q / K / V, the key multiplier into K, the mixer's input multiplier and its per-part
projection multipliers into ssm_in's rows, the output multipliers into attn_output / ssm_out
/ ffn_down, the gate's into ffn_gate, the embedding's and the LM head's into theirs), so the
file's model is Falcon-H1 with every multiplier 1. Mamba-2's sizes come from `ssm.*`; its
vectors as Granite 4.0-H's files keep them (gguf_granitehybrid.py); Q / K permuted as
Llama's. Files with the mixer's RMSNorm (`ssm_norm`; none of the releases has it) are
refused: the file does not say whether it comes before or after the gate."""
from __future__ import annotations

from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys

ARCH = "falcon-h1"
FOLDED = dict(attention_in_multiplier=1.0, attention_out_multiplier=1.0, key_multiplier=1.0, ssm_in_multiplier=1.0,
              ssm_out_multiplier=1.0, mlp_multipliers=[1.0, 1.0], ssm_multipliers=[1.0] * 5, lm_head_multiplier=1.0,
              embedding_multiplier=1.0)


def falcon_h1_config(fields: dict, tensors: list) -> Any:
    from transformers import FalconH1Config

    key = required_keys(fields, ARCH)
    names = {t.name for t in tensors}
    if any(n.endswith("ssm_norm.weight") for n in names):
        raise ValueError(f"a {ARCH} GGUF with the mixer's RMSNorm is not read yet (the file does not say whether "
                         "it comes before or after the gate); serve the model's Hugging Face folder")
    inner, heads = int(key("ssm.inner_size")), int(key("ssm.time_step_rank"))
    return plain_decoder_config(
        FalconH1Config, ARCH, fields, tensors, architectures=["FalconH1ForCausalLM"],
        head_dim=int(key("attention.key_length")), mamba_d_ssm=inner, mamba_n_heads=heads, mamba_d_head=inner // heads,
        mamba_n_groups=int(key("ssm.group_count")), mamba_d_state=int(key("ssm.state_size")),
        mamba_d_conv=int(key("ssm.conv_kernel")), mamba_rms_norm=False,
        mamba_conv_bias=any(n.endswith("ssm_conv1d.bias") for n in names),
        mamba_proj_bias=any(n.endswith("ssm_in.bias") for n in names),
        projectors_bias=any(n.endswith("ssm_out.bias") for n in names), **FOLDED)
