"""Gemma2, assembled from shared ops, following transformers' modeling_gemma2:
- embeddings scaled by sqrt(hidden_size), the factor rounded to the model dtype;
- RMSNorm weights stored as (1 + w) at load time, so the shared rms_norm op applies them;
- four norms per layer (input, post-attention, pre- and post-feedforward);
- attention scaled by query_pre_attn_scalar ** -0.5, scores soft-capped by
  attn_logit_softcapping, and a sliding window on the layers layer_types marks
  "sliding_attention" (every other layer by default);
- gelu_pytorch_tanh gated MLP; final logits soft-capped by final_logit_softcapping."""
from __future__ import annotations

from typing import Hashable

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.models.llama.modeling import LlamaAttention, LlamaForCausalLM, Rope, add_and_norm, head_dim_of
from tessera.ops.activation import GeluTanhAndMul
from tessera.ops.embedding import VocabEmbedding
from tessera.ops.linear import PackedLinear, RowParallelLinear
from tessera.ops.norm import RMSNorm
from tessera.ops.pending_norm import PendingNorm, can_fuse_input_norms
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import RotaryEmbedding, rope_parameters
from tessera.ops.weights import copy_checked
from tessera.weights.lazy import materialize


def _plus_one_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
    # Gemma checkpoints store w and normalise with (1 + w); in float32 this is exact.
    with torch.no_grad():
        copy_checked(param.data, 1.0 + materialize(tensor).float(), getattr(param, "tessera_name", "norm"))


def rounded(value: float, target: OpTarget) -> float:
    """A scale as transformers applies it: a tensor of the model dtype (Gemma's sqrt(hidden)
    embedding scale is 55.5, not 55.43, in bf16)."""
    return torch.tensor(value, dtype=target.dtype).item()


class Gemma2RMSNorm(RMSNorm):
    """(1 + w) kept in float32 whatever the model dtype: transformers multiplies the float32
    normalised row by (1 + w) in float32 and rounds once (the rms_norm op does so for a
    float32 weight); 1 + w rounded to bf16 would be off by up to 2^-9 per channel."""

    def __init__(self, hidden_size: int, eps: float, target: OpTarget):
        super().__init__(hidden_size, eps, target, weight_dtype=torch.float32, loader=_plus_one_loader)


class Gemma2MLP(nn.Module):
    input_to_one_linear = True  # forward's input goes to gate_up_proj only (ops/pending_norm.py)

    def __init__(self, config: PretrainedConfig, target: OpTarget, intermediate_size: int | None = None):
        """`intermediate_size`: other than the config's (Gemma 4's double-wide layers)."""
        super().__init__()
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma MLP supports gelu_pytorch_tanh only, got {act!r}")
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, {0: size, 1: size}, target, bias=False)
        self.down_proj = RowParallelLinear(size, config.hidden_size, target, bias=False)
        self.act_fn = GeluTanhAndMul(target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.gated(self.act_fn, self.gate_up_proj(x))


class Gemma2Attention(LlamaAttention):
    """Llama's attention (Q/K/V and o_proj biases follow attention_bias) with Gemma2's
    scale, per-layer window and score soft-capping."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, target: OpTarget):
        # read by attention_options() during LlamaAttention.__init__
        self.sliding = config.layer_types[layer_idx] == "sliding_attention"
        super().__init__(config, target)

    def attention_options(self, config: PretrainedConfig) -> dict:
        return {"scale": config.query_pre_attn_scalar ** -0.5,
                "sliding_window": config.sliding_window if self.sliding else None,
                "softcap": config.attn_logit_softcapping}


class Gemma2DecoderLayer(nn.Module):
    attention_cls = Gemma2Attention

    def __init__(self, config: PretrainedConfig, layer_idx: int, target: OpTarget):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self.attention_cls(config, layer_idx, target)
        self.mlp = Gemma2MLP(config, target)
        self.input_layernorm = Gemma2RMSNorm(size, eps, target)
        self.post_attention_layernorm = Gemma2RMSNorm(size, eps, target)
        self.pre_feedforward_layernorm = Gemma2RMSNorm(size, eps, target)
        self.post_feedforward_layernorm = Gemma2RMSNorm(size, eps, target)
        # the input and pre-feedforward norms computed by the linears reading them, where
        # one op does both (CUDA)
        self.norms_into_linears = can_fuse_input_norms(self.self_attn, self.mlp)

    def forward(self, rope: Rope, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual adds are fused into the next norm (input / pre-feedforward / final).
        if self.norms_into_linears:
            pending = PendingNorm(self.input_layernorm, hidden, residual)
            hidden = self.post_attention_layernorm(self.self_attn(rope, pending))
            pending = PendingNorm(self.pre_feedforward_layernorm, hidden, pending.next_residual())
            return self.post_feedforward_layernorm(self.mlp(pending)), pending.next_residual()
        hidden, residual = add_and_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rope, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(nn.Module):
    layer_cls = Gemma2DecoderLayer

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        # transformers multiplies by sqrt(hidden) rounded to the hidden states' dtype
        self.normalizer = rounded(config.hidden_size ** 0.5, target)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, target, scale=self.normalizer)
        self.make_rotary(config, target)
        self.layers = nn.ModuleList(self.layer_cls(config, i, target)
                                    for i in range(config.num_hidden_layers))
        self.norm = Gemma2RMSNorm(config.hidden_size, config.rms_norm_eps, target)

    def make_rotary(self, config: PretrainedConfig, target: OpTarget) -> None:
        """One rotary table for every layer (Gemma 3 keeps one per layer type)."""
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                          rope_parameters(config), target)

    def layer_ropes(self, positions: torch.Tensor) -> list[Rope]:
        """Each layer's cos/sin for this step's positions."""
        return [self.rotary_emb(positions)] * len(self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # scaled by the normalizer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, rope in zip(self.layers, self.layer_ropes(positions)):
            hidden, residual = layer(rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma2Model

    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__(config, target)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # float32
        if self.final_softcap is not None:  # model-specific; elementwise on [rows, vocab]
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
