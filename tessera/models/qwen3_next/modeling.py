"""Qwen3-Next and Qwen3.5: hybrid stacks where most layers are Gated DeltaNet linear
attention (a fixed-size recurrent state per sequence) and every few layers is gated full
attention over the paged KV cache (config.layer_types).

- Linear attention layers: packed [q | k | v | z] and [b | a] projections
  (projections.py), the recurrent core (ops/linear_attention: causal conv1d + SiLU over
  q, k, v, then the gated delta rule with decay g = -exp(A_log) softplus(a + dt_bias) and
  write strength beta = sigmoid(b)), an RMSNorm of each value head gated by SiLU(z), and
  out_proj.
- Full attention layers: Qwen3's per-head q / k norms, partial rotary, and an output gate:
  q_proj also yields a gate per head, and the attention output is multiplied by its sigmoid
  before o_proj.
- Every RMSNorm but the gated one normalises with (1 + w) in float32 (Gemma's norm).
- MLP: dense SwiGLU (Qwen3.5), or routed experts plus a sigmoid-gated shared expert
  (Qwen3-Next, Qwen3.5-MoE; moe.py).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.gemma2.modeling import Gemma2RMSNorm
from tessera.models.llama.modeling import (LlamaForCausalLM, LlamaMLP, LlamaModel, Rope, add_and_norm,
                                           head_dim_of, rotary_dim_of)
from tessera.models.qwen3_next.projections import DeltaNetSplit, GatedQKVLinear, ba_projection, qkvz_projection
from tessera.ops.attention import Attention
from tessera.ops.linear import RowParallelLinear
from tessera.ops.linear_attention import GatedDeltaRule
from tessera.ops.norm import GatedRMSNorm, norm_per_head
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import ApplyRotary
from tessera.ops.weights import make_param, row_spans_loader

LAYER_TYPES = ("linear_attention", "full_attention")


class GatedAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = GatedQKVLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                       config.num_key_value_heads, target, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, target,
                                        bias=bias, in_span=self.qkv_proj.o_proj_span)
        self.q_norm = Gemma2RMSNorm(self.head_dim, config.rms_norm_eps, target)
        self.k_norm = Gemma2RMSNorm(self.head_dim, config.rms_norm_eps, target)
        self.rotary = ApplyRotary(self.head_dim, target, rotary_dim_of(config))
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scale=self.head_dim ** -0.5,
                              target=target)
        self._output_gate = target.op("sigmoid_gate_mul")

    def _head_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm_per_head(norm, x, self.head_dim)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary(self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k), rope)
        return self.o_proj(self._output_gate(self.attn(q, k, v), gate))


class GatedDeltaNet(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Gated DeltaNet supports hidden_act 'silu' only, got {config.hidden_act!r}")
        num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        if num_v % num_k:
            raise ValueError(f"linear_num_value_heads ({num_v}) must be a multiple of linear_num_key_heads ({num_k})")
        self.split = split = DeltaNetSplit(num_k, num_v, dk, dv, target)
        self.full_key_dim, self.full_value_dim = num_k * dk, num_v * dv
        self.in_proj_qkvz = qkvz_projection(config.hidden_size, split, num_k, dk, dv, target)
        self.in_proj_ba = ba_projection(config.hidden_size, split, num_k, target)
        self.core = GatedDeltaRule(split.k_heads.size, split.v_heads.size, dk, dv, config.linear_conv_kernel_dim,
                                   target)
        key, value = self.full_key_dim, self.full_value_dim
        # this rank's conv channels: its q, k and v rows, [conv_dim, K]; its value heads' vectors
        conv = row_spans_loader(2 * key + value, [(0, split.k_rows), (key, split.k_rows), (2 * key, split.v_rows)],
                                "conv1d weight")
        heads = row_spans_loader(num_v, [(0, split.v_heads)], "per-head vector")
        self.conv_weight = make_param((self.core.conv_dim, config.linear_conv_kernel_dim), target.dtype,
                                      target.device, loader=conv)
        self.dt_bias = make_param((split.v_heads.size,), target.dtype, target.device, loader=heads)
        self.A_log = make_param((split.v_heads.size,), target.dtype, target.device, loader=heads)
        self.norm = GatedRMSNorm(dv, config.rms_norm_eps, target)
        self._gates = target.op("delta_rule_gates")
        self.out_proj = RowParallelLinear(self.full_value_dim, config.hidden_size, target,
                                          in_span=split.v_rows)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        core = self.core
        qkvz = self.in_proj_qkvz(hidden)
        mixed_qkv, z = qkvz[:, :core.conv_dim], qkvz[:, core.conv_dim:]
        b, a = self.in_proj_ba.split(self.in_proj_ba(hidden))
        g, beta = self._gates(a, b, self.A_log, self.dt_bias)
        out = core(mixed_qkv, self.conv_weight, None, g, beta)  # [T, Hv, Dv]
        out = self.norm(out, z.reshape(out.shape))
        return self.out_proj(out.reshape(out.shape[0], -1))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_type: str, mlp: nn.Module, target: OpTarget):
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, target)
        else:
            self.self_attn = GatedAttention(config, target)
        self.mlp = mlp
        self.input_layernorm = Gemma2RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.post_attention_layernorm = Gemma2RMSNorm(config.hidden_size, config.rms_norm_eps, target)

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = (self.linear_attn if self.is_linear else self.self_attn)(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextModel(LlamaModel):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        unknown = set(config.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"{config.model_type}: unknown layer_types {sorted(unknown)}")
        if "full_attention" not in config.layer_types:
            raise ValueError(f"{config.model_type}: no full_attention layer; the engine needs one for its KV cache")
        super().__init__(config, target)
        self.norm = Gemma2RMSNorm(config.hidden_size, config.rms_norm_eps, target)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return Qwen3NextDecoderLayer(config, config.layer_types[layer_idx], self.make_mlp(config, layer_idx, target),
                                     target)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        """Qwen3.5's dense SwiGLU; the MoE variants override this (moe.py)."""
        return LlamaMLP(config, target)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3NextModel
    packed_modules_mapping = {
        **LlamaForCausalLM.packed_modules_mapping, "q_proj": ("qkv_proj", "q_gate"),
        "in_proj_qkv": ("in_proj_qkvz", "qkv"), "in_proj_z": ("in_proj_qkvz", "z"),
        "in_proj_b": ("in_proj_ba", "b"), "in_proj_a": ("in_proj_ba", "a"),
    }
    # Qwen3.5's image-text checkpoints: the language model under model.language_model; the
    # vision tower and the multi-token-prediction layers are not used
    checkpoint_prefixes = {"model.language_model.": "model.", "model.visual.": None, "mtp.": None}

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        if name.endswith(".linear_attn.conv1d.weight"):
            return name.replace(".conv1d.weight", ".conv_weight"), None
        return None
