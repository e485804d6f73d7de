"""TII's Falcon-H1 (falcon_h1: 0.5B-34B, Falcon-H1R): every layer runs a Mamba-2 mixer and
attention side by side on the same normed input and adds their outputs, then an MLP
(transformers' FalconH1DecoderLayer), with muP multipliers throughout, applied where
transformers applies them:

- the mixer's input times ssm_in_multiplier, its projection's z / x / B / C / dt parts each
  times one of ssm_multipliers, its output times ssm_out_multiplier; SiLU(z) gates the scan
  alone, or around an RMSNorm per group (mamba_rms_norm, mamba_norm_before_gate);
- the attention's input times attention_in_multiplier, keys times key_multiplier (before
  rotary), output times attention_out_multiplier;
- the MLP's gate times the first of mlp_multipliers before SiLU, its output times the
  second; embeddings times embedding_multiplier, logits times lm_head_multiplier."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, Rope, add_and_norm
from tessera.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget


def mamba_shape(config: PretrainedConfig) -> Mamba2Shape:
    if config.hidden_act != "silu":
        raise ValueError(f"Falcon-H1 supports hidden_act 'silu' only, got {config.hidden_act!r}")
    inner = config.mamba_d_ssm or int(config.mamba_expand * config.hidden_size)
    if config.mamba_n_heads * config.mamba_d_head != inner:
        raise ValueError(f"Mamba-2: {config.mamba_n_heads} heads of {config.mamba_d_head} != its width {inner}")
    norm = ("none" if not config.mamba_rms_norm else "norm_first" if config.mamba_norm_before_gate else "gate_first")
    return Mamba2Shape(config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                       config.mamba_d_state, config.mamba_d_conv, bool(config.mamba_conv_bias),
                       bool(config.mamba_proj_bias), config.rms_norm_eps, tuple(config.time_step_limit), norm=norm,
                       in_multiplier=float(config.ssm_in_multiplier),
                       projection_multipliers=tuple(float(m) for m in config.ssm_multipliers),
                       out_proj_bias=bool(config.projectors_bias))


class FalconH1Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.key_multiplier = float(config.key_multiplier)
        self._scale = target.op("sum_and_scale")

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.key_multiplier != 1.0:
            k = self._scale(k, None, self.key_multiplier)
        q, k = self.rotary(q, k, rope)
        return self.o_proj(self.attn(q, k, v))


class FalconH1MLP(LlamaMLP):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)
        # the gate's columns times gate_multiplier, the up's times 1 (exact): one call
        self.gate_scales = None
        if self.gate_multiplier != 1.0:
            size, up = self.gate_up_proj.shard_sizes[0], self.gate_up_proj.shard_sizes[1]
            self.gate_scales = torch.cat((torch.full((size,), self.gate_multiplier), torch.ones(up))).to(
                target.device, target.dtype)
        self._scale = target.op("sum_and_scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_scales is not None:
            gate_up = self._scale(gate_up, None, self.gate_scales)
        return self._scale(self.down_proj(self.act_fn(gate_up)), None, self.down_multiplier)


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.mamba = Mamba2Mixer(mamba_shape(config), target)
        self.self_attn = FalconH1Attention(config, target)
        self.feed_forward = FalconH1MLP(config, target)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.ssm_out, self.attn_in, self.attn_out = (float(config.ssm_out_multiplier),
                                                     float(config.attention_in_multiplier),
                                                     float(config.attention_out_multiplier))
        self._scale = target.op("sum_and_scale")  # each product and the sum a kernel call

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        mixed = self._scale(self.mamba(rope, hidden), None, self.ssm_out)
        attended = self.self_attn(rope, self._scale(hidden, None, self.attn_in))
        mixed = self._scale(mixed, self._scale(attended, None, self.attn_out))
        hidden, residual = self.pre_ff_layernorm(mixed, residual)
        return self.feed_forward(hidden), residual


class FalconH1Model(LlamaModel):
    layer_cls = FalconH1DecoderLayer

    def embedding_scale(self, config: PretrainedConfig) -> float | None:
        return config.embedding_multiplier


class FalconH1ForCausalLM(LlamaForCausalLM):
    model_cls = FalconH1Model
    WEIGHT_NAMES = {".mamba.conv1d.weight": ".mamba.conv_weight", ".mamba.conv1d.bias": ".mamba.conv_bias",
                    ".mamba.norm.weight": ".mamba.norm_weight", "model.final_layernorm.weight": "model.norm.weight"}

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.lm_head_multiplier = float(config.lm_head_multiplier)

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        for theirs, ours in self.WEIGHT_NAMES.items():
            if name.endswith(theirs):
                return name[:-len(theirs)] + ours, None
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.lm_head_multiplier  # float32 rows
