"""The int8 weight-only GEMM builder for `linear` on AVX512 CPUs (gemm_int8.c) and, through
the same symbol built from gemm_int8_avx2.c, on CPUs with AVX2 but no AVX512.

Weights are quantized per output feature in groups of 32 input features with a float16
step each, as GGUF's Q8_0 (tessera/ops/linear_int8.py, quantize_int8_groups), and packed
into the kernel's 16-feature panels. On CPUs with AMX the kernel's AMX build runs: from its
widening threshold (4 rows) the widened panels multiply on AMX tiles. Shapes the kernel
cannot take (out features not a multiple of 16, in features not a multiple of 32, a step
beyond float16) keep the reference builder's per-row layout and run through it.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera.ops.cpu.build import Kernel, unavailable_with_f16c
from tessera.ops.cpu.linear import amx_build, packable, run_packed
from tessera.ops.linear_int8 import GROUP, int8_groupable, linear_int8_rows, quantize_int8_groups, quantize_rows
from tessera.ops.registry import register_op


_KERNEL = Kernel("gemm_int8.c", "tessera_gemm_int8",
                 (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 3 + (ctypes.c_int,), ctypes.c_int,
                 fallback_source="gemm_int8_avx2.c")


GROUP_BYTES = 544  # per 16 features x 32 k: 16 float16 steps, then 16 pairs x 32 bytes
PANEL_BYTES_PER_K = GROUP_BYTES // GROUP


def kernel_unavailable(spec: object = None) -> list[str]:
    """Why neither build can run here (the AVX2 one needs F16C too)."""
    return unavailable_with_f16c(_KERNEL, spec)


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [n, k] -> int8 [n / 16, 17 k] panels (per group of 32 k: steps, then
    pair-interleaved codes), or the reference row layout [n, k + 4] when the shape or the
    values do not fit the kernel."""
    if weight.dtype == torch.int8:
        return weight  # prepared already
    if not (packable(weight) and int8_groupable(weight)):
        return quantize_rows(weight)
    n, k = weight.shape
    q, d = quantize_int8_groups(weight)
    p, groups = n // 16, k // GROUP
    out = torch.empty((p, groups, GROUP_BYTES), dtype=torch.int8)
    out[..., :32].view(torch.float16).copy_(d.view(p, 16, groups).transpose(1, 2))
    # each pair of k moves whole, as one int16: (panel, l, g, j) -> (panel, g, j, l)
    out[..., 32:].view(torch.int16).view(p, groups, GROUP // 2, 16).copy_(
        q.view(torch.int16).view(p, 16, groups, GROUP // 2).permute(0, 2, 3, 1))
    return out.view(p, groups * GROUP_BYTES)


def unpack_int8(packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [n, k], d float16 [n, k / 32]) back from pack_int8's panels."""
    p, groups = packed.shape[0], k // GROUP
    parts = packed.view(p, groups, GROUP_BYTES)
    d = parts[..., :32].contiguous().view(torch.float16).permute(0, 2, 1).reshape(p * 16, groups)
    q = parts[..., 32:].reshape(p, groups, GROUP // 2, 16, 2).permute(0, 3, 1, 2, 4).reshape(p * 16, k)
    return q, d


@functools.lru_cache(maxsize=None)
def amx_kernel() -> Kernel | None:
    """This kernel's AMX build (its widened rows, from 4, multiply on AMX tiles), where it runs here; asked once,
    not per call (a decode step makes ~120 calls)."""
    return amx_build(_KERNEL)


@register_op("linear", name="cpu_gemm_int8", priority=10, devices=("cpu",), dtypes=(torch.bfloat16,),
             quant=("int8",), check=kernel_unavailable, prepare=pack_int8)
def gemm_int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    if weight.shape[1] == k + 4:  # row layout: a shape the kernel does not take
        return linear_int8_rows(x, weight, bias)
    if weight.shape[1] != PANEL_BYTES_PER_K * k:
        raise ValueError(f"input has {k} features; the packed int8 weight {tuple(weight.shape)} "
                         f"expects {weight.shape[1] // PANEL_BYTES_PER_K}")
    return run_packed(amx_kernel() or _KERNEL, x, weight, bias, weight.shape[0] * 16)  # (k: whole groups)
