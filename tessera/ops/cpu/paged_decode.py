"""The bf16 paged decode attention builder for CPU (paged_decode_bf16.c).

The pure-torch decode gathers every sequence's blocks into a dense [B, Hk, L, D] copy and
runs SDPA over it, ~70 us per layer at batch 1 on the default model; the kernel reads K
and V in place from the block tables. Sliding windows and soft-capping are supported. An
8-bit float cache (--kv-cache-dtype fp8) has its own build of the AVX2 kernel per format.
"""
from __future__ import annotations

import ctypes

import torch

from tessera.ops.attention.kv_quant import QUANTIZED_KV
from tessera.ops.attention.metadata import AttentionMetadata
from tessera.ops.attention.torch_paged import paged_decode_ref
from tessera.ops.cpu.attention_sinks import sink_pointer
from tessera.ops.cpu.build import Kernel
from tessera.ops.cpu.fp8_builds import fp8_builds, fp8_check
from tessera.ops.registry import register_op


_ARGS = (ctypes.c_void_p, ctypes.c_int64) + (ctypes.c_void_p,) * 5 + (ctypes.c_int64,) * 6 + (ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int)
_KERNEL = Kernel("paged_decode_bf16.c", "tessera_paged_decode_bf16", _ARGS, ctypes.c_int,
                 fallback_source="paged_decode_avx2.c")
# an 8-bit float cache: the AVX2 kernel built per format (kv_rows.h), on any CPU with AVX2
_FP8_KERNELS = fp8_builds(Kernel("paged_decode_avx2.c", "tessera_paged_decode_bf16", _ARGS, ctypes.c_int))


def _decode(kernel: Kernel, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, sliding_window: int | None,
            softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    b = meta.num_decodes
    num_heads, d = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if block_size & (block_size - 1):  # the kernel indexes blocks by shifts
        return paged_decode_ref(query, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
    q = query[:b]
    if q.stride(2) != 1 or q.stride(1) != d:  # (a token's heads side by side: read in place)
        q = q.contiguous()
    tables, lens = meta.decode_int32()
    out = torch.empty((b, num_heads, d), dtype=q.dtype)
    failed = kernel(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), b, num_heads, num_kv_heads, d, block_size, tables.shape[1], scale,
        sliding_window or 0, softcap or 0.0, sink_pointer(sinks), torch.get_num_threads())
    if failed == 2:
        raise ValueError(f"paged_decode_bf16 needs a power-of-two block size, got {block_size}")
    if failed:
        raise MemoryError("paged_decode_bf16 could not allocate its score buffer")
    return out


@register_op("paged_attention", name="cpu_paged_decode_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), phases=("decode",), check=_KERNEL.check, sinks=True)
def paged_decode_bf16(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, Hq, D] (one token per decoding sequence) -> [B, Hq, D]."""
    return _decode(_KERNEL, query, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)


@register_op("paged_attention", name="cpu_paged_decode_fp8", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), phases=("decode",), kv_dtypes=QUANTIZED_KV,
             check=fp8_check(_FP8_KERNELS, needs_f16c=True), sinks=True)
def paged_decode_fp8(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """paged_decode_bf16 over a cache of 8-bit floats (kv_quant.py)."""
    return _decode(_FP8_KERNELS[k_cache.dtype], query, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
