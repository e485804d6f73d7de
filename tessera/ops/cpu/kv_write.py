"""The CPU `kv_write` builders: one C call per layer instead of two index_copy_ calls (plus
a boolean gather when rows are padded). kv_write.c copies bytes (bit-exact);
kv_write_fp8.c rounds bf16 / float32 rows into an 8-bit float cache as
kv_quant.quantize_kv does, so a decode step stays kernels only (a captured graph)."""
from __future__ import annotations

import ctypes

import torch

from tessera.ops.attention.kv_quant import QUANTIZED_KV
from tessera.ops.attention.torch_paged import kv_write_ref
from tessera.ops.cpu.build import Kernel
from tessera.ops.cpu.fp8_builds import fp8_builds, fp8_check
from tessera.ops.registry import register_op


_KERNEL = Kernel("kv_write.c", "tessera_kv_write",
                 (ctypes.c_void_p, ctypes.c_int64) * 2 + (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 3,
                 ctypes.c_int)
_FP8_KERNELS = fp8_builds(Kernel("kv_write_fp8.c", "tessera_kv_write_fp8",
                                 (ctypes.c_void_p, ctypes.c_int64) * 2 + (ctypes.c_void_p,) * 3
                                 + (ctypes.c_int64,) * 3 + (ctypes.c_int,), ctypes.c_int))


def _rows(x: torch.Tensor) -> bool:
    """[T, Hk, D] whose rows are contiguous (a view of a row-major projection is fine)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _kernel_layout(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Whether the C writers can take these as they are (dtypes are each writer's own)."""
    return (_rows(key) and _rows(value) and value.shape == key.shape
            and key.shape[1] * key.shape[2] == k_cache.shape[2] * k_cache.shape[3]
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous())


@register_op("kv_write", name="cpu_kv_write", priority=10, devices=("cpu",), check=_KERNEL.check)
def kv_write_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, has_padding: bool = False) -> None:
    row = k_cache.shape[2] * k_cache.shape[3]
    if (key.dtype != k_cache.dtype or value.dtype != v_cache.dtype
            or not _kernel_layout(key, value, k_cache, v_cache, slot_mapping)):
        return kv_write_ref(key, value, k_cache, v_cache, slot_mapping, has_padding)
    elem = key.element_size()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if _KERNEL(key.data_ptr(), key.stride(0) * elem, value.data_ptr(), value.stride(0) * elem,
               k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
               row * elem, num_slots):
        raise IndexError(f"a slot in {slot_mapping.tolist()} is outside the cache's {num_slots} slots")


@register_op("kv_write", name="cpu_kv_write_fp8", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16, torch.float32), kv_dtypes=QUANTIZED_KV,
             check=fp8_check(_FP8_KERNELS, needs_f16c=False))
def kv_write_cpu_fp8(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, has_padding: bool = False) -> None:
    row = k_cache.shape[2] * k_cache.shape[3]
    if (key.dtype not in (torch.bfloat16, torch.float32) or value.dtype != key.dtype
            or k_cache.dtype not in _FP8_KERNELS or v_cache.dtype != k_cache.dtype
            or not _kernel_layout(key, value, k_cache, v_cache, slot_mapping)):
        return kv_write_ref(key, value, k_cache, v_cache, slot_mapping, has_padding)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if _FP8_KERNELS[k_cache.dtype](
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0], row, num_slots,
            int(key.dtype == torch.bfloat16)):
        raise IndexError(f"a slot in {slot_mapping.tolist()} is outside the cache's {num_slots} slots")
