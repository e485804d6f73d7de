"""ERNIE 4.5's config from a GGUF (arch "ernie4_5" for the dense 0.3B, "ernie4_5-moe" for
21B-A3B / 300B-A47B, as llama.cpp's converter writes them), which transformers' conversion
does not know. Rotary is interleaved in the checkpoints and in llama.cpp alike (no rows
permuted); biases by the tensors. The MoE layers run every `interleave_moe_layer_step`-th from
`leading_dense_block_count`, to the last block with experts (the file has no key for the end)."""
from __future__ import annotations

import re
from typing import Any

from tessera.weights.gguf_plain_config import plain_decoder_config, required_keys
from tessera.weights.gguf_rope import field_value

ARCHES = ("ernie4_5", "ernie4_5-moe")
_EXPERT_BLOCK = re.compile(r"^blk\.(\d+)\.ffn_gate(?:_up)?_exps\.weight$")  # (fused or not)


def ernie4_5_config(fields: dict, tensors: list) -> Any:
    from transformers import Ernie4_5_MoeConfig, Ernie4_5Config

    arch = field_value(fields, "general.architecture")

    key = required_keys(fields, arch)

    names = {t.name for t in tensors}
    extra: dict[str, Any] = {}
    if arch == "ernie4_5-moe":
        blocks = sorted(int(m.group(1)) for n in names if (m := _EXPERT_BLOCK.match(n)))
        if not blocks:
            raise ValueError(f"{arch} GGUF: the file has no experts (blk.N.ffn_gate_exps.weight or ffn_gate_up_exps)")
        extra = dict(moe_num_experts=int(key("expert_count")), moe_k=int(key("expert_used_count")),
                     moe_intermediate_size=int(key("expert_feed_forward_length")),
                     moe_num_shared_experts=int(key("expert_shared_count", 0)),
                     moe_layer_start_index=int(key("leading_dense_block_count", 0)),
                     moe_layer_interval=int(key("interleave_moe_layer_step", 1)), moe_layer_end_index=blocks[-1])
    bias = "blk.0.attn_q.bias" in names
    head_dim = int(key("attention.key_length", 0)) or int(key("embedding_length")) // int(key("attention.head_count"))
    return plain_decoder_config(
        Ernie4_5_MoeConfig if extra else Ernie4_5Config, arch, fields, tensors,
        architectures=["Ernie4_5_MoeForCausalLM" if extra else "Ernie4_5ForCausalLM"], head_dim=head_dim,
        use_bias=bias, **extra)
