"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (glm4_moe): Llama's attention with Q / K / V biases
(none on o_proj), rotary over the first half of each head (rotate-half, not GLM-4's
interleaved pairs), an RMSNorm over every query and key head where use_qk_norm; and, past
the first `first_k_dense_replace` dense layers, DeepSeek-V3's mixture of experts (sigmoid
scores, the correction bias and group choice, renormalised and scaled weights, shared
experts: deepseek/moe.py). The checkpoints' multi-token-prediction layers
(num_nextn_predict_layers, from layer num_hidden_layers on) are skipped, as transformers
skips them."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from tessera.models.deepseek.modeling import DeepseekForCausalLM, is_dense_layer
from tessera.models.deepseek.moe import DeepseekMoE
from tessera.models.llama.modeling import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from tessera.models.qwen3.modeling import HeadNormForward
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget


class Glm4MoeAttention(LlamaAttention):
    @staticmethod
    def biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return bool(getattr(config, "attention_bias", False)), False


class Glm4MoeHeadNormAttention(HeadNormForward, Glm4MoeAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, target)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, target)


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        nn.Module.__init__(self)
        attention = Glm4MoeHeadNormAttention if getattr(config, "use_qk_norm", False) else Glm4MoeAttention
        self.self_attn = attention(config, target)
        dense = is_dense_layer(config, layer_idx)
        self.mlp = LlamaMLP(config, target) if dense else DeepseekMoE(config, target, v3=True)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)


class Glm4MoeModel(LlamaModel):
    layer_cls = Glm4MoeDecoderLayer

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return self.layer_cls(config, target, layer_idx)


class Glm4MoeForCausalLM(DeepseekForCausalLM):
    """DeepSeek's loading (routed experts into stacks, MTP layers skipped) over Llama's packed
    Q / K / V."""

    model_cls = Glm4MoeModel
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
