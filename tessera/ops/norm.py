"""RMSNorm (decoders) and LayerNorm (BERT-style encoders).

RMSNorm with an optional fused residual add: (x + residual) is normalised and also
returned as the next residual, so the add costs no extra pass in fused builders.

A weight in the model dtype multiplies the normalised row rounded to that dtype (Llama's
RMSNorm in transformers). A float32 weight over a lower-precision row multiplies the
normalised row in float32 and rounds once (Gemma's norms, whose 1 + w weights tessera keeps
in float32, as transformers computes them)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tessera.ops.module import OpModule
from tessera.ops.registry import OpTarget, register_op
from tessera.ops.weights import make_param


@register_op("rms_norm", name="torch_rms_norm", priority=0)
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and dtype != torch.float32:
        return (xf * weight).to(dtype), residual
    return weight * xf.to(dtype), residual


class RMSNorm(OpModule):
    def __init__(self, hidden_size: int, eps: float, target: OpTarget, weight_dtype: torch.dtype | None = None,
                 loader: Callable | None = None):
        """`weight_dtype`: float32 keeps the weight there whatever the model dtype (module
        docstring); `loader`: how a checkpoint tensor becomes the weight (default: as is)."""
        super().__init__()
        self.eps = eps
        self.weight = make_param((hidden_size,), weight_dtype or target.dtype, target.device,
                                 **({"loader": loader} if loader is not None else {}))
        self._norm = target.op("rms_norm")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, new_residual = self._norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, new_residual)


def norm_per_head(norm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`norm` over each head of x ([T, heads * head_dim]) on its own (q/k head norms). `x` is
    often a slice of a QKV projection's rows, so [T, heads, head_dim] is a view (a reshape to
    [T * heads, head_dim] would copy from two tokens on); the CPU kernel reads it in place."""
    return norm(x.reshape(x.shape[0], -1, head_dim)).reshape(x.shape[0], -1)


@register_op("layer_norm", name="torch_layer_norm", priority=0)
def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's LayerNorm, as transformers runs it (its bf16 kernels accumulate in float32)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class LayerNorm(OpModule):
    def __init__(self, hidden_size: int, eps: float, target: OpTarget, bias: bool = True):
        """`bias=False`: a weight only (Cohere's)."""
        super().__init__()
        self.eps = eps
        self.weight = make_param((hidden_size,), target.dtype, target.device)
        self.bias = make_param((hidden_size,), target.dtype, target.device) if bias else None
        self._norm = target.op("layer_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.bias, self.eps)


@register_op("gated_rms_norm", name="torch_gated_rms_norm", priority=0)
def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       gate_first: bool = False, group_size: int | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension (in groups of `group_size`), and times SiLU(gate).
    Norm first, per row (Gated DeltaNet: transformers' Qwen3NextRMSNormGated,
    flash-linear-attention's FusedRMSNormGated): the weight multiplies the normalised row
    rounded to the model dtype, the gate in float32, one rounding at the end. Norm first in
    groups (Falcon-H1's): all in float32, one rounding. Gate first (Mamba-2's RMSNormGated):
    the gated row in float32 is normalised per group, rounded, then weighted."""
    dtype = x.dtype
    xf = x.float()
    if gate_first:
        xf = xf * F.silu(gate.float())
    groups = xf.view(*xf.shape[:-1], -1, group_size or xf.shape[-1])
    normed = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).view(xf.shape)
    if gate_first:
        return weight * normed.to(dtype)
    if group_size is not None:
        return (weight.float() * normed * F.silu(gate.float())).to(dtype)
    return (weight * normed.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedRMSNorm(OpModule):
    """Linear attention's output norm: each value head's row normalised, scaled by the
    weight [head_dim] and gated by SiLU of a second projection (Gated DeltaNet; Mamba-2's
    mixer calls the op gate first, models/granitemoehybrid/mamba.py)."""

    def __init__(self, hidden_size: int, eps: float, target: OpTarget):
        super().__init__()
        self.eps = eps
        self.weight = make_param((hidden_size,), target.dtype, target.device)
        self._norm = target.op("gated_rms_norm")

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._norm(x, gate, self.weight, self.eps)
