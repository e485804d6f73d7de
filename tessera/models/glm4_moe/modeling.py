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

from tessera.models.deepseek.modeling import DeepseekForCausalLM, IndexedLayersModel, IndexedMLPDecoderLayer
from tessera.models.deepseek.moe import DeepseekMoE
from tessera.models.llama.modeling import LlamaAttention, LlamaForCausalLM
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


class Glm4MoeDecoderLayer(IndexedMLPDecoderLayer):
    def attention(self, config: PretrainedConfig, target: OpTarget) -> nn.Module:
        attention = Glm4MoeHeadNormAttention if getattr(config, "use_qk_norm", False) else Glm4MoeAttention
        return attention(config, target)

    def moe(self, config: PretrainedConfig, target: OpTarget) -> nn.Module:
        return DeepseekMoE(config, target, v3=True)


class Glm4MoeModel(IndexedLayersModel):
    layer_cls = Glm4MoeDecoderLayer


class Glm4MoeForCausalLM(DeepseekForCausalLM):
    """DeepSeek's loading (routed experts into stacks, MTP layers skipped) over Llama's packed
    Q / K / V."""

    model_cls = Glm4MoeModel
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
