"""ERNIE 4.5 (ernie4_5: the dense 0.3B; ernie4_5_moe: 21B-A3B, 300B-A47B): Llama's stack with
rotary on neighbouring pairs over the whole head (GLM's interleaved layout) and biases on
every projection where use_bias (the router maps it onto attention_bias / mlp_bias). The
MoE layers (every moe_layer_interval-th from moe_layer_start_index to moe_layer_end_index;
the rest dense) route by softmax, choose by the softmax scores plus a correction bias
(`moe_statics`), weigh the chosen scores renormalised (their sum clamped at moe_norm_min),
and add shared experts. The checkpoints' multi-token-prediction head is skipped."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.deepseek.modeling import IndexedLayersModel, IndexedMLPDecoderLayer
from tessera.models.deepseek.moe import RoutedMoE
from tessera.models.llama.modeling import LlamaAttention, LlamaForCausalLM, rotary_dim_of
from tessera.ops.moe import HF_EXPERT_NAMES, expert_weight_target
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import ApplyRotary
from tessera.ops.weights import make_param
from tessera.weights.lazy import materialize


class Ernie45Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.rotary = ApplyRotary(self.head_dim, target, rotary_dim_of(config), interleaved=True)


class Ernie45TopkRouter(nn.Module):
    """Softmax scores in float32; the choice adds `e_score_correction_bias`, the weights are
    the chosen scores over their sum (at least moe_norm_min)."""

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        experts = config.moe_num_experts
        self.top_k, self.norm_min = config.moe_k, config.moe_norm_min
        self.weight = make_param((experts, config.hidden_size), torch.float32, target.device)
        self.e_score_correction_bias = make_param((experts,), torch.float32, target.device, loader=self._load_bias)
        self._route = target.op("moe_scored_routing")

    @staticmethod
    def _load_bias(param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        """The checkpoint's [1, E] (one row per expert group: ERNIE has one) as [E]."""
        tensor = materialize(tensor)
        if tensor.numel() != param.numel():
            raise ValueError(f"e_score_correction_bias: checkpoint shape {tuple(tensor.shape)} != ({param.numel()},)")
        with torch.no_grad():
            param.data.copy_(tensor.reshape(-1).to(param.dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._route(x, self.top_k, bias=self.e_score_correction_bias, renormalize=True,
                           renorm_floor=self.norm_min, router_weight=self.weight)


class Ernie45MoE(RoutedMoE):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target, Ernie45TopkRouter(config, target), config.moe_num_experts,
                         config.moe_num_shared_experts)


def is_moe_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    if not getattr(config, "moe_num_experts", 0):
        return False
    return ((layer_idx + 1) % config.moe_layer_interval == 0
            and config.moe_layer_start_index <= layer_idx <= config.moe_layer_end_index)


class Ernie45DecoderLayer(IndexedMLPDecoderLayer):
    attention_cls = Ernie45Attention

    @staticmethod
    def dense(config: PretrainedConfig, layer_idx: int) -> bool:
        return not is_moe_layer(config, layer_idx)

    def moe(self, config: PretrainedConfig, target: OpTarget) -> nn.Module:
        return Ernie45MoE(config, target)


class Ernie45Model(IndexedLayersModel):
    layer_cls = Ernie45DecoderLayer


class Ernie45ForCausalLM(LlamaForCausalLM):
    model_cls = Ernie45Model

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        # Baidu's checkpoints carry a multi-token-prediction head (mtp_block, mtp_emb_norm,
        # mtp_hidden_norm, mtp_linear_proj), which transformers skips too
        self.checkpoint_prefixes = {"model.mtp_": None}

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """Routed experts into the stacks, the correction bias (Baidu's mlp.moe_statics or
        transformers' mlp.gate.moe_statics, shaped [1, E]) into the router; None for the rest."""
        if name.endswith(".moe_statics.e_score_correction_bias"):
            layer = name.split(".mlp.")[0]
            return f"{layer}.mlp.gate.e_score_correction_bias", None
        if ".shared_experts." in name:
            return None
        return expert_weight_target(name, HF_EXPERT_NAMES)
