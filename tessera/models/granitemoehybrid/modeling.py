"""IBM Granite 4.0 (granitemoehybrid): Granite's multipliers over a hybrid stack of Mamba-2
layers and attention layers (config.layers_block_type / layer_types), each followed by a
mixture of experts plus a shared MLP (or the shared MLP alone where there are no experts).

- Mamba-2 layers (models/mamba2_mixer.py; transformers' GraniteMoeHybridMambaLayer).
- Attention layers: Granite's (scores scaled by attention_multiplier), with rotary only
  where position_embedding_type is "rope" (the Granite 4.0-H releases use none).
- MoE: softmax over the top-k router logits (= the renormalised top-k of a softmax) and
  stacked SwiGLU experts stored as input_linear [E, 2I, H] / output_linear [E, H, I]; the
  shared MLP's input_linear packs gate then up.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.granite.modeling import GraniteAttention
from tessera.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape
from tessera.models.llama.modeling import LlamaForCausalLM, LlamaMLP, LlamaModel, Rope, add_and_norm
from tessera.ops.moe import MIXTRAL_EXPERT_NAMES, SparseMoE, expert_weight_target
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget

BLOCK_TYPES = ("linear_attention", "full_attention")


def block_types(config: PretrainedConfig) -> list[str]:
    types = list(getattr(config, "layers_block_type", None) or config.layer_types)
    unknown = set(types) - set(BLOCK_TYPES)
    if unknown:
        raise ValueError(f"{config.model_type}: unknown layer types {sorted(unknown)}")
    return types


def mamba_shape(config: PretrainedConfig) -> Mamba2Shape:
    if config.hidden_act != "silu":
        raise ValueError(f"Mamba-2 supports hidden_act 'silu' only, got {config.hidden_act!r}")
    inner = int(config.mamba_expand * config.hidden_size)
    if config.mamba_n_heads * config.mamba_d_head != inner:
        raise ValueError(f"Mamba-2: {config.mamba_n_heads} heads of {config.mamba_d_head} != expand x hidden = {inner}")
    return Mamba2Shape(config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                       config.mamba_d_state, config.mamba_d_conv, bool(config.mamba_conv_bias),
                       bool(config.mamba_proj_bias), config.rms_norm_eps,
                       tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf"))))


class GraniteHybridAttention(GraniteAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.uses_rope = getattr(config, "position_embedding_type", None) == "rope"


class SharedMLP(LlamaMLP):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target, config.shared_intermediate_size)


class ExpertsAndShared(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.block_sparse_moe = SparseMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                                          config.num_experts_per_tok, renormalize=True, target=target)
        self.shared_mlp = SharedMLP(config, target)
        self._sum = target.op("sum_and_scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._sum(self.block_sparse_moe(x), self.shared_mlp(x))


class GraniteHybridDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, block_type: str, target: OpTarget):
        super().__init__()
        self.is_mamba = block_type == "linear_attention"
        if self.is_mamba:
            self.mamba = Mamba2Mixer(mamba_shape(config), target)
        else:
            self.self_attn = GraniteHybridAttention(config, target)
        self.mlp = ExpertsAndShared(config, target) if config.num_local_experts > 0 else SharedMLP(config, target)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.residual_multiplier = config.residual_multiplier
        self._scale = target.op("sum_and_scale")

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.residual_multiplier
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self._scale((self.mamba if self.is_mamba else self.self_attn)(rope, hidden), None, m)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self._scale(self.mlp(hidden), None, m), residual


class GraniteHybridModel(LlamaModel):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        self.types = block_types(config)
        if "full_attention" not in self.types:
            raise ValueError("granitemoehybrid: no attention layer; the engine needs one for its KV cache")
        super().__init__(config, target)

    def embedding_scale(self, config: PretrainedConfig) -> float | None:
        return config.embedding_multiplier

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return GraniteHybridDecoderLayer(config, self.types[layer_idx], target)


class GraniteMoeHybridForCausalLM(LlamaForCausalLM):
    model_cls = GraniteHybridModel
    # checkpoint name -> ours: the Mamba conv, the experts' stacks, the router, the shared MLP
    WEIGHT_NAMES = {".mamba.conv1d.weight": ".mamba.conv_weight", ".mamba.conv1d.bias": ".mamba.conv_bias",
                    ".mamba.norm.weight": ".mamba.norm_weight",
                    ".block_sparse_moe.router.layer.weight": ".mlp.block_sparse_moe.gate.weight",
                    ".block_sparse_moe.input_linear.weight": ".mlp.block_sparse_moe.experts.w13_weight",
                    ".block_sparse_moe.output_linear.weight": ".mlp.block_sparse_moe.experts.w2_weight"}

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.logits_scaling = config.logits_scaling
        self.has_experts = config.num_local_experts > 0

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        for theirs, ours in self.WEIGHT_NAMES.items():
            if name.endswith(theirs):
                return name[:-len(theirs)] + ours, None
        # a GGUF's experts one by one (w1 gate, w3 up, w2 down)
        expert = expert_weight_target(name.replace(".block_sparse_moe.", ".mlp.block_sparse_moe."),
                                      MIXTRAL_EXPERT_NAMES)
        if expert is not None:
            return expert
        for theirs, (ours, shard) in {".shared_mlp.input_linear.weight": (".gate_up_proj.weight", None),
                                      ".shared_mlp.output_linear.weight": (".down_proj.weight", None)}.items():
            if name.endswith(theirs):
                prefix = ".mlp.shared_mlp" if self.has_experts else ".mlp"
                return name[:-len(theirs)] + prefix + ours, shard
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling  # float32 rows
