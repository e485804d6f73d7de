"""GLM-4 (GLM-4-9B / 32B-0414, GLM-Z1): Llama's projections (Q/K/V biases, none on o_proj;
the checkpoint's gate_up_proj fused already) with rotary over half of each head, on
neighbouring pairs (interleaved, ops/rotary.py's ApplyRotary), and sandwich norms: the
attention's and the MLP's outputs are normed again before they join the residual
(transformers' Glm4DecoderLayer: post_self_attn_layernorm, post_mlp_layernorm)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import (LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, Rope, add_and_norm,
                                           rotary_dim_of)
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import ApplyRotary


class Glm4Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.rotary = ApplyRotary(self.head_dim, target, rotary_dim_of(config), interleaved=True)

    @staticmethod
    def biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return bool(getattr(config, "attention_bias", True)), False


class Glm4DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Glm4Attention(config, target)
        self.mlp = LlamaMLP(config, target)
        self.input_layernorm = RMSNorm(size, eps, target)
        self.post_self_attn_layernorm = RMSNorm(size, eps, target)
        self.post_attention_layernorm = RMSNorm(size, eps, target)  # before the MLP
        self.post_mlp_layernorm = RMSNorm(size, eps, target)

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # the residual adds are fused into the next norm (input / post-attention / final)
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(rope, hidden))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4Model(LlamaModel):
    layer_cls = Glm4DecoderLayer


class Glm4ForCausalLM(LlamaForCausalLM):
    model_cls = Glm4Model
