"""MiniMax-M2 / M2.1 / M2.5 (minimax_m2): Llama's pre-norm stack with an RMSNorm over the
whole query and key projections before rotary (OLMo 2's: ProjectionNormForward), rotary
over part of each head (the released configs' rotary_dim, which transformers reads as
partial_rotary_factor), and a mixture of SwiGLU experts in every layer: sigmoid scores,
the choice adding the correction bias, the chosen scores renormalised (DeepSeek-V3's
router in one group, unscaled), no shared experts.

The published checkpoints name the experts as Mixtral's (block_sparse_moe.experts.N.w1 /
w3 / w2, block_sparse_moe.gate) and the bias beside the gate
(block_sparse_moe.e_score_correction_bias); transformers writes mlp.experts' stacks and
mlp.e_score_correction_bias. Both load."""
from __future__ import annotations

from types import SimpleNamespace

from transformers import PretrainedConfig

from tessera.models.deepseek.moe import DeepseekMoE
from tessera.models.llama.modeling import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from tessera.models.olmo2.modeling import ProjectionNormForward
from tessera.ops.moe import HF_EXPERT_NAMES, MIXTRAL_EXPERT_NAMES, expert_weight_target
from tessera.ops.registry import OpTarget


class MiniMaxM2Attention(ProjectionNormForward, LlamaAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.make_projection_norms(config, target)

    @staticmethod
    def biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return False, False


class MiniMaxM2MoE(DeepseekMoE):
    """DeepSeek-V3's noaux_tc routing with one group, renormalised, unscaled; no shared experts."""

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        routing = SimpleNamespace(
            hidden_size=config.hidden_size, hidden_act=config.hidden_act, n_routed_experts=config.num_local_experts,
            num_experts_per_tok=config.num_experts_per_tok, moe_intermediate_size=config.intermediate_size,
            routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True, n_shared_experts=0,
            model_type=config.model_type)
        super().__init__(routing, target, v3=True)


class MiniMaxM2DecoderLayer(LlamaDecoderLayer):
    attention_cls = MiniMaxM2Attention
    mlp_cls = MiniMaxM2MoE


class MiniMaxM2Model(LlamaModel):
    layer_cls = MiniMaxM2DecoderLayer


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    model_cls = MiniMaxM2Model

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        # the released configs' multi-token-prediction modules (num_mtp_modules), as layers
        # num_hidden_layers on where a checkpoint holds them: not served
        extra = getattr(config, "num_mtp_modules", 0) or 0
        self.checkpoint_prefixes = {f"model.layers.{config.num_hidden_layers + i}.": None for i in range(extra)}

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """Experts into the stacks and the correction bias into the router, in either
        layout; None for the rest."""
        published = ".block_sparse_moe." in name
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name.endswith(".mlp.e_score_correction_bias"):
            return name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"), None
        target = expert_weight_target(name, MIXTRAL_EXPERT_NAMES if published else HF_EXPERT_NAMES)
        return target or ((name, None) if published else None)
