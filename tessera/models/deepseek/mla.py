"""DeepSeek's multi-head latent attention (MLA, DeepSeek-V2 / V3), over a latent cache.

Each token's keys and values are one compressed vector c (kv_lora_rank wide, RMS-normed)
plus one rotary key k_pe shared by every head (qk_rope_head_dim wide). transformers expands
c into every head's key and value (kv_b_proj) before attention; here the expansion is
absorbed into the query and the output instead: head h's key is W_UK_h c and its query
q_nope_h, so q_nope_h . W_UK_h c = (W_UK_h^T q_nope_h) . c, and its value W_UV_h c makes the
output W_UV_h (sum_t p_t c_t). Attention is then multi-query over [c, k_pe]: one KV head of
kv_lora_rank + qk_rope_head_dim (576 in V2 / V3) that the paged cache stores, instead of
every head's key and value (V3: 128 x (192 + 128) values a token), with the same kernels as
every other model. The value is that same vector (the cache holds it once,
`value_is_key`); its rotary part is dropped from the output. The softmax scale is 1 / sqrt(qk_nope + qk_rope) (times YaRN's mscale squared, as in
transformers' yarn_apply_mscale).
"""
from __future__ import annotations

import math
from typing import Hashable

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.distributed.parallel import Span, even_span
from tessera.models.llama.modeling import Rope
from tessera.ops.attention import Attention
from tessera.ops.linear import Linear, PackedLinear, RowParallelLinear
from tessera.ops.norm import RMSNorm
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import ApplyRotary, rope_parameters
from tessera.ops.weights import copy_checked, make_param
from tessera.weights.lazy import narrow

K_B, V_B = "k_b_proj", "v_b_proj"  # kv_b_proj's halves, as llama.cpp stores them


def mla_scale(config: PretrainedConfig) -> float:
    """1 / sqrt(qk head dim), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    all_dim = params.get("mscale_all_dim") if params.get("rope_type", "default") != "default" else None
    factor = params.get("factor") or 1.0
    if all_dim and factor > 1:
        mscale = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, target: OpTarget):
        super().__init__()
        heads = config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        qk = self.nope + self.rope_dim
        span = even_span(heads, target.tp_rank, target.tp_size)  # this rank's heads
        self.full_heads, self.head_span, self.num_heads = heads, span, span.size
        bias = bool(getattr(config, "attention_bias", False))
        q_rows = {0: Span(span.start * qk, span.size * qk)}
        if config.q_lora_rank:
            self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, target, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6, target)
            self.q_b_proj = PackedLinear(config.q_lora_rank, {0: heads * qk}, target, shard_spans=q_rows)
        else:
            self.q_proj = PackedLinear(config.hidden_size, {0: heads * qk}, target, shard_spans=q_rows)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, self.rank + self.rope_dim, target, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6, target)
        # never applied as a projection: its per-head halves are absorbed (module docstring)
        # (whole from a Hugging Face checkpoint; llama.cpp's files split it: K_B, V_B)
        self.kv_b_weight = make_param((span.size * (self.nope + self.v_dim), self.rank), target.dtype,
                                      target.device, loader=self._load_kv_b, shard_ids=(K_B, V_B))
        self.o_proj = RowParallelLinear(heads * self.v_dim, config.hidden_size, target, bias=bias,
                                        in_span=Span(span.start * self.v_dim, span.size * self.v_dim))
        interleaved = getattr(config, "rope_interleave", True) is not False  # V2's are always
        self.rotary = ApplyRotary(self.rope_dim, target, interleaved=interleaved)
        self.attn = Attention(span.size, self.rank + self.rope_dim, 1, mla_scale(config), target, value_is_key=True)
        self._head_matmul = target.op("head_matmul")  # ops/latent_attention.py
        self._concat = target.op("concat_columns")
        self._scale = target.op("sum_and_scale")

    def _load_kv_b(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        """kv_b_proj whole ([heads x (nope + v), rank]), or llama.cpp's halves: K_B, the key
        rows transposed per head ([heads, rank, nope]), and V_B ([heads, v, rank])."""
        rows = self.nope + self.v_dim
        start, size = self.head_span.start, self.head_span.size
        if shard_id is None:
            if tuple(tensor.shape) != (self.full_heads * rows, self.rank):
                raise ValueError(f"kv_b_proj: checkpoint shape {tuple(tensor.shape)} != "
                                 f"({self.full_heads * rows}, {self.rank})")
            with torch.no_grad():
                copy_checked(param.data, narrow(tensor, 0, start * rows, size * rows), "kv_b_proj")
            return
        key = shard_id == K_B
        want = (self.full_heads, self.rank, self.nope) if key else (self.full_heads, self.v_dim, self.rank)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{shard_id}: checkpoint shape {tuple(tensor.shape)} != {want}")
        per_head = param.data.view(size, rows, self.rank)
        part = narrow(tensor, 0, start, size)
        with torch.no_grad():
            if key:
                copy_checked(per_head[:, :self.nope], part.transpose(1, 2), shard_id)
            else:
                copy_checked(per_head[:, self.nope:], part, shard_id)

    def forward(self, rope: Rope, hidden: torch.Tensor) -> torch.Tensor:
        t, h = hidden.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(t, h, self.nope + self.rope_dim)
        # (the ops read their slices of q and of the latent projection in place: no copies, so
        # a decode step is kernels alone on CPU, which its kernel graph replays)
        compressed = self.kv_a_proj_with_mqa(hidden)
        latent = self.kv_a_layernorm(compressed[:, :self.rank])
        q_pe, k_pe = self.rotary(q[..., self.nope:], compressed[:, self.rank:], rope)
        w = self.kv_b_weight.view(h, self.nope + self.v_dim, self.rank)
        # W_UK_h^T q_nope_h: each head's query in the latent space
        q_latent = self._head_matmul(q[..., :self.nope], w[:, :self.nope])
        query = self._concat(q_latent.view(t * h, self.rank), q_pe.view(t * h, self.rope_dim)).view(t, -1)
        if len(rope) > 2:  # each token's query scale (Llama 4's temperature: Mistral 4), linear through W_UK
            query = self._scale(query, None, rope[2])
        key = self._concat(latent, k_pe)
        out = self.attn(query, key, key).view(t, h, self.rank + self.rope_dim)[..., :self.rank]
        values = self._head_matmul(out, w[:, self.nope:], True)  # W_UV_h of the latent output
        return self.o_proj(values.view(t, h * self.v_dim))
