"""The bf16 GEMM builder for `linear` on CPUs with AVX512-BF16.

Decode multiplies a few rows by every weight matrix. At one row torch's bf16 GEMM streams
weights at 11-14 GB/s (docs/benchmarks.md), a third of what the memory delivers; at 8-32
rows it reaches about half of the machine's bf16 rate. Up to `MAX_ROWS` rows this builder
runs gemm_bf16.c on the weight as loaded; prefill-sized inputs (and anything not bf16) go
to F.linear, whose blocked GEMM is the better kernel there.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F

from tessera.ops.cpu.build import load_kernel, missing_cpu_flags, unavailable_reason
from tessera.ops.registry import OpSpec, register_op

# Up to this many rows the kernel beats torch's GEMM on the 2-core host (bf16, 2 threads,
# medians of 30; 960x576 / 3072x576 / 576x1536 / 49152x576 weights): 1 row 3.3x / 2.8x /
# 3.2x / 1.5x, 8 rows 1.9x / 1.6x / 1.8x / 1.1x, 32 rows 1.3x / 1.2x / 1.2x / 0.9x,
# 128 rows 1.1x / 1.0x / 1.0x / 0.9x.
MAX_ROWS = 32


def cpu_has_avx512_bf16() -> bool:
    return not missing_cpu_flags()


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    lib = load_kernel("gemm_bf16.c")
    lib.tessera_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.tessera_gemm_bf16.restype = ctypes.c_int
    return lib


def kernel_unavailable() -> str | None:
    """Why the kernel cannot run here, or None."""
    if not cpu_has_avx512_bf16():
        return "this CPU has no AVX512-BF16"
    return unavailable_reason("gemm_bf16.c")


def _check(spec: OpSpec) -> list[str]:
    reason = kernel_unavailable()
    return [reason] if reason else []


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    status = _library().tessera_gemm_bf16(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        m, n, k, torch.get_num_threads())
    if status:
        raise ValueError(f"gemm_bf16 refused shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    return y


@register_op("linear", name="cpu_gemm_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_check)
def gemm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (not 0 < rows <= MAX_ROWS or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or not weight.is_contiguous() or weight.shape[1] != k
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))):
        return F.linear(x, weight, bias)
    y = _gemm(x.reshape(rows, k).contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
