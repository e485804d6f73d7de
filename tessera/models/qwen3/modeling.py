"""Qwen3: Llama with an RMSNorm over head_dim on every query and key head, applied before
rotary (transformers' Qwen3Attention), an explicit head_dim, and biases only if
attention_bias. Built by swapping the attention class into the Llama stack."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig

from tessera.models.llama.modeling import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                           LlamaModel, Rope)
from tessera.models.qwen2.modeling import check_no_sliding_window
from tessera.ops.norm import RMSNorm, norm_per_head
from tessera.ops.registry import OpTarget


class HeadNormForward:
    """Attention whose `q_norm` / `k_norm` (set by the class) normalise every query and key
    head over head_dim before rotary (Qwen3, Gemma 3); mixed in before a LlamaAttention."""

    input_to_one_linear = True  # forward's hidden goes to qkv_proj only (ops/pending_norm.py)

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm_per_head(norm, x, self.head_dim)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        return self.o_proj(self.attn(q, k, v, rotary=self.rotary, rope=rope))


class Qwen3Attention(HeadNormForward, LlamaAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)  # qkv and o_proj biases follow attention_bias
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, target)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, target)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        check_no_sliding_window(config)
        super().__init__(config, target)
