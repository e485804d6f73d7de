"""The bf16 GEMV builder for `linear` on CPUs with AVX512-BF16.

Decode at small batch multiplies a few rows by every weight matrix; torch's bf16 GEMM
streams weights at 11-14 GB/s there (docs/benchmarks.md), a third of what the memory
delivers. For up to `max_rows` rows this builder runs gemv_bf16.c; larger batches (and
anything not contiguous bf16) go to F.linear, whose GEMM is the better kernel there.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F

from tessera.ops.cpu.build import load_kernel, missing_cpu_flags, unavailable_reason
from tessera.ops.registry import OpSpec, register_op

# Up to this many rows the kernel beats torch's GEMM on the 2-core host (bf16, 2 threads,
# medians of 7; 3072x576 / 576x1536 / 49152x576 weights): 1 row 2.1x / 2.2x / 1.5x,
# 2 rows 1.6x / 1.8x / 1.1x, 4 rows 1.2x / 1.4x / 1.06x, 6 rows 0.9x / 1.0x / 0.96x.
MAX_ROWS = 4


def cpu_has_avx512_bf16() -> bool:
    return not missing_cpu_flags()


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    lib = load_kernel("gemv_bf16.c")
    lib.tessera_gemv_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tessera_gemv_bf16.restype = ctypes.c_int
    return lib


def kernel_unavailable() -> str | None:
    """Why the kernel cannot run here, or None."""
    if not cpu_has_avx512_bf16():
        return "this CPU has no AVX512-BF16"
    return unavailable_reason("gemv_bf16.c")


def _check(spec: OpSpec) -> list[str]:
    reason = kernel_unavailable()
    return [reason] if reason else []


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    status = _library().tessera_gemv_bf16(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        m, n, k, torch.get_num_threads())
    if status:
        raise ValueError(f"gemv_bf16 refused shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    return y


@register_op("linear", name="cpu_gemv_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_check)
def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (not 0 < rows <= MAX_ROWS or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or not weight.is_contiguous() or weight.shape[1] != k
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))):
        return F.linear(x, weight, bias)
    y = _gemv(x.reshape(rows, k).contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
