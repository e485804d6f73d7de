"""DeepSeek-V2 and V3 (and DeepSeek-R1): the Llama stack with
multi-head latent attention (mla.py) and, past the first `first_k_dense_replace` dense
layers, a mixture of routed and shared experts (moe.py). Checkpoints' multi-token-prediction
layers (V3's layer num_hidden_layers on) are skipped, as transformers skips them."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from tessera.models.deepseek.mla import MLAttention
from tessera.models.deepseek.moe import DeepseekMoE
from tessera.models.llama.modeling import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from tessera.ops.moe import HF_EXPERT_NAMES, expert_weight_target
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import RotaryEmbedding, rope_parameters


class DeepseekDecoderLayer(LlamaDecoderLayer):
    moe_cls = DeepseekMoE

    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        nn.Module.__init__(self)
        self.self_attn = MLAttention(config, target)
        dense = layer_idx < (config.first_k_dense_replace or 0)
        self.mlp = LlamaMLP(config, target) if dense else self.moe_cls(config, target,
                                                                        config.model_type == "deepseek_v3")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)


class DeepseekModel(LlamaModel):
    def make_rotary(self, config: PretrainedConfig, target: OpTarget) -> nn.Module:
        """Rotary turns only each query's and the shared key's qk_rope_head_dim part."""
        return RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings, rope_parameters(config), target)

    layer_cls = DeepseekDecoderLayer

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return self.layer_cls(config, target, layer_idx)


class DeepseekForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekModel
    # the shared experts' and dense layers' gate / up pack; attention keeps its own names
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        extra = getattr(config, "num_nextn_predict_layers", 0) or 0
        self.checkpoint_prefixes = {f"model.layers.{config.num_hidden_layers + i}.": None for i in range(extra)}

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """Routed experts into the stacks, kv_b_proj into the absorbed weight; None for the rest."""
        if name.endswith(".self_attn.kv_b_proj.weight"):
            return name.replace(".kv_b_proj.weight", ".kv_b_weight"), None
        if ".shared_experts." in name:
            return None
        return expert_weight_target(name, HF_EXPERT_NAMES)
