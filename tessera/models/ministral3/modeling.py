"""Ministral 3 (3B, 8B, 14B; the language model of its image-text checkpoints too): Mistral's
layers with YaRN positions and Llama 4's attention temperature: past YaRN's original
context, queries are scaled by 1 + beta * log(1 + floor(position / original)) after rotary
(transformers' get_llama_4_attn_scale). The scale rides with the step's cos / sin as a
third element of the rope tuple, which rotary itself ignores."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig

from tessera.models.llama.modeling import Rope
from tessera.models.mistral.modeling import MistralAttention, MistralDecoderLayer, MistralForCausalLM, MistralModel


class Ministral3Attention(MistralAttention):
    input_to_one_linear = True  # forward's hidden goes to qkv_proj only (ops/pending_norm.py)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary(q, k, rope)
        if len(rope) > 2:  # [tokens, 1]: each token's query scale
            q = q * rope[2].to(q.dtype)
        return self.o_proj(self.attn(q, k, v))


class Ministral3DecoderLayer(MistralDecoderLayer):
    attention_cls = Ministral3Attention


class Llama4QueryTemperature:
    """Mixin before a LlamaModel subclass: past YaRN's original context each token's query
    scale, 1 + beta * log(1 + floor(position / original)), joins the step's rope tuple as
    its third element (the attention multiplies its queries by it)."""

    def __init__(self, config: PretrainedConfig, target):
        super().__init__(config, target)
        params = getattr(config, "rope_parameters", None) or {}
        self.beta = params.get("llama_4_scaling_beta")
        self.original = params.get("original_max_position_embeddings")

    def step_rope(self, positions: torch.Tensor, **rope_inputs: torch.Tensor) -> Rope:
        rope = super().step_rope(positions, **rope_inputs)
        if self.beta and self.original:
            scale = 1 + self.beta * torch.log1p(torch.floor(positions.to(torch.float32) / self.original))
            rope = (*rope, scale[:, None])
        return rope


class Ministral3Model(Llama4QueryTemperature, MistralModel):
    layer_cls = Ministral3DecoderLayer


class Ministral3ForCausalLM(MistralForCausalLM):
    model_cls = Ministral3Model
