"""Cohere's Command R7B and Command A (Cohere 2): a parallel block (the attention and the
MLP both read one LayerNorm, without bias, of the state, and both outputs join it), rotary
on neighbouring pairs (interleaved) on the sliding-window layers only, the full-attention
layers without positions (NoPE), and logits scaled by logit_scale (transformers'
Cohere2ForCausalLM)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, Rope
from tessera.ops.norm import LayerNorm
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import ApplyRotary


class Cohere2Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        self.sliding = config.layer_types[layer_idx] == "sliding_attention"  # read by attention_options()
        super().__init__(config, target)
        self.rotary = ApplyRotary(self.head_dim, target, interleaved=True)

    def attention_options(self, config: PretrainedConfig) -> dict:
        return {"scale": self.head_dim ** -0.5, "sliding_window": config.sliding_window if self.sliding else None}

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.sliding:  # the full-attention layers take no positions
            q, k = self.rotary(q, k, rope)
        return self.o_proj(self.attn(q, k, v))


class Cohere2DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        super().__init__()
        self.self_attn = Cohere2Attention(config, target, layer_idx)
        self.mlp = LlamaMLP(config, target)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, target, bias=False)
        self._add = target.op("sum_and_scale")  # the sums as kernels (CPU decode graphs replay them)

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # (hidden, residual): the state is their sum; this layer's two outputs join it next
        state = hidden if residual is None else self._add(hidden, residual)
        normed = self.input_layernorm(state)
        return self._add(self.self_attn(rope, normed), self.mlp(normed)), state


class Cohere2Model(LlamaModel):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        # (LlamaModel's RMSNorm reads this name before the LayerNorm below replaces it; the
        # released configs have layer_norm_eps only)
        config.rms_norm_eps = config.layer_norm_eps
        super().__init__(config, target)
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps, target, bias=False)
        self._add = target.op("sum_and_scale")

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return Cohere2DecoderLayer(config, target, layer_idx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual)
        return self.norm(self._add(hidden, residual))


class Cohere2ForCausalLM(LlamaForCausalLM):
    model_cls = Cohere2Model

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.logit_scale = config.logit_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.logit_scale  # float32 rows
