"""Rotary position embedding (rotate-half layout, as Hugging Face checkpoints store q/k).

cos/sin are precomputed for every position up to max_position once; each step gathers rows
by position once, so a batch mixing prefill and decode needs no special casing.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tessera.ops.registry import OpTarget, register_op

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict:
    """rope_theta and scaling as one dict, from either transformers 5 (`rope_parameters`)
    or 4 (`rope_theta` + `rope_scaling`) style configs."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        params = {**scaling, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def inverse_frequencies(rotary_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


@register_op("rotary", name="torch_rotary", priority=0)
def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq*D], k: [T, Hk*D]; cos/sin: [T, 1, D] for these tokens' positions."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, head_size)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x * cos + rotated * sin).flatten(1)

    return apply(q), apply(k)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_position, computed once; forward gathers the
    rows for one step's positions (once per step, shared by every layer)."""

    def __init__(self, head_size: int, max_position: int, params: dict, target: OpTarget):
        super().__init__()
        inv_freq = inverse_frequencies(head_size, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # Stored in the model dtype, as transformers casts cos/sin before applying them.
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(target.dtype)
        self.register_buffer("cos_sin", cos_sin.to(target.device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin.index_select(0, positions).chunk(2, dim=-1)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((sin, sin), dim=-1).unsqueeze(1)


class ApplyRotary(nn.Module):
    def __init__(self, head_size: int, target: OpTarget):
        super().__init__()
        self.head_size = head_size
        self._rotary = target.op("rotary", head_size=head_size)

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary(q, k, rope[0], rope[1], self.head_size)
