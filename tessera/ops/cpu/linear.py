"""The bf16 GEMM builder for `linear` on AVX512 CPUs (gemm_bf16.c; native bf16 dot products
with AVX512-BF16, float32 FMAs on widened values without it).

Decode multiplies a few rows by every weight matrix: at one row torch's bf16 GEMM streams
weights at 11-14 GB/s (docs/benchmarks.md), a third of what the memory delivers, and at
8-32 rows it reaches about half of the machine's bf16 rate.

Weights whose shapes allow it (out features a multiple of 16, in features even: every
projection of the supported families) are repacked once after loading (`pack_weight`, the
builder's `prepare`) into 16-feature panels; the packed kernel then serves every row count,
prefill included, from that one copy (the plain weight is dropped; a tied LM head packs its
own copy and leaves the embedding's rows alone). Weights that cannot be packed keep their
layout: the row-layout kernel takes up to `MAX_ROWS` rows, F.linear the rest. On CPUs with
AMX the panels are AMX's B tiles as they lie: from a few rows the product runs on the tiles
(gemm_packed_amx.c), a decode batch's and a prefill's alike.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging

import torch
import torch.nn.functional as F

from tessera.ops.cpu.build import AMX_DEFINE, Kernel, cpu_flags, extensions_used, unavailable_reason
from tessera.ops.registry import OpSpec, register_op

logger = logging.getLogger(__name__)

# Up to this many rows the row-layout kernel beats torch's GEMM on the 2-core host (bf16, 2 threads,
# medians of 30; 960x576 / 3072x576 / 576x1536 / 49152x576 weights): 1 row 3.3x / 2.8x /
# 3.2x / 1.5x, 8 rows 1.9x / 1.6x / 1.8x / 1.1x, 32 rows 1.3x / 1.2x / 1.2x / 0.9x,
# 128 rows 1.1x / 1.0x / 1.0x / 0.9x.
MAX_ROWS = 32
# With AMX (Sapphire Rapids and later Xeons) the packed weights' panels are AMX's own B
# tiles (gemm_packed_amx.c): 0.5-2.5 TFLOP/s on 2 cores from 16 rows, 7-15x the AVX512
# kernel's 90-128 GFLOP/s, 1.3-1.7x from 3 rows; at 1-2 rows (memory-bound) the AVX512
# kernel is as fast or faster (1536 x 576 and the 49152 x 576 LM head, 2 threads). The two
# round differently, so the threshold keeps every captured decode bucket on one side (1 and
# 2 are buckets of their own: runner/decode_graphs.py), and a row's AMX bits do not depend
# on its batch (a padded bucket replays what eager ran).
AMX_KERNEL_MIN_ROWS = 3
# Where that kernel cannot run (a compiler without -mamx-tile, k not a multiple of 32),
# torch's bf16 GEMM still runs on AMX tiles (oneDNN): from this many rows it wins even after
# unpacking the weight for the call (an int32 transpose); a batch-32 decode lost to it.
AMX_MIN_ROWS = 128


_GEMM_ARGS = (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 3 + (ctypes.c_int,)
_GEMM = Kernel("gemm_bf16.c", "tessera_gemm_bf16", _GEMM_ARGS, ctypes.c_int)
_GEMM_PACKED = Kernel("gemm_bf16.c", "tessera_gemm_packed_bf16", _GEMM_ARGS, ctypes.c_int)
# CPUs without AVX512: the same packed layout, float32 FMAs on 8 lanes (gemm_bf16_avx2.c)
_GEMM_PACKED_AVX2 = Kernel("gemm_bf16_avx2.c", "tessera_gemm_packed_bf16_avx2", _GEMM_ARGS, ctypes.c_int)
# CPUs with AMX: the same packed layout multiplied on AMX tiles
_GEMM_PACKED_AMX = Kernel("gemm_packed_amx.c", "tessera_gemm_packed_amx", _GEMM_ARGS, ctypes.c_int)


def kernel_unavailable() -> str | None:
    """Why the kernel cannot run here (no AVX512, no compiler), or None."""
    return unavailable_reason("gemm_bf16.c")


def _check(spec: OpSpec) -> list[str]:
    reason = kernel_unavailable()
    return [reason] if reason else []


def _call(kernel: Kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          n: int) -> torch.Tensor:
    """y [m, n] = x [m, k] times `weight` (plain or packed) through gemm_bf16.c's `kernel`."""
    m, k = x.shape
    y = torch.empty((m, n), dtype=torch.bfloat16)
    status = kernel(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
        m, n, k, torch.get_num_threads())
    _raise_for(status, kernel, x, weight)
    return y


