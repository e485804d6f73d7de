"""The mixture of experts of Qwen3-Next and Qwen3.5-MoE: softmax top-k routed SwiGLU
experts plus one shared expert whose output is scaled by sigmoid(shared_expert_gate(x))
(transformers' Qwen3NextSparseMoeBlock). Qwen3-Next renormalises the top-k weights per
norm_topk_prob and keeps dense layers off its decoder_sparse_step grid; Qwen3.5-MoE
renormalises always and is sparse in every layer."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaMLP
from tessera.models.qwen3_moe.modeling import is_sparse_layer
from tessera.models.qwen3_next.modeling import Qwen3NextForCausalLM, Qwen3NextModel
from tessera.ops.linear import Linear
from tessera.ops.moe import HF_EXPERT_NAMES, SparseMoE, expert_weight_target
from tessera.ops.registry import OpTarget


class SharedExpertMoE(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget, renormalize: bool):
        super().__init__()
        self.routed = SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                config.num_experts_per_tok, renormalize=renormalize, target=target)
        self.shared_expert = LlamaMLP(config, target, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(config.hidden_size, 1, target)  # replicated: every rank gates
        self._scale_and_add = target.op("sigmoid_gate_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """routed(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)"""
        return self._scale_and_add(self.shared_expert(x), self.shared_expert_gate(x), self.routed(x))


class Qwen3NextMoeModel(Qwen3NextModel):
    def make_mlp(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        if config.model_type.startswith("qwen3_5_moe"):
            return SharedExpertMoE(config, target, renormalize=True)
        if is_sparse_layer(config, layer_idx):
            return SharedExpertMoE(config, target, renormalize=bool(config.norm_topk_prob))
        return LlamaMLP(config, target)


class Qwen3NextMoeForCausalLM(Qwen3NextForCausalLM):
    model_cls = Qwen3NextMoeModel

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """Routed experts into the stacks (the router `gate` and the experts live under
        `routed`), the conv weight as Qwen3NextForCausalLM maps it."""
        if ".mlp.gate." in name:
            return name.replace(".mlp.gate.", ".mlp.routed.gate."), None
        mapped = expert_weight_target(name.replace(".mlp.experts.", ".mlp.routed.experts."), HF_EXPERT_NAMES)
        return mapped if mapped is not None else super().map_weight_name(name)
