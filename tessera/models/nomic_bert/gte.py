"""GTE (transformers' `gte` type) as its checkpoints name tensors: Alibaba's layout
(encoder.layer.N.attention.qkv_proj, attn_ln / mlp_ln, mlp.up_gate_proj with the up rows
first; a classifier's backbone under new. or gte.), which transformers also writes back."""
from __future__ import annotations

import re

from tessera.models.nomic_bert.modeling import Family, RotaryEncoderForClassification, RotaryEncoderForEmbedding

GTE = Family(attention_bias=True, down_bias=True, up_gate_packed=True)
RENAMES = ((r"^encoder\.layer\.", "layers."), (r"\.attention\.qkv_proj\.", ".self_attn.qkv_proj."),
           (r"\.attention\.o_proj\.", ".self_attn.o_proj."), (r"\.attn_ln\.", ".post_attention_layernorm."),
           (r"\.mlp_ln\.", ".post_mlp_layernorm."))


def gte_checkpoint_name(name: str) -> tuple[str, str | None] | None:
    """(our name, shard) for a tensor in GTE's layout (after the model's prefix rules), None
    for any other name."""
    part = name.removeprefix("model.")
    renamed = part
    for pattern, replacement in RENAMES:
        renamed = re.sub(pattern, replacement, renamed)
    if ".mlp.up_gate_proj." in renamed:
        return "model." + renamed.replace(".mlp.up_gate_proj.", ".mlp.gate_up_proj."), "up_gate"
    return ("model." + renamed, None) if renamed != part else None


class GteForEmbedding(RotaryEncoderForEmbedding):
    family = GTE
    base_prefixes = ("new.", "gte.")

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, str | None] | None:
        return gte_checkpoint_name(name)


class GteForClassification(RotaryEncoderForClassification):
    family = GTE
    base_prefixes = ("new.", "gte.")

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, str | None] | None:
        return gte_checkpoint_name(name)
