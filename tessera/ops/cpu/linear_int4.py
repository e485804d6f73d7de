"""The int4 weight-only GEMM builder for `linear` on AVX512 CPUs (gemm_int4.c) and, through
the same symbol built from gemm_int4_avx2.c, on CPUs with AVX2 (and F16C) but no AVX512.

Weights are quantized per output feature in groups of 32 (tessera/ops/linear_int4.py) and
packed into the kernel's 16-feature panels. Weights the panels or the format cannot take (out
features not a multiple of 16, in features not a multiple of 32, values beyond float16) stay
in the model dtype and run through the bf16 GEMM's row kernel (small matrices such as MoE
routers: a kernel call, so decode graphs still capture them). On CPUs with AMX the kernel's
AMX build runs: from 9 rows the widened panels multiply on AMX tiles.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch
import torch.nn.functional as F

from tessera.ops.cpu.build import Kernel, unavailable_with_f16c
from tessera.ops.cpu import linear as cpu_linear
from tessera.ops.cpu import linear_int8 as cpu_int8
from tessera.ops.attention.metadata import one_token_per_sequence
from tessera.ops.cpu.linear import EXACT_X, amx_build, run_packed
from tessera.ops.linear_int4 import GROUP, Int4Parts, int4_parts, int4_quantizable, linear_int4_rows
from tessera.ops.registry import register_op

# The rows at which gemm_int4.c rounds x to 8 bits per group of 32 and multiplies with
# vpdpbusd (without AVX512-VNNI, and in gemm_int4_avx2.c, vpmaddubsw) in a decode step:
# 1.2-1.5x faster there. One stream's decode keeps 15-bit x, and steps with a prompt's or draft's rows
# take _EXACT_KERNEL, the same source without them: there the rounding would move logprobs
# (a prompt's), or verification away from plain decoding (drafts), for a few percent
# (gemm_int4.c). Its Q8_MIN_ROWS and Q8_END_ROWS (the AMX build widens from AMX_WIDEN_ROWS);
# T - 1 tops a decode bucket or all of them (runner/decode_graphs.py).
INT8_X_ROWS = range(4, 33)
_KERNEL = Kernel("gemm_int4.c", "tessera_gemm_int4",
                 (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 3 + (ctypes.c_int,), ctypes.c_int,
                 fallback_source="gemm_int4_avx2.c",
                 defines=(f"Q8_MIN_ROWS {INT8_X_ROWS.start}", f"Q8_END_ROWS {INT8_X_ROWS.stop}"))
_EXACT_KERNEL = dataclasses.replace(_KERNEL, defines=EXACT_X)


def kernel_unavailable(spec: object = None) -> list[str]:
    """Why neither build can run here (the AVX2 one needs F16C too)."""
    return unavailable_with_f16c(_KERNEL, spec)

PANEL_BYTES_PER_K = 10  # 320 bytes per 16 features x 32 k
# On AMX the widened multiply wins from fewer rows than gemm_int4.c's 17: 1.5-1.9x at 16 rows
# (0.7-0.9x at 8; 2 threads, the default model's shapes), so from 9, a decode bucket's edge
# (runner/decode_graphs.py: 9-16 rows replay as 16).
AMX_WIDEN_ROWS = 9
AMX_WIDEN_MIN_ROWS = f"WIDEN_MIN_ROWS {AMX_WIDEN_ROWS}"


def pack_int4(weight: torch.Tensor, stored: Int4Parts | None = None) -> torch.Tensor:
    """[n, k] float -> uint8 [n / 16, 10 k] panels (gemm_int4.c's layout); the weight itself
    when already prepared, or when the panels or the format do not fit it. `stored`: its parts
    as the checkpoint stored them (linear_int4.int4_parts)."""
    if weight.dtype == torch.uint8 or weight.dim() != 2 or weight.shape[0] % 16 or not int4_quantizable(weight):
        return weight
    n, k = weight.shape
    codes, d, m = int4_parts(weight, stored)
    p, groups = n // 16, k // GROUP
    c = codes.view(n, k // 4, 2, 2)                            # (row, t, half, e)
    pairs = (c[:, :, 0] | (c[:, :, 1] << 4)).contiguous()      # each 4 codes' 2 bytes, as one int16
    out = torch.empty((p, groups, 320), dtype=torch.uint8)
    out[..., :32].view(torch.float16).copy_(d.view(p, 16, groups).transpose(1, 2))
    out[..., 32:64].view(torch.float16).copy_(m.view(p, 16, groups).transpose(1, 2))
    # (panel, l, g, t) -> (panel, g, t, l): whole int16s move, not bytes
    out[..., 64:].view(torch.int16).view(p, groups, GROUP // 4, 16).copy_(
        pairs.view(torch.int16).view(p, 16, groups, GROUP // 4).permute(0, 2, 3, 1))
    return out.view(p, groups * 320)


def unpack_int4(packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [n, k], d [n, k / 32], m [n, k / 32]) back from pack_int4's panels."""
    p, groups = packed.shape[0], k // GROUP
    parts = packed.view(p, groups, 320)
    d = parts[..., :32].contiguous().view(torch.float16).permute(0, 2, 1).reshape(p * 16, groups)
    m = parts[..., 32:64].contiguous().view(torch.float16).permute(0, 2, 1).reshape(p * 16, groups)
    chunks = parts[..., 64:].reshape(p, groups, GROUP // 4, 16, 2)  # (panel, g, t, l, e)
    codes = torch.stack([chunks & 15, chunks >> 4], dim=4)          # (panel, g, t, l, half, e)
    codes = codes.permute(0, 3, 1, 2, 4, 5).reshape(p * 16, k)
    return codes, d, m


@functools.lru_cache(maxsize=None)
def amx_kernel(exact: bool = False) -> Kernel | None:
    """This kernel's AMX build (its widened rows, from 9, multiply on AMX tiles; `exact`: the
    one without 8-bit x), where it runs here; asked once, not per call (a decode step makes
    ~120 calls)."""
    return amx_build(_EXACT_KERNEL if exact else _KERNEL, AMX_WIDEN_MIN_ROWS)


@functools.lru_cache(maxsize=None)
def _runs_here() -> bool:
    return not kernel_unavailable()


def step_kernel() -> Kernel:
    """The build this step multiplies with: 8-bit x rows in a decode step, none in others."""
    exact = not one_token_per_sequence()
    return amx_kernel(exact) or (_EXACT_KERNEL if exact else _KERNEL)


def packed_kernel() -> Kernel | None:
    """The kernel that multiplies pack_int4's panels in this step (at any row count), or None
    where neither build can run."""
    return step_kernel() if _runs_here() else None


def rounds_x_to_8_bits(m: int) -> bool:
    """Whether the kernel that runs here multiplies m rows of x in pack_int4's panels rounded
    to 8 bits per group of 32 (int8_rows.h): in a decode step (or outside any), every build at
    INT8_X_ROWS (the AMX build only below its widening); 15-bit x, or bf16 x against widened
    panels, otherwise."""
    if not one_token_per_sequence():
        return False
    return m in INT8_X_ROWS and (amx_kernel() is None or m < AMX_WIDEN_ROWS)


@register_op("linear", name="cpu_gemm_int4", priority=10, devices=("cpu",), dtypes=(torch.bfloat16,),
             quant=("int4",), check=kernel_unavailable, prepare=pack_int4)
def gemm_int4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    if weight.dtype == torch.int8:  # a matrix the file keeps wider, in int8's layout (an expert stack)
        return cpu_int8.gemm_int8_linear(x, weight, bias)
    if weight.dtype != torch.uint8:  # kept in the model dtype
        if cpu_linear.kernel_unavailable() is None:
            return cpu_linear.gemm_linear(x, weight, bias)
        return F.linear(x, weight.to(x.dtype), bias)
    if weight.dim() == 2 and weight.shape[1] == 5 * k // 8:  # the reference's row layout
        return linear_int4_rows(x, weight, bias)
    if weight.shape[1] != PANEL_BYTES_PER_K * k:
        raise ValueError(f"input has {k} features; the packed int4 weight {tuple(weight.shape)} "
                         f"expects {weight.shape[1] // PANEL_BYTES_PER_K}")
    return run_packed(step_kernel(), x, weight, bias, weight.shape[0] * 16)  # (k: whole steps of 32)
