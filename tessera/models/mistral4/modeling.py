"""Mistral 4 (Mistral Small 4): DeepSeek-V3's layers (multi-head latent attention over a
latent cache, shared and routed experts; models/deepseek/) with Mistral's router and Llama
4's attention temperature (models/ministral3/).

The router (transformers' Mistral4TopkRouter) scores experts by softmax, keeps the
topk_group groups with the largest sum of their two best scores, takes the top k experts
among them, renormalises their scores when norm_topk_prob, and scales them by
routed_scaling_factor; no correction bias."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig

from tessera.models.deepseek.modeling import DeepseekDecoderLayer, DeepseekForCausalLM, DeepseekModel
from tessera.models.deepseek.moe import DeepseekMoE, DeepseekTopkRouter
from tessera.models.ministral3.modeling import Llama4QueryTemperature
from tessera.ops.registry import OpTarget


class Mistral4TopkRouter(DeepseekTopkRouter):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target, v3=False)
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        if self.num_experts % self.groups or self.num_experts // self.groups < 2:
            raise ValueError(f"mistral4 routing needs at least two experts in each of its {self.groups} groups "
                             f"({self.num_experts} experts)")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] float32, expert ids [T, k])."""
        return self._route(x, self.top_k, groups=self.groups, topk_group=self.topk_group, group_rule="top2_sum",
                           renormalize=self.renormalize, renorm_eps=1e-20, scaling=self.scaling,
                           router_weight=self.weight)


class Mistral4MoE(DeepseekMoE):
    def __init__(self, config: PretrainedConfig, target: OpTarget, v3: bool = False):
        super().__init__(config, target, v3=False)
        self.gate = Mistral4TopkRouter(config, target)  # replicated: every rank routes


class Mistral4DecoderLayer(DeepseekDecoderLayer):
    moe_cls = Mistral4MoE


class Mistral4Model(Llama4QueryTemperature, DeepseekModel):
    layer_cls = Mistral4DecoderLayer


class Mistral4ForCausalLM(DeepseekForCausalLM):
    model_cls = Mistral4Model
