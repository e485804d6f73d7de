"""Mistral: the Llama architecture with sliding-window attention on every layer
(config.sliding_window; None means full attention), as transformers' MistralAttention.
Like transformers' Mistral, `layer_types` is not consulted: one window for all layers.
Built by swapping the attention class into the Llama stack."""
from __future__ import annotations

from transformers import PretrainedConfig

from tessera.models.llama.modeling import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                           LlamaModel)


class MistralAttention(LlamaAttention):
    def attention_options(self, config: PretrainedConfig) -> dict:
        return {"scale": self.head_dim ** -0.5,
                "sliding_window": getattr(config, "sliding_window", None)}


class MistralDecoderLayer(LlamaDecoderLayer):
    attention_cls = MistralAttention


class MistralModel(LlamaModel):
    layer_cls = MistralDecoderLayer


class MistralForCausalLM(LlamaForCausalLM):
    model_cls = MistralModel
