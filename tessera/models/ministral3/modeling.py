"""Ministral 3 (3B, 8B, 14B; the language model of its image-text checkpoints too): Mistral's
layers with YaRN positions and Llama 4's attention temperature: past YaRN's original
context, queries are scaled by 1 + beta * log(1 + floor(position / original)) after rotary
(transformers' get_llama_4_attn_scale). The scales are a table by position, made once; a
step's rows ride with its cos / sin as a third element of the rope tuple, which rotary
itself ignores (a gather and a row scale: kernels the CPU decode graphs replay)."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig

from tessera.models.llama.modeling import Rope
from tessera.models.mistral.modeling import MistralAttention, MistralDecoderLayer, MistralForCausalLM, MistralModel
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import rope_context_length


class Ministral3Attention(MistralAttention):
    input_to_one_linear = True  # forward's hidden goes to qkv_proj only (ops/pending_norm.py)

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self._scale_rows = target.op("sum_and_scale")

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary(q, k, rope)
        if len(rope) > 2:  # [tokens, 1]: each token's query scale
            q = self._scale_rows(q, None, rope[2])
        return self.o_proj(self.attn(q, k, v))


class Ministral3DecoderLayer(MistralDecoderLayer):
    attention_cls = Ministral3Attention


class Llama4QueryTemperature:
    """Mixin before a LlamaModel subclass: past YaRN's original context each token's query
    scale, 1 + beta * log(1 + floor(position / original)), joins the step's rope tuple as
    its third element (the attention multiplies its queries by it)."""

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        params = getattr(config, "rope_parameters", None) or {}
        self.beta = beta = params.get("llama_4_scaling_beta")
        self.original = original = params.get("original_max_position_embeddings")
        self.register_buffer("query_scales", None, persistent=False)
        if beta and original:
            # every position the rotary tables hold; float32 as transformers computes it,
            # then the model dtype, as it multiplies
            size = max(config.max_position_embeddings, rope_context_length(params) or 0)
            scales = 1 + beta * torch.log(1 + torch.floor(torch.arange(size, dtype=torch.float32) / original))
            self.register_buffer("query_scales", scales.to(target.dtype)[:, None].to(target.device), persistent=False)
            self._gather = target.op("embedding")

    def step_rope(self, positions: torch.Tensor, **rope_inputs: torch.Tensor) -> Rope:
        rope = super().step_rope(positions, **rope_inputs)
        if self.query_scales is not None:
            rope = (*rope, self._gather(positions, self.query_scales))
        return rope


class Ministral3Model(Llama4QueryTemperature, MistralModel):
    layer_cls = Ministral3DecoderLayer


class Ministral3ForCausalLM(MistralForCausalLM):
    model_cls = Ministral3Model
