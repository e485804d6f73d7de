"""Qwen3-MoE: Qwen3 (per-head q_norm / k_norm) whose MLP is a sparse mixture of SwiGLU
experts (transformers' Qwen3MoeSparseMoeBlock): softmax, top-k, the k weights renormalised
only when config.norm_topk_prob. Layers listed in mlp_only_layers, or off the
decoder_sparse_step grid, keep a dense MLP of intermediate_size, as in transformers."""
from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaMLP, LlamaModel
from tessera.models.mixtral.modeling import check_silu
from tessera.models.qwen3.modeling import Qwen3DecoderLayer, Qwen3ForCausalLM
from tessera.ops.moe import HF_EXPERT_NAMES, SparseMoE, expert_weight_target
from tessera.ops.registry import OpTarget


def num_experts_of(config: PretrainedConfig) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """transformers' Qwen3MoeDecoderLayer rule."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or ())
            and num_experts_of(config) > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeSparseMoE(SparseMoE):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        check_silu(config)
        super().__init__(config.hidden_size, config.moe_intermediate_size, num_experts_of(config),
                         config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                         target=target)


class Qwen3MoeSparseLayer(Qwen3DecoderLayer):
    mlp_cls = Qwen3MoeSparseMoE


class Qwen3MoeDenseLayer(Qwen3DecoderLayer):
    mlp_cls = LlamaMLP


class Qwen3MoeModel(LlamaModel):
    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        """A sparse or a dense MLP, by transformers' rule for this index."""
        return (Qwen3MoeSparseLayer if is_sparse_layer(config, layer_idx) else Qwen3MoeDenseLayer)(config, target)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel  # Qwen3ForCausalLM refuses sliding-window configs

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """Per-expert tensors into the stacked parameters; None for the rest (dense layers'
        gate_proj / up_proj go through packed_modules_mapping)."""
        return expert_weight_target(name, HF_EXPERT_NAMES)
