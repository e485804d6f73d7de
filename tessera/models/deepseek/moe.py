"""DeepSeek's mixture of experts: routed SwiGLU experts plus always-on shared experts, a
router in float32 (transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter).

- V2: softmax over the experts; top-k ("greedy"), or top-k within the topk_group groups
  whose best expert scores highest ("group_limited_greedy"); weights not renormalised.
- V3 ("noaux_tc"): sigmoid scores; the choice adds e_score_correction_bias and keeps the
  topk_group groups with the largest sum of their two best; the weights are the scores
  without the bias, renormalised when norm_topk_prob.
Both multiply the weights by routed_scaling_factor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tessera.distributed.parallel import all_reduce
from tessera.models.llama.modeling import LlamaMLP
from tessera.models.mixtral.modeling import check_silu
from tessera.ops.moe import StackedExperts
from tessera.ops.registry import OpTarget
from tessera.ops.weights import make_param


def _keep_groups(scores: torch.Tensor, group_scores: torch.Tensor, keep: int, fill: float) -> torch.Tensor:
    """`scores` [T, E] with the experts outside the `keep` best groups set to `fill`."""
    tokens, groups = group_scores.shape
    chosen = torch.topk(group_scores, k=keep, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    mask = mask.unsqueeze(-1).expand(tokens, groups, scores.shape[1] // groups).reshape(tokens, -1)
    return scores.masked_fill(~mask, fill)


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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] float32, expert ids [T, k])."""
        logits = F.linear(x.float(), self.weight)
        tokens = logits.shape[0]
        if self.v3:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            best_two = choice.view(tokens, self.groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
            choice = _keep_groups(choice, best_two, self.topk_group, float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy":
                best = scores.view(tokens, self.groups, -1).max(dim=-1).values
                scores = _keep_groups(scores, best, self.topk_group, 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, ids


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        w13, w2 = self.experts.stacks()
        out = all_reduce(self._experts(x, w13, w2, weights, ids), self.tp_size)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekMoE(RoutedMoE):
    def __init__(self, config: PretrainedConfig, target: OpTarget, v3: bool):
        super().__init__(config, target, DeepseekTopkRouter(config, target, v3), config.n_routed_experts,
                         config.n_shared_experts)
        self.top_k = config.num_experts_per_tok
