"""Bamba (IBM's Bamba-9B): a hybrid stack of Mamba-2 layers and Llama attention layers
(config.attn_layer_indices; rotary over half of each head), each followed by a SwiGLU MLP
(`feed_forward`), with Llama's norms (`input_layernorm`, `pre_ff_layernorm`,
`final_layernorm`). Granite 4.0-H (models/granitemoehybrid/) grew from it: the Mamba-2
mixer and its checkpoint names are that model's."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.granitemoehybrid.modeling import GraniteMoeHybridForCausalLM, block_types, mamba_shape
from tessera.models.llama.modeling import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, Rope, add_and_norm
from tessera.models.mamba2_mixer import Mamba2Mixer
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, block_type: str, target: OpTarget):
        super().__init__()
        self.is_mamba = block_type == "linear_attention"
        if self.is_mamba:
            self.mamba = Mamba2Mixer(mamba_shape(config), target)
        else:
            self.self_attn = LlamaAttention(config, target)
        self.feed_forward = LlamaMLP(config, target)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = (self.mamba if self.is_mamba else self.self_attn)(rope, hidden)
        hidden, residual = self.pre_ff_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class BambaModel(LlamaModel):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        self.types = block_types(config)
        if "full_attention" not in self.types:
            raise ValueError("bamba: no attention layer (attn_layer_indices); the engine needs one for its KV cache")
        super().__init__(config, target)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return BambaDecoderLayer(config, self.types[layer_idx], target)


class BambaForCausalLM(LlamaForCausalLM):
    model_cls = BambaModel
    checkpoint_prefixes = {"model.final_layernorm.": "model.norm."}

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """The Mamba-2 mixer's tensors as Granite 4.0-H's are named; None for the rest."""
        for theirs, ours in GraniteMoeHybridForCausalLM.WEIGHT_NAMES.items():
            if ".mamba." in theirs and name.endswith(theirs):
                return name[:-len(theirs)] + ours, None
        return None
