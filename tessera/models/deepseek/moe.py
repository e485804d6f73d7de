"""DeepSeek's mixture of experts: routed SwiGLU experts plus always-on shared experts, a
router in float32 (transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter).

- V2: softmax over the experts; top-k ("greedy"), or top-k within the topk_group groups
  whose best expert scores highest ("group_limited_greedy"); weights not renormalised.
- V3 ("noaux_tc"): sigmoid scores; the choice adds e_score_correction_bias and keeps the
  topk_group groups with the largest sum of their two best; the weights are the scores
  without the bias, renormalised when norm_topk_prob.
Both multiply the weights by routed_scaling_factor; both are the `moe_scored_routing` op
(ops/moe.py: scored_topk_ref; one C call on CPU, the float32 router GEMV included).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.distributed.parallel import all_reduce
from tessera.models.llama.modeling import LlamaMLP
from tessera.models.mixtral.modeling import check_silu
from tessera.ops.moe import StackedExperts
from tessera.ops.registry import OpTarget
from tessera.ops.weights import make_param


class DeepseekTopkRouter(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget, v3: bool):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k, self.scaling = config.num_experts_per_tok, config.routed_scaling_factor
        self.groups, self.topk_group = config.n_group or 1, config.topk_group or 1
        self.v3 = v3
        self.method = "noaux_tc" if v3 else getattr(config, "topk_method", "greedy")
        if self.method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"DeepSeek routing {self.method!r} is not supported")
        self.renormalize = bool(getattr(config, "norm_topk_prob", False)) and v3
        # float32 whatever the model dtype, as transformers keeps it
        self.weight = make_param((self.num_experts, config.hidden_size), torch.float32, target.device)
        self.e_score_correction_bias = (make_param((self.num_experts,), torch.float32, target.device)
                                        if v3 else None)
        self._route = target.op("moe_scored_routing")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] float32, expert ids [T, k])."""
        if self.v3:
            return self._route(x, self.top_k, sigmoid=True, bias=self.e_score_correction_bias, groups=self.groups,
                               topk_group=self.topk_group, group_rule="top2_sum", renormalize=self.renormalize,
                               renorm_eps=1e-20, scaling=self.scaling, router_weight=self.weight)
        groups = self.groups if self.method == "group_limited_greedy" else 1
        return self._route(x, self.top_k, groups=groups, topk_group=self.topk_group if groups > 1 else 1,
                           group_rule="max", scaling=self.scaling, router_weight=self.weight)


class RoutedMoE(nn.Module):
    """A router's top-k SwiGLU experts (stacked, split over the ranks) plus shared experts
    beside them: `gate(x)` -> (weights [T, k] float32, expert ids [T, k])."""

    def __init__(self, config: PretrainedConfig, target: OpTarget, gate: nn.Module, num_experts: int,
                 num_shared: int):
        super().__init__()
        check_silu(config)
        self.gate = gate  # replicated: every rank routes
        self.num_experts = num_experts
        self.experts = StackedExperts(config.hidden_size, config.moe_intermediate_size, num_experts, target)
        shared = config.moe_intermediate_size * (num_shared or 0)
        self.shared_experts = LlamaMLP(config, target, shared) if shared else None
        self.tp_size = target.tp_size
        self._experts = target.op("moe_experts", quant=self.experts.quant)
        self._add = target.op("sum_and_scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        w13, w2 = self.experts.stacks()
        out = all_reduce(self._experts(x, w13, w2, weights, ids), self.tp_size)
        return out if self.shared_experts is None else self._add(out, self.shared_experts(x))


class DeepseekMoE(RoutedMoE):
    def __init__(self, config: PretrainedConfig, target: OpTarget, v3: bool):
        super().__init__(config, target, DeepseekTopkRouter(config, target, v3), config.n_routed_experts,
                         config.n_shared_experts)
        self.top_k = config.num_experts_per_tok