def _raise_for(status: int, kernel: Kernel, x: torch.Tensor, weight: torch.Tensor) -> None:
    if status == 2:  # a float32 copy of x or of a panel pair (no AVX512-BF16), AMX's padded rows
        raise MemoryError(f"{kernel.symbol}: no memory for working copies of x {tuple(x.shape)} "
                          "or of a weight panel pair")
    if status == 3:
        raise RuntimeError(f"{kernel.symbol}: the OS refused AMX's tile state")
    if status:
        raise ValueError(f"{kernel.symbol} refused shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _call(_GEMM, x, weight, bias, weight.shape[0])


def is_packed(weight: torch.Tensor) -> bool:
    """Packed weights are 3-D [n / 16, k / 2, 32]; plain ones 2-D [n, k]."""
    return weight.dim() == 3


def packable(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 16 == 0
            and k % 2 == 0 and n >= 16 and k >= 2)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] -> the packed [n / 16, k / 2, 32] layout of gemm_bf16.c (and gemm_bf16_avx2.c):
    packed[p, j, 2 c + e] = w[16 p + c, 2 j + e]; or `weight` itself when its shape or dtype
    does not allow packing."""
    if is_packed(weight) or not packable(weight):
        return weight
    n, k = weight.shape
    packed = torch.empty((n // 16, k // 2, 32), dtype=weight.dtype)
    # each pair of k moves whole, as one int32 (6x faster than permuting bf16 halves)
    packed.view(torch.int32).view(n // 16, k // 2, 16).copy_(
        weight.contiguous().view(torch.int32).view(n // 16, 16, k // 2).transpose(1, 2))
    return packed


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The plain [n, k] weight back from its packed layout, a new tensor. (Each 4-byte pair
    of k moves whole: transposing int32 runs about 7x faster than permuting bf16 halves.)"""
    p, pairs, _ = packed.shape
    plain = torch.empty((p * 16, pairs * 2), dtype=packed.dtype)
    plain.view(torch.int32).view(p, 16, pairs).copy_(packed.view(torch.int32).transpose(1, 2))
    return plain


@functools.lru_cache(maxsize=None)
def has_amx() -> bool:
    """AMX's bf16 tiles, which torch's bf16 GEMM (oneDNN) multiplies on."""
    return "amx_bf16" in (cpu_flags() or ())


@functools.lru_cache(maxsize=None)
def amx_kernel_ready() -> bool:
    """gemm_packed_amx.c builds here and the OS grants AMX's tiles: one tiny product says so,
    on ctypes buffers and past any graph recorder (it may first be asked inside a capture,
    which no torch op may enter)."""
    if not has_amx() or unavailable_reason(_GEMM_PACKED_AMX.source):
        return False
    one, thirty_two = 0x3F80, 0x4200  # bf16 1.0 and 32.0: ones times ones over k = 32
    x, packed, y = (ctypes.c_uint16 * 96)(*[one] * 96), (ctypes.c_uint16 * 512)(*[one] * 512), (ctypes.c_uint16 * 48)()
    status = _GEMM_PACKED_AMX._fn(ctypes.addressof(x), ctypes.addressof(packed), None, ctypes.addressof(y),
                                  3, 16, 32, 1)
    if status or any(v != thirty_two for v in y):
        logger.warning("the AMX GEMM is not used: %s", "the OS refused AMX's tiles" if status == 3
                       else f"status {status}, a wrong result on a probe")
        return False
    return True


