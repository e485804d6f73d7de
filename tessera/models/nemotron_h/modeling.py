"""NVIDIA Nemotron-H (nemotron_h: Nemotron-H 8B / 47B, Nemotron Nano 9B / 12B v2): a stack of
single-mixer blocks (config.layers_block_type), each an RMSNorm, its mixer and the residual
add (transformers' NemotronHBlock):

- "linear_attention": the Mamba-2 mixer (models/mamba2_mixer.py), time steps at least
  time_step_min;
- "full_attention": attention without rotary (the Mamba layers carry position);
- "mlp": up_proj, relu squared, down_proj (no gate);
- "moe" (Nemotron 3): DeepSeek-V3's sigmoid router over groups, experts of the same
  gateless MLP (optionally in a smaller latent width), and a shared one (moe.py).

RMSNorms multiply the float32 normalised row by float32 weights and round once (a float32
weight, ops/norm.py). The checkpoint keeps the model under `backbone.` and names its
embedding `embeddings` and its final norm `norm_f`."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaAttention, LlamaForCausalLM, LlamaModel, Rope, add_and_norm
from tessera.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape
from tessera.models.nemotron_h.mlp import NemotronHMLP
from tessera.models.nemotron_h.moe import NemotronHMoE
from tessera.ops.norm import RMSNorm
from tessera.ops.moe import expert_weight_target
from tessera.ops.registry import OpTarget

# a gateless expert's checkpoint projections -> our stacks (moe.py's UpDownExperts)
UP_DOWN_EXPERT_NAMES = {"up_proj": ("w13_weight", 0), "down_proj": ("w2_weight", 0)}

BLOCK_TYPES = ("linear_attention", "full_attention", "mlp", "moe")


def mamba_shape(config: PretrainedConfig) -> Mamba2Shape:
    if config.mamba_hidden_act != "silu":
        raise ValueError(f"Mamba-2 supports mamba_hidden_act 'silu' only, got {config.mamba_hidden_act!r}")
    return Mamba2Shape(config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                       config.ssm_state_size, config.conv_kernel, bool(config.use_conv_bias), bool(config.use_bias),
                       config.layer_norm_epsilon, (float(config.time_step_min), float("inf")))


class NemotronHAttention(LlamaAttention):
    uses_rope = False

    @staticmethod
    def biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return False, False


class NemotronHBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, block_type: str, target: OpTarget):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, target, weight_dtype=torch.float32)
        if block_type == "linear_attention":
            self.mixer = Mamba2Mixer(mamba_shape(config), target)
        elif block_type == "full_attention":
            self.mixer = NemotronHAttention(config, target)
        elif block_type == "moe":
            self.mixer = NemotronHMoE(config, target)
        else:
            self.mixer = NemotronHMLP(config, target)

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.norm, hidden, residual)
        return self.mixer(rope, hidden), residual


class NemotronHModel(LlamaModel):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        self.types = list(config.layers_block_type)
        unknown = set(self.types) - set(BLOCK_TYPES)
        if unknown:
            raise ValueError(f"nemotron_h: unknown block types {sorted(unknown)}; supported: " + ", ".join(BLOCK_TYPES))
        if "full_attention" not in self.types:
            raise ValueError("nemotron_h: no attention block; the engine needs one for its KV cache")
        if getattr(config, "residual_in_fp32", False):
            raise ValueError("nemotron_h: residual_in_fp32 is not supported")
        config.rms_norm_eps = config.layer_norm_epsilon  # (LlamaModel's final norm reads this name)
        super().__init__(config, target)
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, target, weight_dtype=torch.float32)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return NemotronHBlock(config, self.types[layer_idx], target)


class NemotronHForCausalLM(LlamaForCausalLM):
    model_cls = NemotronHModel
    # the checkpoint's backbone.* is our model.*, with its own names for two modules
    checkpoint_prefixes = {"backbone.": "model."}
    # Q/K/V pack; the MLP's up_proj is a projection of its own (no gate)
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    WEIGHT_NAMES = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight"}
    MIXER_NAMES = {".mixer.conv1d.weight": ".mixer.conv_weight", ".mixer.conv1d.bias": ".mixer.conv_bias",
                   ".mixer.norm.weight": ".mixer.norm_weight"}

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        expert = expert_weight_target(name, UP_DOWN_EXPERT_NAMES)
        if expert is not None:
            return expert
        if name in self.WEIGHT_NAMES:
            return self.WEIGHT_NAMES[name], None
        for theirs, ours in self.MIXER_NAMES.items():
            if name.endswith(theirs):
                return name[:-len(theirs)] + ours, None
        return None
