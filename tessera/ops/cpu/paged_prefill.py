"""The bf16 paged prefill attention builder for CPU (paged_prefill_avx2.c; on CPUs with AMX
its AMX build, paged_prefill_amx.h).

The pure-torch prefill runs SDPA once per sequence per layer; a chunk after a cached
prefix (chunked prefill, prefix hits) gathers the prefix into a dense copy and passes an
explicit mask, so every masked score is computed. The kernel reads K/V in place from the
block tables, skips the keys after each query's position, and takes all sequences of the
step in one call.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera.ops.attention.kv_quant import QUANTIZED_KV
from tessera.ops.attention.metadata import AttentionMetadata
from tessera.ops.attention.torch_paged import paged_prefill_ref
from tessera.ops.cpu.attention_sinks import sink_pointer
from tessera.ops.cpu.build import Kernel, cpu_flags
from tessera.ops.cpu.linear import amx_build
from tessera.ops.cpu.fp8_builds import fp8_builds, fp8_check
from tessera.ops.registry import OpSpec, register_op

_ARGS = (ctypes.c_void_p,) * 7 + (ctypes.c_int64,) * 6 + (ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int)
_KERNEL = Kernel("paged_prefill_avx2.c", "tessera_paged_prefill_bf16", _ARGS, ctypes.c_int)
# an 8-bit float cache: the same kernel built per format (kv_rows.h)
_FP8_KERNELS = fp8_builds(_KERNEL)
_FP8_CHECK = fp8_check(_FP8_KERNELS, needs_f16c=True)


@functools.lru_cache(maxsize=None)
def amx_kernel(kv_dtype: torch.dtype = torch.bfloat16) -> Kernel | None:
    """The AMX build for a cache of `kv_dtype` (both products on AMX tiles), where AMX runs
    here and it compiles; asked once, not per layer."""
    return amx_build(_KERNEL if kv_dtype == torch.bfloat16 else _FP8_KERNELS[kv_dtype])


def _amx(spec: object) -> list[str]:
    # Prefill is compute-bound: on AMX tiles torch's flash attention multiplies bf16 natively,
    # 2-3x what float32 FMAs on 8 lanes reach. Where this kernel's AMX build cannot run,
    # torch's SDPA keeps prefill (for an fp8 cache too: the torch op widens it to bf16 first).
    if "amx_bf16" in (cpu_flags() or ()):
        return ["this CPU has AMX, which torch's SDPA uses for bf16 prefill"]
    return []


def _check(spec: object) -> list[str]:
    if amx_kernel() is not None:
        return []
    return _amx(spec) or _KERNEL.check(spec)


def _check_fp8(spec: OpSpec) -> list[str]:
    if amx_kernel(spec.kv_dtype) is not None:
        return _FP8_CHECK(spec)
    return _amx(spec) or _FP8_CHECK(spec)


def bf16_kernel() -> Kernel:
    """The kernel for a bf16 cache: the AMX build on AMX hosts, the float32 FMA one elsewhere."""
    return amx_kernel() or _KERNEL


def _prefill(kernel: Kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
             sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    _, block_size, num_kv_heads, d = k_cache.shape
    if block_size & (block_size - 1):  # the kernel indexes blocks by shifts
        return paged_prefill_ref(query, key, value, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
    q = query.contiguous()
    tables, lens, starts = meta.prefill_int32()
    out = torch.empty_like(q)
    failed = kernel(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        starts.data_ptr(), out.data_ptr(), len(lens), q.shape[1], num_kv_heads, d, block_size,
        tables.shape[1], scale, sliding_window or 0, softcap or 0.0, sink_pointer(sinks), torch.get_num_threads())
    if failed == 1:
        raise MemoryError("paged_prefill_bf16 could not allocate its scratch buffers")
    if failed:
        raise RuntimeError(f"paged_prefill_bf16 failed with code {failed} (head size {d}, block size {block_size})")
    return out


@register_op("paged_attention", name="cpu_paged_prefill_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), phases=("prefill",), check=_check, sinks=True)
def paged_prefill_bf16(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, sliding_window: int | None = None,
                       softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D]: the prefill rows (after the decode rows), whose K/V the layer has
    already written to the cache -> [T, Hq, D]. `key`/`value` are not read."""
    return _prefill(bf16_kernel(), query, key, value, k_cache, v_cache, meta, scale,
                    sliding_window, softcap, sinks)


@register_op("paged_attention", name="cpu_paged_prefill_fp8", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), phases=("prefill",), kv_dtypes=QUANTIZED_KV,
             check=_check_fp8, sinks=True)
def paged_prefill_fp8(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, sliding_window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """paged_prefill_bf16 over a cache of 8-bit floats (kv_quant.py)."""
    kernel = amx_kernel(k_cache.dtype) or _FP8_KERNELS[k_cache.dtype]
    return _prefill(kernel, query, key, value, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
