"""The bf16 builder for `lora_rows` on CPU (lora_rows_avx2.c): one kernel call per layer,
which a captured kernel graph replays (torch's gather-and-bmm reference computes, so a
graph could not hold it)."""
from __future__ import annotations

import ctypes

import torch

from tessera.ops.cpu.build import Kernel
from tessera.ops.lora_rows import lora_rows_ref
from tessera.ops.registry import register_op

_KERNEL = Kernel("lora_rows_avx2.c", "tessera_lora_rows_bf16",
                 (ctypes.c_void_p,) * 6 + (ctypes.c_int64,) * 4 + (ctypes.c_int,), ctypes.c_int)


@register_op("lora_rows", name="cpu_lora_rows_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_KERNEL.check)
def lora_rows_bf16(x: torch.Tensor, out: torch.Tensor, row_slots: torch.Tensor, slot_ranks: torch.Tensor,
                   a: torch.Tensor, b_t: torch.Tensor) -> None:
    tensors = (x, out, a, b_t)
    if (any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in tensors)
            or row_slots.dtype != torch.int32 or slot_ranks.dtype != torch.int32 or x.dim() != 2):
        return lora_rows_ref(x, out, row_slots, slot_ranks, a, b_t)
    status = _KERNEL(x.data_ptr(), out.data_ptr(), row_slots.data_ptr(), slot_ranks.data_ptr(), a.data_ptr(),
                     b_t.data_ptr(), x.shape[0], x.shape[1], out.shape[1], a.shape[1], torch.get_num_threads())
    if status == 2:
        raise MemoryError(f"lora_rows: no memory for a float32 copy of a row of {x.shape[1]} features")
    if status:  # max_lora_rank (<= 512) x 3 packed shards stays below this
        raise ValueError(f"lora_rows: slot capacity {a.shape[1]} exceeds the kernel's 2048")
