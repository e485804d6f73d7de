"""Nemotron 3's mixture of experts (transformers' NemotronHMoE): DeepSeek-V3's router (sigmoid
scores, a correction bias for the choice, the best groups by their two best experts, the
weights renormalised and scaled), experts that are gateless MLPs (up_proj, relu squared,
down_proj), run in a smaller latent width where moe_latent_size says so (fc1 into it before
the experts, fc2 out of it after their weighted sum), and a shared gateless MLP of the
block's input.

Under tensor parallelism each rank holds a span of every expert's intermediate dimension
(as StackedExperts does), so the ranks' partial sums are all-reduced before fc2; the router
and the latent projections are replicated."""
from __future__ import annotations

from typing import Hashable

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.distributed.parallel import all_reduce, even_span
from tessera.models.deepseek.moe import DeepseekTopkRouter
from tessera.models.llama.modeling import Rope
from tessera.models.nemotron_h.mlp import NemotronHMLP, check_relu2
from tessera.ops.activation import ReluSquared
from tessera.ops.linear import Linear
from tessera.ops.moe import ExpertStacks
from tessera.ops.registry import OpTarget
from tessera.ops.weights import copy_checked, make_param
from tessera.weights.lazy import narrow


class UpDownExperts(ExpertStacks):
    """Stacks of gateless experts: w13 [E, I, width] (up rows only), w2 [E, width, I]; this
    rank's span of I."""

    def __init__(self, width: int, intermediate_size: int, num_experts: int, target: OpTarget):
        super().__init__(target)
        self.full_intermediate = intermediate_size
        self.span = even_span(intermediate_size, target.tp_rank, target.tp_size)
        local, shards = self.span.size, tuple((e, 0) for e in range(num_experts))
        self.w13_weight = make_param((num_experts, local, width), target.dtype, target.device, loader=self._load,
                                     shard_ids=shards)
        self.w2_weight = make_param((num_experts, width, local), target.dtype, target.device, loader=self._load,
                                    shard_ids=shards)
        self.w13_bias = self.w2_bias = None

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        if shard_id is None:
            raise ValueError("gateless experts load one expert's up_proj / down_proj at a time")
        expert, _ = shard_id
        if not 0 <= expert < param.shape[0]:
            raise KeyError(f"expert {expert} out of range; this layer has {param.shape[0]} experts")
        up = param is self.w13_weight
        width = param.shape[2] if up else param.shape[1]
        expected = (self.full_intermediate, width) if up else (width, self.full_intermediate)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"expert {expert}: checkpoint shape {tuple(tensor.shape)} != model shape {expected}")
        with torch.no_grad():  # up: this rank's rows of I; down: its columns
            copy_checked(param.data[expert], narrow(tensor, 0 if up else 1, self.span.start, self.span.size),
                         f"expert {expert}")


class NemotronHMoE(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        check_relu2(config)
        self.gate = DeepseekTopkRouter(config, target, v3=True)
        latent = getattr(config, "moe_latent_size", None)
        bias = bool(config.mlp_bias)
        self.fc1_latent_proj = Linear(config.hidden_size, latent, target, bias=bias) if latent else None
        self.fc2_latent_proj = Linear(latent, config.hidden_size, target, bias=bias) if latent else None
        self.experts = UpDownExperts(latent or config.hidden_size, config.moe_intermediate_size,
                                     config.n_routed_experts, target)
        self.shared_experts = NemotronHMLP(config, target, config.moe_shared_expert_intermediate_size)
        self.act_fn = ReluSquared(target)
        self.tp_size = target.tp_size
        self._experts = target.op("moe_experts", quant=self.experts.quant)
        self._add = target.op("sum_and_scale")

    def forward(self, rope: Rope, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        inner = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        w13, w2 = self.experts.stacks()
        routed = all_reduce(self._experts(inner, w13, w2, weights, ids, None, None, self.act_fn), self.tp_size)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return self._add(routed, self.shared_experts(rope, x))
