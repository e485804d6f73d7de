"""IBM Granite (3.x dense; the language model of Granite Vision too): Llama with four
multipliers (transformers' GraniteModel): the embeddings scaled by embedding_multiplier,
attention scores by attention_multiplier (in place of 1 / sqrt(head_dim)), each sublayer's
output by residual_multiplier before it joins the residual, and the logits divided by
logits_scaling."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig

from tessera.models.llama.modeling import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, Rope,
                                           add_and_norm)
from tessera.ops.registry import OpTarget


class GraniteAttention(LlamaAttention):
    def attention_options(self, config: PretrainedConfig) -> dict:
        return {"scale": config.attention_multiplier}


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.residual_multiplier = config.residual_multiplier
        self._scale = target.op("sum_and_scale")

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.residual_multiplier
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self._scale(self.self_attn(rope, hidden), None, m)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self._scale(self.mlp(hidden), None, m), residual


class GraniteModel(LlamaModel):
    layer_cls = GraniteDecoderLayer

    def embedding_scale(self, config: PretrainedConfig) -> float | None:
        return config.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.logits_scaling = config.logits_scaling

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling  # float32 rows
