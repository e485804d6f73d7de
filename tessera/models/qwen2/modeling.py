"""Qwen2: Llama with biases on the Q, K and V projections (none on o_proj), as
transformers' Qwen2Attention. Built by swapping the attention class into the Llama stack."""
from __future__ import annotations

from transformers import PretrainedConfig

from tessera.models.llama.modeling import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                           LlamaModel)
from tessera.ops.registry import OpTarget


def check_no_sliding_window(config: PretrainedConfig) -> None:
    """tessera's paged attention is full causal attention; refuse configs that ask for less
    rather than compute different results."""
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ValueError(f"{getattr(config, 'model_type', 'this model')}: sliding window attention is "
                         f"not supported yet (config has use_sliding_window="
                         f"{getattr(config, 'use_sliding_window', None)}, sliding_window="
                         f"{getattr(config, 'sliding_window', None)})")


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(config: PretrainedConfig) -> tuple[bool, bool]:
        # Qwen2 always has Q/K/V biases and never an o_proj bias, whatever attention_bias says.
        return True, False


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        check_no_sliding_window(config)
        super().__init__(config, target)
