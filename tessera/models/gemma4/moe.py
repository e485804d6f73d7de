"""Gemma 4's mixture of experts (the 26B A4B: transformers' Gemma4TextRouter and
Gemma4TextExperts). Every MoE layer keeps its dense MLP too; the experts run beside it on
the same residual stream, with their own norms (the decoder layer adds the two branches).

The router normalises its input without a weight, scales it by a learned vector and
1/sqrt(hidden), takes a float32 softmax over the experts, keeps the top k renormalised to
sum to 1, and multiplies each by its expert's learned per_expert_scale. The experts are
gelu_pytorch_tanh-gated MLPs stored stacked (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.distributed.parallel import all_reduce
from tessera.ops.activation import GeluTanhAndMul
from tessera.ops.linear import Linear
from tessera.ops.moe import StackedExperts
from tessera.ops.registry import OpTarget
from tessera.ops.weights import make_param


class Gemma4Router(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        size, num_experts = config.hidden_size, config.num_experts
        self.top_k, self.eps = config.top_k_experts, config.rms_norm_eps
        self.proj = Linear(size, num_experts, target)  # replicated: every rank routes
        self.scale = make_param((size,), target.dtype, target.device)
        self.per_expert_scale = make_param((num_experts,), target.dtype, target.device)
        self.root_size = size ** -0.5
        # the unit norm times `scale` is an RMSNorm with `scale` as its model-dtype weight
        # (both round the normed row, then the product); each step a kernel
        self._norm = target.op("rms_norm")
        self._times = target.op("sum_and_scale")
        self._route = target.op("moe_routing")  # float32 softmax, top k, renormalised, per-expert scales

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] float32, expert ids [T, k])."""
        normed = self._norm(x, self.scale, self.eps, None)[0]
        logits = self.proj(self._times(normed, None, self.root_size))
        return self._route(logits, self.top_k, True, self.per_expert_scale)


class Gemma4Experts(StackedExperts):
    """The stacks plus the grouped-experts op with Gemma's gated GELU; each rank runs its
    span of every expert and the ranks' outputs are summed."""

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts, target)
        self.tp_size = target.tp_size
        self.act_fn = GeluTanhAndMul(target)
        self._experts = target.op("moe_experts", quant=self.quant)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.stacks()
        return all_reduce(self._experts(x, w13, w2, weights, ids, None, None, self.act_fn), self.tp_size)