@functools.lru_cache(maxsize=None)
def amx_build(kernel: Kernel, *defines: str) -> Kernel | None:
    """`kernel`'s source built for AMX (widened_gemm.h's AMX multiply; `defines` besides),
    where AMX runs here and that build compiles; else None."""
    amx = dataclasses.replace(kernel, defines=(*kernel.defines, AMX_DEFINE, *defines), fallback_source=None)
    return amx if amx_kernel_ready() and unavailable_reason(amx.source, amx.defines) is None else None


# The defines that build gemm_int8.c / gemm_int4.c without their 8-bit x rows (an empty
# range): the kernels of steps with a prompt's or draft's rows.
EXACT_X = ("Q8_MIN_ROWS 0", "Q8_END_ROWS 0")


def vnni_build(kernel: Kernel) -> bool:
    """Whether `kernel` runs here as its AVX512 source built with AVX512-VNNI: where the int8
    and int4 GEMMs have their 8-bit x tiles (vpdpbusd)."""
    return kernel.runnable_source() == kernel.source and "avx512_vnni" in extensions_used()


def packed_kernels(k: int, avx2: bool = False) -> tuple[Kernel, Kernel, int]:
    """(kernel below `wide_rows` rows, kernel from them, wide_rows) that multiply packed
    weights of `k` in features: gemm_linear's choice (up to AMX_MIN_ROWS rows where the AMX
    kernel cannot run; `avx2`: gemm_linear_avx2's)."""
    if avx2:
        return _GEMM_PACKED_AVX2, _GEMM_PACKED_AVX2, 1
    wide = _GEMM_PACKED_AMX if k % 32 == 0 and amx_kernel_ready() else _GEMM_PACKED
    return _GEMM_PACKED, wide, AMX_KERNEL_MIN_ROWS


def _packed_linear(kernel: Kernel, x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    k = x.shape[-1]
    if packed.shape[1] * 2 != k:
        raise ValueError(f"input has {k} features, the packed weight expects {packed.shape[1] * 2}")
    return run_packed(kernel, x, packed, bias, packed.shape[0] * 16)


def run_packed(kernel: Kernel, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               n: int) -> torch.Tensor:
    """x [..., k] times a weight of `n` out features packed for `kernel` (one of the packed
    GEMMs' signature: x, weight, bias, y, m, n, k, threads), in bf16; the caller has checked
    that the weight's shape fits k."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows == 0:
        return x.new_zeros((*x.shape[:-1], n))
    # the decode case, kept to a handful of Python operations: ~120 calls per step
    if not (x.dim() == 2 and x.dtype == torch.bfloat16 and bias is None and x.is_contiguous()):
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        return _call(kernel, x.to(torch.bfloat16).reshape(rows, k).contiguous(), packed, bias, n).view(
            *x.shape[:-1], n)
    y = torch.empty((rows, n), dtype=torch.bfloat16)
    _raise_for(kernel(x.data_ptr(), packed.data_ptr(), None, y.data_ptr(), rows, n, k, torch.get_num_threads()),
               kernel, x, packed)
    return y


@register_op("linear", name="cpu_gemm_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_check, prepare=pack_weight)
def gemm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if is_packed(weight):
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        small, wide, wide_rows = packed_kernels(k)  # (the MoE layer's one call chooses so too)
        if rows >= wide_rows and wide is not small:
            return _packed_linear(wide, x, weight, bias)
        if rows >= AMX_MIN_ROWS and has_amx():  # a prefill's rows: torch on AMX tiles
            return F.linear(x.to(torch.bfloat16), unpack_weight(weight),
                            None if bias is None else bias.to(torch.bfloat16))
        return _packed_linear(small, x, weight, bias)
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (not 0 < rows <= MAX_ROWS or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or not weight.is_contiguous() or weight.shape[1] != k
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))):
        return F.linear(x, weight, bias)
    y = _gemm(x.reshape(rows, k).contiguous(), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


# Below the AVX512 builder: chosen only where that one cannot run (a CPU without AVX512).
@register_op("linear", name="cpu_gemm_bf16_avx2", priority=9, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_GEMM_PACKED_AVX2.check, prepare=pack_weight)
def gemm_linear_avx2(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if is_packed(weight):
        return _packed_linear(_GEMM_PACKED_AVX2, x, weight, bias)
    return F.linear(x, weight, bias)  # shapes the panels do not fit
