"""The fused bf16 RMSNorm (+ residual add) builder for `rms_norm` on CPU, and the LayerNorm
builder (layer_norm.h: Cohere's bias-free norm, the encoders' biased one).

At decode batch sizes an RMSNorm is ~8 small torch ops whose dispatch costs far more than
their arithmetic; rms_norm_bf16.c does the add and the norm in one pass per row. Exact to
the pure-torch builder up to float32 summation order (a bf16 ulp at most).
"""
from __future__ import annotations

import ctypes
import dataclasses

import torch

from tessera.ops.cpu.build import Kernel
from tessera.ops.norm import layer_norm_ref, rms_norm_ref
from tessera.ops.registry import register_op


_KERNEL = Kernel("rms_norm_bf16.c", "tessera_rms_norm_bf16",
                 (ctypes.c_void_p,) * 5 + (ctypes.c_int64,) * 4 + (ctypes.c_float, ctypes.c_int), None,
                 fallback_source="rms_norm_avx2.c")
# a float32 weight (Gemma's 1 + w), the normalised row not rounded before it (ops/norm.py)
_F32_WEIGHT_KERNEL = dataclasses.replace(_KERNEL, defines=("TESSERA_F32_WEIGHT 1",))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@register_op("rms_norm", name="cpu_rms_norm_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_KERNEL.check)
def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if (x.dtype != torch.bfloat16 or weight.dtype not in (torch.bfloat16, torch.float32)
            or not weight.is_contiguous()
            or (residual is not None and (residual.dtype != torch.bfloat16 or residual.shape != x.shape))):
        return rms_norm_ref(x, weight, eps, residual)
    kernel = _F32_WEIGHT_KERNEL if weight.dtype == torch.float32 else _KERNEL
    h = x.shape[-1]
    rows = x.numel() // h if h else 0
    # [tokens, heads, h] with each token's heads contiguous (a slice of a QKV projection's
    # rows): read in place, groups of `heads` rows a token stride apart
    if residual is None and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == h and x.shape[0] > 1:
        group, group_stride = x.shape[1], x.stride(0)
    elif residual is None and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 1:
        # [tokens, h] rows of a wider matrix (MiniMax-M2's norm over a whole query or key
        # projection, a column slice of the packed QKV rows): each row its own group
        group, group_stride = 1, x.stride(0)
    else:
        x = x.contiguous()
        group, group_stride = max(rows, 1), 0
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = None
    if residual is not None:
        residual = residual.contiguous()
        new_residual = torch.empty_like(x)
    if rows:
        kernel(x.data_ptr(), _ptr(residual), _ptr(new_residual), weight.data_ptr(), out.data_ptr(),
               rows, h, group, group_stride, eps, torch.get_num_threads())
    return out, new_residual


_LAYER_NORM = Kernel("layer_norm.c", "tessera_layer_norm",
                     (ctypes.c_void_p, ctypes.c_int64) + (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 2
                     + (ctypes.c_float, ctypes.c_int, ctypes.c_int), None, fallback_source="layer_norm_avx2.c")


@register_op("layer_norm", name="cpu_layer_norm", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16, torch.float32), check=_LAYER_NORM.check)
def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """layer_norm_ref's op in one call, within a unit of the last place (its float32 sums run
    in another order): x as rows (2-D, any row stride; or contiguous), weight and bias of x's
    dtype or None."""
    if not (x.dtype in (torch.bfloat16, torch.float32) and x.dim() >= 1 and x.shape[-1] > 0
            and all(t is None or (t.dtype == x.dtype and t.shape == x.shape[-1:] and t.is_contiguous())
                    for t in (weight, bias))):
        return layer_norm_ref(x, weight, bias, eps)
    h = x.shape[-1]
    rows_of = x if x.dim() == 2 and x.stride(1) == 1 else x.contiguous().view(-1, h)
    out = torch.empty(x.shape, dtype=x.dtype)
    if rows_of.shape[0]:
        _LAYER_NORM(rows_of.data_ptr(), rows_of.stride(0), _ptr(weight) or 0, _ptr(bias) or 0, out.data_ptr(),
                    rows_of.shape[0], h, eps, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out
