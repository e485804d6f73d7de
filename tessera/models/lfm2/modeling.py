"""Liquid AI's LFM2 (lfm2: LFM2-350M to 2.6B): Llama-shaped layers whose token mixer is, by
config.layer_types, either attention ("full_attention": Qwen3's per-head q / k norms, here
q_layernorm / k_layernorm, and out_proj) or a gated short convolution ("conv": in_proj packs
B, C and x; B x runs through a causal depthwise convolution of conv_L_cache taps without
activation, keeping its last inputs per sequence as recurrent state; C gates the result;
out_proj). The SwiGLU MLP (w1, w3, w2) sizes its hidden dimension by transformers'
block_auto_adjust_ff_dim rule; the final norm is called embedding_norm in the checkpoint.

Tensor parallelism splits the convolution's channels (B, C and x alike) as a column-parallel
projection does, out_proj row-parallel."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.distributed.parallel import even_span
from tessera.models.llama.modeling import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, Rope
from tessera.models.qwen3.modeling import Qwen3Attention
from tessera.ops.linear import PackedLinear, RowParallelLinear
from tessera.ops.linear_attention import GatedShortConv
from tessera.ops.registry import OpTarget
from tessera.ops.weights import make_param, row_spans_loader

LAYER_TYPES = ("conv", "full_attention")


def feed_forward_size(config: PretrainedConfig) -> int:
    """transformers' Lfm2MLP sizing: 2/3 of intermediate_size, times the multiplier, rounded
    up to block_multiple_of, where block_auto_adjust_ff_dim is set."""
    size = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            size = config.block_multiple_of * ((size + config.block_multiple_of - 1) // config.block_multiple_of)
    return size


class Lfm2ShortConv(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        hidden, width = config.hidden_size, config.conv_L_cache
        span = even_span(hidden, target.tp_rank, target.tp_size)
        bias = bool(config.conv_bias)
        self.in_proj = PackedLinear(hidden, {"B": hidden, "C": hidden, "x": hidden}, target, bias=bias,
                                    shard_spans={"B": span, "C": span, "x": span})
        self.core = GatedShortConv(span.size, width, target)
        conv = row_spans_loader(hidden, [(0, span)], "conv")  # this rank's channels
        self.conv_weight = make_param((span.size, width), target.dtype, target.device, loader=conv)
        self.conv_bias = make_param((span.size,), target.dtype, target.device, loader=conv) if bias else None
        self.out_proj = RowParallelLinear(hidden, hidden, target, bias=bias, in_span=span)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.core(self.in_proj(hidden), self.conv_weight, self.conv_bias))


class Lfm2MLP(LlamaMLP):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target, feed_forward_size(config))


class Lfm2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, layer_type: str, target: OpTarget, mlp_cls: type = Lfm2MLP):
        """`mlp_cls`: the feed-forward of this index (LFM2-MoE's are experts past the dense ones)."""
        self.attention_cls = Lfm2ShortConv if layer_type == "conv" else Qwen3Attention
        self.mlp_cls = mlp_cls
        super().__init__(config, target)


class Lfm2Model(LlamaModel):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        self.types = list(config.layer_types)
        unknown = set(self.types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"lfm2: unknown layer_types {sorted(unknown)}")
        if "full_attention" not in self.types:
            raise ValueError("lfm2: no attention layer; the engine needs one for its KV cache")
        config.rms_norm_eps = config.norm_eps  # (the Llama layers read this name)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"lfm2 supports hidden_act 'silu' only, got {config.hidden_act!r}")
        config.hidden_act = "silu"
        super().__init__(config, target)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return Lfm2DecoderLayer(config, self.types[layer_idx], target, self.mlp_cls_for(config, layer_idx))

    def mlp_cls_for(self, config: PretrainedConfig, layer_idx: int) -> type:
        """LFM2's SwiGLU everywhere; LFM2-MoE overrides this (moe.py)."""
        return Lfm2MLP


class Lfm2ForCausalLM(LlamaForCausalLM):
    model_cls = Lfm2Model
    # checkpoint name fragment -> ours (the Llama layer's names)
    RENAMES = {".conv.conv.weight": ".self_attn.conv_weight", ".conv.conv.bias": ".self_attn.conv_bias",
               ".conv.": ".self_attn.", ".self_attn.out_proj.": ".self_attn.o_proj.",
               ".q_layernorm.": ".q_norm.", ".k_layernorm.": ".k_norm.", ".feed_forward.w2.": ".mlp.down_proj.",
               ".operator_norm.": ".input_layernorm.", ".ffn_norm.": ".post_attention_layernorm.",
               "model.embedding_norm.": "model.norm."}
    GATE_UP = {".feed_forward.w1.": 0, ".feed_forward.w3.": 1}

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        for theirs, shard in self.GATE_UP.items():
            if theirs in name:
                return name.replace(theirs, ".mlp.gate_up_proj."), shard
        theirs = next((fragment for fragment in self.RENAMES if fragment in name), None)
        if theirs is None:
            return None
        renamed = name.replace(theirs, self.RENAMES[theirs])  # the first fragment found only
        # what remains for the packed mapping (q / k / v into qkv_proj)
        for fragment, (packed, shard) in self.packed_modules_mapping.items():
            if f".{fragment}." in renamed:
                return renamed.replace(f".{fragment}.", f".{packed}."), shard
        return renamed, None
