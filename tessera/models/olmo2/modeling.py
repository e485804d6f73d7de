"""OLMo 2 and OLMo 3 (AI2's open models): Llama's projections with the norms after, not
before, each sublayer (the state adds the normed attention output, then the normed MLP
output: transformers' Olmo2DecoderLayer), and an RMSNorm over the whole query and key
projections (all heads at once) before rotary (under tensor parallelism, summed over the
ranks' columns). OLMo 3 adds a sliding window on the layers
`layer_types` marks "sliding_attention" and one rotary table per layer type (Gemma 3's
per-type rope_parameters, which full-attention layers may scale with YaRN)."""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.gemma3.modeling import layer_rope_parameters
from tessera.models.llama.modeling import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, Rope, head_dim_of
from tessera.distributed.parallel import Span, all_reduce
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import RotaryEmbedding
from tessera.ops.weights import copy_checked, make_param
from tessera.weights.lazy import narrow


def layer_kinds(config: PretrainedConfig) -> list[str]:
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


class SplitRMSNorm(nn.Module):
    """An RMSNorm over a row whose columns tensor parallelism splits over the ranks (OLMo
    2's query / key norms span every head): each rank holds its columns' weights and
    normalises them by the whole row's mean square, its squares summed over the ranks
    (`replicas`: how many ranks hold each column, for replicated KV heads)."""

    def __init__(self, span: Span, full: int, replicas: int, eps: float, target: OpTarget):
        super().__init__()
        self.span, self.full, self.replicas, self.eps, self.tp_size = span, full, replicas, eps, target.tp_size
        self.weight = make_param((span.size,), target.dtype, target.device, loader=self._load)

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
        if tuple(tensor.shape) != (self.full,):
            raise ValueError(f"norm weight: checkpoint shape {tuple(tensor.shape)} != ({self.full},)")
        with torch.no_grad():
            copy_checked(param.data, narrow(tensor, 0, self.span.start, self.span.size), "norm weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        row = x.float()
        squares = all_reduce(row.pow(2).sum(-1, keepdim=True), self.tp_size) / self.replicas
        return self.weight * (row * torch.rsqrt(squares / self.full + self.eps)).to(x.dtype)


class ProjectionNormForward:
    """Attention with an RMSNorm over its whole query and key projections (every head at
    once) before rotary (OLMo 2 / 3, MiniMax-M2); mixed in before a LlamaAttention, whose
    __init__ then calls `make_projection_norms`."""

    def make_projection_norms(self, config: PretrainedConfig, target: OpTarget) -> None:
        eps, dim, heads = config.rms_norm_eps, self.head_dim, self.qkv_proj.heads
        if target.tp_size == 1:
            self.q_norm = RMSNorm(self.num_heads * dim, eps, target)
            self.k_norm = RMSNorm(self.num_kv_heads * dim, eps, target)
        else:
            kv_heads = config.num_key_value_heads
            self.q_norm = SplitRMSNorm(Span(heads.q.start * dim, heads.q.size * dim), config.num_attention_heads * dim,
                                       1, eps, target)
            self.k_norm = SplitRMSNorm(Span(heads.kv.start * dim, heads.kv.size * dim), kv_heads * dim,
                                       max(1, target.tp_size // kv_heads), eps, target)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.o_proj(self.attn(self.q_norm(q), self.k_norm(k), v, rotary=self.rotary, rope=rope))


class Olmo2Attention(ProjectionNormForward, LlamaAttention):
    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        window = getattr(config, "sliding_window", None)
        self.window = window if layer_kinds(config)[layer_idx] == "sliding_attention" else None
        super().__init__(config, target)
        self.make_projection_norms(config, target)

    def attention_options(self, config: PretrainedConfig) -> dict:
        return {"scale": self.head_dim ** -0.5, "sliding_window": self.window}


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget, layer_idx: int):
        super().__init__()
        self.self_attn = Olmo2Attention(config, target, layer_idx)
        self.mlp = LlamaMLP(config, target)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, target)
        self._add = target.op("sum_and_scale")  # the residual adds as kernels (CPU decode graphs replay them)

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # (hidden, residual): the state is their sum, added here or by the final norm
        state = hidden if residual is None else self._add(hidden, residual)
        state = self._add(state, self.post_attention_layernorm(self.self_attn(rope, state)))
        return self.post_feedforward_layernorm(self.mlp(state)), state


class Olmo2Model(LlamaModel):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.kinds = layer_kinds(config)

    def make_rotary(self, config: PretrainedConfig, target: OpTarget) -> nn.Module | None:
        """OLMo 3: a table per layer type (`type_rotary`), and no shared one."""
        self.type_rotary = None
        if "full_attention" not in (getattr(config, "rope_parameters", None) or {}):
            return super().make_rotary(config, target)
        self.type_rotary = nn.ModuleDict({
            kind: RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, kind_params, target)
            for kind, kind_params in layer_rope_parameters(config).items()})
        return None

    def make_layer(self, config: PretrainedConfig, layer_idx: int, target: OpTarget) -> nn.Module:
        return Olmo2DecoderLayer(config, target, layer_idx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if self.type_rotary is None:
            ropes = [self.rotary_emb(positions)] * len(self.layers)
        else:
            by_kind = {kind: rotary(positions) for kind, rotary in self.type_rotary.items()}
            ropes = [by_kind[kind] for kind in self.kinds]
        residual = None
        for layer, rope in zip(self.layers, ropes):
            hidden, residual = layer(rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model
