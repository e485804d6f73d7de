"""DeepSeek-V2 and V3 (and DeepSeek-R1), and GLM-4.7-Flash (glm4_moe_lite: V3's attention
and experts): the Llama stack with multi-head latent attention (mla.py) and, past the
first `first_k_dense_replace` dense layers (or where `mlp_layer_types` says "sparse"), a
mixture of routed and shared experts (moe.py; V3's routing for every type but V2).
Checkpoints' multi-token-prediction layers (layer num_hidden_layers on) are skipped, as
transformers skips them."""
from __future__ import annotations

from abc import ABCMeta, abstractmethod

from torch import nn
from transformers import PretrainedConfig

from tessera.models.deepseek.mla import K_B, V_B, MLAttention
from tessera.models.deepseek.moe import DeepseekMoE
from tessera.models.llama.modeling import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from tessera.ops.moe import HF_EXPERT_NAMES, expert_weight_target
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import RotaryEmbedding, rope_parameters


def is_dense_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """A dense MLP, not experts: `mlp_layer_types` where the config has them, else one of the
    first `first_k_dense_replace` layers."""
    kinds = getattr(config, "mlp_layer_types", None)
    if kinds:
        return kinds[layer_idx] == "dense"
    return layer_idx < (getattr(config, "first_k_dense_replace", None) or 0)


class IndexedMLPDecoderLayer(LlamaDecoderLayer, metaclass=ABCMeta):
    """Llama's layer whose MLP is dense or experts by the layer's index (DeepSeek's dense
    first layers; GLM-4.5's and ERNIE 4.5's reuse it): `attention` builds the attention,
    `dense` says which layers are dense, `moe` builds the experts of the others."""

    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        nn.Module.__init__(self)
        self.self_attn = self.attention(config, target)
        self.mlp = LlamaMLP(config, target) if self.dense(config, layer_idx) else self.moe(config, target)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)

    def attention(self, config: PretrainedConfig, target: OpTarget) -> nn.Module:
        return self.attention_cls(config, target)

    @staticmethod
    def dense(config: PretrainedConfig, layer_idx: int) -> bool:
        return is_dense_layer(config, layer_idx)

    @abstractmethod
    def moe(self, config: PretrainedConfig, target: OpTarget) -> nn.Module:
        """The experts of the layers that are not dense (each model's own)."""


class IndexedLayersModel(LlamaModel):
    """Llama's stack of layers that take their index (IndexedMLPDecoderLayer)."""

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return self.layer_cls(config, target, layer_idx)


class DeepseekDecoderLayer(IndexedMLPDecoderLayer):
    attention_cls = MLAttention
    moe_cls = DeepseekMoE

    def moe(self, config: PretrainedConfig, target: OpTarget) -> nn.Module:
        return self.moe_cls(config, target, config.model_type != "deepseek_v2")


class DeepseekModel(IndexedLayersModel):
    def make_rotary(self, config: PretrainedConfig, target: OpTarget) -> nn.Module:
        """Rotary turns only each query's and the shared key's qk_rope_head_dim part."""
        return RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings, rope_parameters(config), target)

    layer_cls = DeepseekDecoderLayer


class DeepseekForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekModel
    # the shared experts' and dense layers' gate / up pack; attention keeps its own names
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        # (at least one: GLM-4.7-Flash's config does not count the MTP layer its checkpoint holds)
        extra = max(getattr(config, "num_nextn_predict_layers", 0) or 0, 1)
        self.checkpoint_prefixes = {f"model.layers.{config.num_hidden_layers + i}.": None for i in range(extra)}

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """Routed experts into the stacks, kv_b_proj (or its halves) into the absorbed weight;
        None for the rest."""
        if name.endswith(".self_attn.kv_b_proj.weight"):
            return name.replace(".kv_b_proj.weight", ".kv_b_weight"), None
        for half in (K_B, V_B):  # a GGUF's split kv_b_proj
            if name.endswith(f".self_attn.{half}.weight"):
                return name.replace(f".{half}.weight", ".kv_b_weight"), half
        if ".shared_experts." in name:
            return None
        return expert_weight_target(name, HF_EXPERT_NAMES)
