"""Gemma 4's attention (transformers' Gemma4TextAttention):
- per layer type its own head size and KV heads (full layers: global_head_dim, and
  num_global_key_value_heads where attention_k_eq_v);
- RMSNorm over head_dim on queries and keys (plain weights, not 1 + w) and a weightless one
  on values; scores unscaled (scale 1: the norms set the magnitude);
- attention_k_eq_v: full layers have no v_proj, their values are k_proj's output (normed
  as values, without rotary);
- the last num_kv_shared_layers layers project queries only and attend over the cache of the
  last earlier layer of their type (SharedKVAttention)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import Rope
from tessera.ops.attention import Attention
from tessera.ops.attention.layer import SharedKVAttention
from tessera.ops.linear import PackedLinear, QKVLinear, RowParallelLinear
from tessera.ops.module import OpModule
from tessera.ops.norm import RMSNorm, norm_per_head
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import ApplyRotary


def gemma4_norm(size: int, eps: float, target: OpTarget) -> RMSNorm:
    """transformers multiplies the float32 normalised row by the float32 weight and rounds
    once, which a float32 weight gives (ops/norm.py)."""
    return RMSNorm(size, eps, target, weight_dtype=torch.float32)


class UnitRMSNorm(OpModule):
    """RMSNorm without a learned scale (Gemma 4's value norm, its router's input norm)."""

    def __init__(self, size: int, eps: float, target: OpTarget):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(size, dtype=torch.float32, device=target.device),
                             persistent=False)
        self._norm = target.op("rms_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps, None)[0]


def layer_shape(config: PretrainedConfig, layer_idx: int) -> tuple[int, int]:
    """(head_dim, num_key_value_heads) of a layer, as transformers resolves them per layer."""
    layer = config.per_layer_config[layer_idx]
    return layer.head_dim, layer.num_key_value_heads


class Gemma4Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, target: OpTarget):
        super().__init__()
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.head_dim, num_kv_heads = layer_shape(config, layer_idx)
        num_heads, eps = config.num_attention_heads, config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, num_heads, num_kv_heads, target, bias=bias,
                                  values=not (config.attention_k_eq_v and not sliding))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, target, bias=bias,
                                        in_span=self.qkv_proj.o_proj_span)
        self.q_norm = gemma4_norm(self.head_dim, eps, target)
        self.k_norm = gemma4_norm(self.head_dim, eps, target)
        self.v_norm = UnitRMSNorm(self.head_dim, eps, target)
        self.rotary = ApplyRotary(self.head_dim, target)  # proportional rope: a full-width table
        # (images: transformers' Gemma 4 lets an image's tokens see each other on sliding
        # layers only)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale=1.0, target=target,
                              sliding_window=config.sliding_window if sliding else None, image_spans=sliding)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        v = norm_per_head(self.v_norm, v, self.head_dim)  # k_proj's raw output where values are keys
        q, k = norm_per_head(self.q_norm, q, self.head_dim), norm_per_head(self.k_norm, k, self.head_dim)
        return self.o_proj(self.attn(q, k, v, rotary=self.rotary, rope=rope))


class Gemma4SharedKVAttention(nn.Module):
    """A KV-shared layer: its own q_proj, q_norm and o_proj, the producer's keys and values
    (its head split under tensor parallelism is the producer's)."""

    def __init__(self, config: PretrainedConfig, producer: Gemma4Attention, target: OpTarget):
        super().__init__()
        self.head_dim = producer.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        span = producer.qkv_proj.o_proj_span
        # named as the producer's so q_proj maps to shard "q" (packed_modules_mapping)
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": config.num_attention_heads * self.head_dim},
                                     target, bias=bias, shard_spans={"q": span})
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, target,
                                        bias=bias, in_span=span)
        self.q_norm = gemma4_norm(self.head_dim, config.rms_norm_eps, target)
        self.rotary = ApplyRotary(self.head_dim, target)
        self.attn = SharedKVAttention(producer.attn)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q = norm_per_head(self.q_norm, self.qkv_proj(hidden), self.head_dim)
        # the rotary op turns a query and a key: one query head stands in for the key
        q, _ = self.rotary(q, q[:, :self.head_dim], rope)
        return self.o_proj(self.attn(q))
