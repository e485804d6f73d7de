"""The int8 weight-only GEMM builder for `linear` on AVX512 CPUs (gemm_int8.c) and, through
the same symbol built from gemm_int8_avx2.c, on CPUs with AVX2 but no AVX512.

Weights are quantized per output feature (tessera/ops/linear_int8.py) and packed into the
kernel's 16-feature panels, each led by its 16 float32 scales. On CPUs with AMX the kernel's
AMX build runs: from its widening threshold (4 rows) the widened panels multiply on AMX
tiles. Shapes the kernel cannot
take (out features not a multiple of 16, odd in features) keep the reference builder's
row layout and run through it.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera.ops.cpu.build import Kernel
from tessera.ops.cpu.linear import amx_build, packable, run_packed
from tessera.ops.linear_int8 import linear_int8_rows, quantize_int8, quantize_rows
from tessera.ops.registry import register_op


_KERNEL = Kernel("gemm_int8.c", "tessera_gemm_int8",
                 (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 3 + (ctypes.c_int,), ctypes.c_int,
                 fallback_source="gemm_int8_avx2.c")


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [n, k] -> int8 [n / 16, 64 + 16 k] panels (scales, then pair-interleaved values),
    or the reference row layout [n, k + 4] when the shape does not fit the kernel."""
    if weight.dtype == torch.int8:
        return weight  # prepared already
    if not packable(weight):
        return quantize_rows(weight)
    n, k = weight.shape
    q, scale = quantize_int8(weight)
    out = torch.empty((n // 16, 64 + 16 * k), dtype=torch.int8)
    out[:, :64].copy_(scale.view(n // 16, 16).view(torch.int8))
    # each pair of k moves whole, as one int16 (2x faster than moving bytes)
    out[:, 64:].view(torch.int16).view(n // 16, k // 2, 16).copy_(
        q.view(torch.int16).view(n // 16, 16, k // 2).transpose(1, 2))
    return out


def unpack_int8(packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [n, k], scale [n]) back from pack_int8's panels."""
    p = packed.shape[0]
    scale = packed[:, :64].contiguous().view(torch.float32).reshape(p * 16)
    q = packed[:, 64:].reshape(p, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(p * 16, k)
    return q, scale


@functools.lru_cache(maxsize=None)
def amx_kernel() -> Kernel | None:
    """This kernel's AMX build (its widened rows, from 4, multiply on AMX tiles), where it runs here; asked once,
    not per call (a decode step makes ~120 calls)."""
    return amx_build(_KERNEL)


@register_op("linear", name="cpu_gemm_int8", priority=10, devices=("cpu",), dtypes=(torch.bfloat16,),
             quant=("int8",), check=_KERNEL.check, prepare=pack_int8)
def gemm_int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    if weight.shape[1] == k + 4:  # row layout: a shape the kernel does not take
        return linear_int8_rows(x, weight, bias)
    if weight.shape[1] != 64 + 16 * k:
        raise ValueError(f"input has {k} features; the packed int8 weight {tuple(weight.shape)} "
                         f"expects {(weight.shape[1] - 64) // 16}")
    amx = amx_kernel() if k % 32 == 0 else None
    return run_packed(amx or _KERNEL, x, weight, bias, weight.shape[0] * 16)
