"""SmolLM3: Llama whose NoPE layers (no_rope_layers[i] == 0: every fourth in SmolLM3-3B)
apply no rotary embedding to their queries and keys, and, where use_sliding_window and
layer_types say so, a sliding window (transformers' SmolLM3Attention)."""
from __future__ import annotations

import functools

from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from tessera.ops.registry import OpTarget


class SmolLM3Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        # read by attention_options() and forward()
        self.uses_rope = bool(config.no_rope_layers[layer_idx])
        sliding = bool(getattr(config, "use_sliding_window", False)) and (
            (getattr(config, "layer_types", None) or [])[layer_idx:layer_idx + 1] == ["sliding_attention"])
        self.window = config.sliding_window if sliding else None
        super().__init__(config, target)

    def attention_options(self, config: PretrainedConfig) -> dict:
        return {"scale": self.head_dim ** -0.5, "sliding_window": self.window}


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        self.attention_cls = functools.partial(SmolLM3Attention, layer_idx=layer_idx)  # this index's
        super().__init__(config, target)


class SmolLM3Model(LlamaModel):
    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return SmolLM3DecoderLayer(config, target, layer_idx)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    model_cls = SmolLM3Model
