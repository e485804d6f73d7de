"""Mixtral: Llama whose MLP is a sparse mixture of SwiGLU experts (transformers'
MixtralSparseMoeBlock): softmax over the router logits, top-k experts, the k weights
renormalised to sum to 1. Built by swapping the MLP class into the Llama stack."""
from __future__ import annotations

from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from tessera.ops.moe import MIXTRAL_EXPERT_NAMES, SparseMoE, expert_weight_target
from tessera.ops.registry import OpTarget


def check_silu(config: PretrainedConfig) -> None:
    if config.hidden_act != "silu":
        raise ValueError(f"{config.model_type}: experts support hidden_act 'silu' only, "
                         f"got {config.hidden_act!r}")


class MixtralMoE(SparseMoE):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        check_silu(config)
        super().__init__(config.hidden_size, config.intermediate_size, config.num_local_experts,
                         config.num_experts_per_tok, renormalize=True, target=target)


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_cls = MixtralMoE


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        if getattr(config, "sliding_window", None) is not None:
            # tessera's paged attention is full causal attention; refuse rather than differ
            raise ValueError(f"mixtral: sliding window attention is not supported yet "
                             f"(config has sliding_window={config.sliding_window})")
        super().__init__(config, target)

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """Checkpoint names the packed-fragment mapping cannot express; None for the rest."""
        if ".block_sparse_moe." not in name:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")  # the Llama layer's MLP slot
        return expert_weight_target(name, MIXTRAL_EXPERT_NAMES) or (name, None)
