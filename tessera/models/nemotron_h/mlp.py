"""Nemotron-H's MLP: up_proj, relu squared, down_proj, no gate (transformers' NemotronHMLP);
also each expert and the shared expert of its mixture of experts."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import Rope
from tessera.ops.activation import ReluSquared
from tessera.ops.linear import PackedLinear, RowParallelLinear
from tessera.ops.registry import OpTarget


def check_relu2(config: PretrainedConfig) -> None:
    if config.mlp_hidden_act != "relu2":
        raise ValueError(f"Nemotron-H MLP supports mlp_hidden_act 'relu2' only, got {config.mlp_hidden_act!r}")


class NemotronHMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget, intermediate_size: int | None = None):
        """`intermediate_size`: other than the config's (the MoE's shared experts)."""
        super().__init__()
        check_relu2(config)
        bias, size = bool(config.mlp_bias), intermediate_size or config.intermediate_size
        self.up_proj = PackedLinear(config.hidden_size, {0: size}, target, bias=bias)
        self.act_fn = ReluSquared(target)
        self.down_proj = RowParallelLinear(size, config.hidden_size, target, bias=bias)

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))
