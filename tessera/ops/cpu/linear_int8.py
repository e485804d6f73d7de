"""The int8 weight-only GEMM builder for `linear` on AVX512 CPUs (gemm_int8.c) and, through
the same symbol built from gemm_int8_avx2.c, on CPUs with AVX2 but no AVX512.

Weights are quantized per output feature in groups of 32 input features with a float16 step
each, as GGUF's Q8_0 (tessera/ops/linear_int8.py, quantize_int8_groups), and packed into the
kernel's 16-feature panels. On CPUs with AMX the kernel's AMX build runs: from its widening
threshold (4 rows) the widened panels multiply on AMX tiles. Weights the panels or groups do
not fit (out features not a multiple of 16, such as MoE routers; in features not a multiple
of 32; values not finite) keep the model dtype and run through the bf16 GEMM's row kernel,
as int4's builder keeps them (the load names them: model_loading._note_unquantized); a
weight the reference builder prepared (its per-row layout) runs through it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch
import torch.nn.functional as F

from tessera.ops.cpu import linear as cpu_linear
from tessera.ops.cpu.build import Kernel, unavailable_with_f16c
from tessera.ops.attention.metadata import one_token_per_sequence
from tessera.ops.cpu.linear import EXACT_X, amx_build, packable, run_packed, vnni_build
from tessera.ops.linear_int8 import GROUP, int8_groupable, linear_int8_rows, quantize_int8_groups
from tessera.ops.registry import register_op


# The rows at which gemm_int8.c's AVX512-VNNI build rounds x to 8 bits per group of 32 and
# multiplies with vpdpbusd in a decode step: 1.1-1.4x faster there than the widened bf16
# tiles (gemm_int8.c). One stream's decode keeps 15-bit x, and steps with a prompt's or
# draft's rows take _EXACT_KERNEL, as int4's (linear_int4.INT8_X_ROWS). Its Q8_MIN_ROWS and
# Q8_END_ROWS (the AMX build widens from 4 instead); T - 1 tops a decode bucket or all of
# them (runner/decode_graphs.py).
INT8_X_ROWS = range(4, 33)
_KERNEL = Kernel("gemm_int8.c", "tessera_gemm_int8",
                 (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 3 + (ctypes.c_int,), ctypes.c_int,
                 fallback_source="gemm_int8_avx2.c",
                 defines=(f"Q8_MIN_ROWS {INT8_X_ROWS.start}", f"Q8_END_ROWS {INT8_X_ROWS.stop}"))
_EXACT_KERNEL = dataclasses.replace(_KERNEL, defines=EXACT_X)


GROUP_BYTES = 544  # per 16 features x 32 k: 16 float16 steps, then 16 pairs x 32 bytes
HEAD_BYTES = 64    # per panel, before its groups: the 16 features' float32 scales


def kernel_unavailable(spec: object = None) -> list[str]:
    """Why neither build can run here (the AVX2 one needs F16C too)."""
    return unavailable_with_f16c(_KERNEL, spec)


def panel_bytes(k: int) -> int:
    return HEAD_BYTES + k // GROUP * GROUP_BYTES


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [n, k] -> int8 [n / 16, 64 + 17 k] panels (the 16 features' scales, then per group
    of 32 k their steps and pair-interleaved codes), or the weight itself when the panels or
    groups do not fit it."""
    if weight.dtype == torch.int8 or not (packable(weight) and int8_groupable(weight)):
        return weight  # prepared already, or kept in the model dtype
    n, k = weight.shape
    q, d, scale = quantize_int8_groups(weight)
    p, groups = n // 16, k // GROUP
    out = torch.empty((p, panel_bytes(k)), dtype=torch.int8)
    out[:, :HEAD_BYTES].view(torch.float32).copy_(scale.view(p, 16))
    body = out[:, HEAD_BYTES:].view(p, groups, GROUP_BYTES)
    body[..., :32].view(torch.float16).copy_(d.view(p, 16, groups).transpose(1, 2))
    # each pair of k moves whole, as one int16: (panel, l, g, j) -> (panel, g, j, l)
    body[..., 32:].view(torch.int16).view(p, groups, GROUP // 2, 16).copy_(
        q.view(torch.int16).view(p, 16, groups, GROUP // 2).permute(0, 2, 3, 1))
    return out


def unpack_int8(packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [n, k], d float16 [n, k / 32], scale float32 [n]) back from pack_int8's panels."""
    p, groups = packed.shape[0], k // GROUP
    scale = packed[:, :HEAD_BYTES].contiguous().view(torch.float32).reshape(p * 16)
    body = packed[:, HEAD_BYTES:].reshape(p, groups, GROUP_BYTES)
    d = body[..., :32].contiguous().view(torch.float16).permute(0, 2, 1).reshape(p * 16, groups)
    q = body[..., 32:].reshape(p, groups, GROUP // 2, 16, 2).permute(0, 3, 1, 2, 4).reshape(p * 16, k)
    return q, d, scale


@functools.lru_cache(maxsize=None)
def amx_kernel() -> Kernel | None:
    """This kernel's AMX build (its widened rows, from 4, multiply on AMX tiles; it has no
    8-bit x rows), where it runs here; asked once, not per call (a decode step makes ~120
    calls)."""
    return amx_build(_EXACT_KERNEL)


@functools.lru_cache(maxsize=None)
def _runs_here() -> bool:
    return not kernel_unavailable()


def step_kernel() -> Kernel:
    """The build this step multiplies with: 8-bit x rows in a decode step, none in others."""
    return amx_kernel() or (_KERNEL if one_token_per_sequence() else _EXACT_KERNEL)


def packed_kernel() -> Kernel | None:
    """The kernel that multiplies pack_int8's panels in this step (at any row count), or None
    where neither build can run."""
    return step_kernel() if _runs_here() else None


def rounds_x_to_8_bits(m: int) -> bool:
    """Whether the kernel that runs here multiplies m rows of x rounded to 8 bits per group of
    32 (int8_rows.h): in a decode step (or outside any), the AVX512-VNNI build (not the AMX
    one) at INT8_X_ROWS."""
    return one_token_per_sequence() and amx_kernel() is None and vnni_build(_KERNEL) and m in INT8_X_ROWS


@register_op("linear", name="cpu_gemm_int8", priority=10, devices=("cpu",), dtypes=(torch.bfloat16,),
             quant=("int8",), check=kernel_unavailable, prepare=pack_int8)
def gemm_int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    if weight.is_floating_point():  # kept in the model dtype
        if cpu_linear.kernel_unavailable() is None:
            return cpu_linear.gemm_linear(x, weight, bias)
        return F.linear(x, weight.to(x.dtype), bias)
    if weight.shape[1] == k + 4:  # the reference builder's rows
        return linear_int8_rows(x, weight, bias)
    if weight.shape[1] != panel_bytes(k) or k % GROUP:
        raise ValueError(f"input has {k} features; the packed int8 weight {tuple(weight.shape)} "
                         f"expects {(weight.shape[1] - HEAD_BYTES) * GROUP // GROUP_BYTES}")
    return run_packed(step_kernel(), x, weight, bias, weight.shape[0] * 16)
