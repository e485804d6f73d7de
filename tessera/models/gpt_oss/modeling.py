"""OpenAI's gpt-oss (transformers' GptOssForCausalLM): the Llama stack with biased Q/K/V/O
projections, an attention sink per query head (a learned logit in every softmax's
denominator), sliding-window attention (128 tokens) on alternate layers, YaRN rotary, and a
mixture of experts whose router has a bias, whose experts have biases and apply a clamped
SwiGLU ((up + 1) * gate * sigmoid(1.702 * gate), gate <= 7, |up| <= 7). The norms keep
float32 weights (RMSNorm's weight_dtype), as transformers keeps them (_keep_in_fp32_modules).

Checkpoints store each layer's experts stacked as x @ W ([E, H, 2I] with gate and up
columns interleaved, [E, I, H]), or, in OpenAI's releases, in MXFP4 ([E, 2I, H / 32, 16]
blocks and their scales, rows interleaved). MXFP4 stacks stay packed where a builder runs
them (ops/moe_mxfp4.py: CPUs, and CUDA in bf16 / fp16 through Triton), and load dequantized
to the model dtype elsewhere."""
from __future__ import annotations

from typing import Hashable

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, Rope
from tessera.ops.activation import ClampedSwiGLU
from tessera.ops.moe import GATE, HF_EXPERT_NAMES, UP, SparseMoE, StackedExperts, expert_weight_target
from tessera.ops.moe_mxfp4 import Mxfp4Experts, mxfp4_experts_available
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget
from tessera.ops.weights import copy_checked, make_param
from tessera.weights.lazy import materialize, narrow
from tessera.weights.prequantized import checkpoint_quantization


class GptOssAttention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        self.sliding = config.layer_types[layer_idx] == "sliding_attention"  # read by attention_options()
        super().__init__(config, target)
        self.head_span = self.qkv_proj.heads.q  # this rank's query heads
        self.full_num_heads = config.num_attention_heads
        self.sinks = make_param((self.num_heads,), torch.float32, target.device, loader=self._load_sinks)

    def attention_options(self, config: PretrainedConfig) -> dict:
        return {"scale": self.head_dim ** -0.5, "sinks": True,
                "sliding_window": config.sliding_window if self.sliding else None}

    def _load_sinks(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        if tuple(tensor.shape) != (self.full_num_heads,):
            raise ValueError(f"attention sinks: checkpoint shape {tuple(tensor.shape)} != ({self.full_num_heads},)")
        with torch.no_grad():
            copy_checked(param.data, narrow(tensor, 0, self.head_span.start, self.head_span.size), "attention sinks")

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.o_proj(self.attn(q, k, v, sinks=self.sinks, rotary=self.rotary, rope=rope))


def _gate_then_up(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Dim `dim` (2I long) with gate and up interleaved (gate_0, up_0, gate_1, ...) -> the gate
    half, then the up half."""
    before = (slice(None),) * (dim % tensor.dim())
    return torch.cat((tensor[(*before, slice(0, None, 2))], tensor[(*before, slice(1, None, 2))]), dim=dim)


class GptOssExperts(StackedExperts):
    """StackedExperts fed from gpt-oss's layout: gate_up_proj [E, H, 2I] and its bias [E, 2I]
    with gate and up interleaved, down_proj [E, I, H] (all x @ W)."""

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        if shard_id is not None:  # one expert's projection as nn.Linear holds it (a GGUF's)
            return super()._load(param, tensor, shard_id)
        # transposed here, not by shape: gpt-oss's hidden and intermediate sizes are equal
        tensor = materialize(tensor)
        if tensor.dim() != 3:
            raise ValueError(f"stacked experts: expected a 3-D tensor, got shape {tuple(tensor.shape)}")
        if param is self.w13_weight:
            tensor = _gate_then_up(tensor)  # [E, H, 2I], gate columns then up columns
        super()._load(param, tensor.transpose(1, 2), shard_id)

    def _load_bias(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        super()._load_bias(param, tensor if shard_id is not None else _gate_then_up(materialize(tensor)), shard_id)


class Mxfp4GptOssExperts(Mxfp4Experts):
    """Mxfp4Experts fed from gpt-oss's files, whose w13 rows (and bias) interleave gate and up."""

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        if shard_id is None and (param is self.w13_blocks or param is self.w13_scales or param is self.w13_bias):
            tensor = _gate_then_up(materialize(tensor), dim=1)  # rows: [E, 2I, ...]
        super()._load(param, tensor, shard_id)


def keeps_mxfp4_experts(config: PretrainedConfig, target: OpTarget) -> bool:
    """An MXFP4 checkpoint whose stacks some builder runs packed on `target`."""
    quant = checkpoint_quantization(config)
    return quant is not None and quant.method == "mxfp4" and mxfp4_experts_available(target)


class GptOssMoE(SparseMoE):
    """Router with a bias: top-k of the logits, softmax over those k (the same weights as a
    softmax over all experts renormalised over the top k)."""

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config.hidden_size, config.intermediate_size, config.num_local_experts,
                         config.num_experts_per_tok, renormalize=True, target=target, bias=True,
                         activation=ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit, target),
                         experts_cls=Mxfp4GptOssExperts if keeps_mxfp4_experts(config, target) else GptOssExperts)


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(config, target, layer_idx)
        self.mlp = GptOssMoE(config, target)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target, weight_dtype=torch.float32)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target, weight_dtype=torch.float32)


class GptOssModel(LlamaModel):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, target, weight_dtype=torch.float32)

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return GptOssDecoderLayer(config, target, layer_idx)


# checkpoint names under a layer's mlp -> ours (dense stacks, or MXFP4's parts)
_MLP_NAMES = {"router.weight": "gate.weight", "router.bias": "gate.bias",
              "experts.gate_up_proj": "experts.w13_weight", "experts.gate_up_proj_bias": "experts.w13_bias",
              "experts.down_proj": "experts.w2_weight", "experts.down_proj_bias": "experts.w2_bias",
              **{f"experts.{proj}_{part}": f"experts.{stack}_{part}" for proj, stack in
                 (("gate_up_proj", "w13"), ("down_proj", "w2")) for part in ("blocks", "scales")}}
# a GGUF's gate and up stacks apart (weights/gguf.py names them so): halves of w13
_GGUF_HALVES = {f"experts.{half}_proj_{part}": (f"experts.w13_{part}", half)
                for half in (GATE, UP) for part in ("blocks", "scales", "bias")}


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        # the checkpoint's MXFP4 parts reach the model as stored (base.py's iter_weights)
        self.packed_checkpoint_methods = ("mxfp4",) if keeps_mxfp4_experts(config, target) else ()

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        """The router and stacked experts (whole tensors: shard None; a GGUF's gate and up
        halves, or its experts one by one, as shards); None for the rest."""
        prefix, sep, rest = name.partition(".mlp.")
        if sep and rest in _MLP_NAMES:
            return f"{prefix}.mlp.{_MLP_NAMES[rest]}", None
        if sep and rest in _GGUF_HALVES:
            target, half = _GGUF_HALVES[rest]
            return f"{prefix}.mlp.{target}", half
        return expert_weight_target(name, HF_EXPERT_NAMES)  # one expert's projection (a dequantized GGUF)
