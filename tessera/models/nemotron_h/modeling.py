"""NVIDIA Nemotron-H (nemotron_h: Nemotron-H 8B / 47B, Nemotron Nano 9B / 12B v2): a stack of
single-mixer blocks (config.layers_block_type), each an RMSNorm, its mixer and the residual
add (transformers' NemotronHBlock):

- "linear_attention": the Mamba-2 mixer (models/mamba2_mixer.py), time steps at least
  time_step_min;
- "full_attention": attention without rotary (the Mamba layers carry position);
- "mlp": up_proj, relu squared, down_proj (no gate).

RMSNorms multiply the float32 normalised row by float32 weights and round once (a float32
weight, ops/norm.py). The checkpoint keeps the model under `backbone.` and names its
embedding `embeddings` and its final norm `norm_f`. Mixture-of-experts blocks ("moe":
Nemotron 3's latent, non-gated experts) are not built yet and are refused."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaAttention, LlamaForCausalLM, LlamaModel, Rope, add_and_norm
from tessera.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape
from tessera.ops.activation import ReluSquared
from tessera.ops.linear import PackedLinear, RowParallelLinear
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget

BLOCK_TYPES = ("linear_attention", "full_attention", "mlp")


def mamba_shape(config: PretrainedConfig) -> Mamba2Shape:
    if config.mamba_hidden_act != "silu":
        raise ValueError(f"Mamba-2 supports mamba_hidden_act 'silu' only, got {config.mamba_hidden_act!r}")
    return Mamba2Shape(config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                       config.ssm_state_size, config.conv_kernel, bool(config.use_conv_bias), bool(config.use_bias),
                       config.layer_norm_epsilon, (float(config.time_step_min), float("inf")))


class NemotronHAttention(LlamaAttention):
    @staticmethod
    def biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return False, False

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.o_proj(self.attn(q, k, v))  # no rotary


class NemotronHMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        if config.mlp_hidden_act != "relu2":
            raise ValueError(f"Nemotron-H MLP supports mlp_hidden_act 'relu2' only, got {config.mlp_hidden_act!r}")
        bias = bool(config.mlp_bias)
        self.up_proj = PackedLinear(config.hidden_size, {0: config.intermediate_size}, target, bias=bias)
        self.act_fn = ReluSquared(target)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, target, bias=bias)

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class NemotronHBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, block_type: str, target: OpTarget):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, target, weight_dtype=torch.float32)
        if block_type == "linear_attention":
            self.mixer = Mamba2Mixer(mamba_shape(config), target)
        elif block_type == "full_attention":
            self.mixer = NemotronHAttention(config, target)
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
            raise ValueError(f"nemotron_h: {sorted(unknown)} blocks are not supported yet (Nemotron 3's "
                             "mixture-of-experts blocks among them); supported: " + ", ".join(BLOCK_TYPES))
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
        if name in self.WEIGHT_NAMES:
            return self.WEIGHT_NAMES[name], None
        for theirs, ours in self.MIXER_NAMES.items():
            if name.endswith(theirs):
                return name[:-len(theirs)] + ours, None
        return None
