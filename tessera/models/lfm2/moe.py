"""LFM2-MoE (lfm2_moe: LFM2-8B-A1B): LFM2's layers whose feed-forward is, past the first
num_dense_layers, a mixture of SwiGLU experts (transformers' Lfm2MoeSparseMoeBlock): the
router's sigmoid scores choose the top k after adding expert_bias (when use_expert_bias),
the chosen scores renormalised (norm_topk_prob) and scaled by routed_scaling_factor."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.distributed.parallel import all_reduce
from tessera.models.lfm2.modeling import Lfm2ForCausalLM, Lfm2MLP, Lfm2Model
from tessera.ops.linear import Linear
from tessera.ops.moe import MIXTRAL_EXPERT_NAMES, StackedExperts, expert_weight_target
from tessera.ops.registry import OpTarget
from tessera.ops.weights import make_param


class Lfm2MoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        self.top_k, self.renormalize = config.num_experts_per_tok, bool(config.norm_topk_prob)
        self.scaling = float(config.routed_scaling_factor)
        self.gate = Linear(config.hidden_size, config.num_experts, target)  # replicated: every rank routes
        self.expert_bias = (make_param((config.num_experts,), torch.float32, target.device)
                            if config.use_expert_bias else None)
        self.experts = StackedExperts(config.hidden_size, config.moe_intermediate_size, config.num_experts, target)
        self.tp_size = target.tp_size
        self._experts = target.op("moe_experts", quant=self.experts.quant)
        self._route = target.op("moe_scored_routing")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] float32, expert ids [T, k])."""
        return self._route(self.gate(x), self.top_k, sigmoid=True, bias=self.expert_bias,
                           renormalize=self.renormalize, renorm_eps=1e-6, scaling=self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        w13, w2 = self.experts.stacks()
        return all_reduce(self._experts(x, w13, w2, weights, ids), self.tp_size)


class Lfm2MoeModel(Lfm2Model):
    def mlp_cls_for(self, config: PretrainedConfig, layer_idx: int) -> type:
        return Lfm2MLP if layer_idx < config.num_dense_layers else Lfm2MoeBlock


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    model_cls = Lfm2MoeModel

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """The experts' w1 / w3 / w2 into the stacks; the router and its bias; the rest as LFM2."""
        for theirs in (".feed_forward.gate.", ".feed_forward.expert_bias"):
            if theirs in name:
                return name.replace(".feed_forward.", ".mlp."), None
        expert = expert_weight_target(name.replace(".feed_forward.", ".mlp."), MIXTRAL_EXPERT_NAMES)
        return expert if expert is not None else super().map_weight_name(name)
