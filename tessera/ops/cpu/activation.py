"""The fused bf16 SiLU-and-mul builder for `silu_and_mul` on CPU (silu_and_mul_bf16.c).

torch's version chunks the packed projection and runs silu and mul as two ops with two
full-size temporaries; at prefill sizes (1024 x 1536 on the default model) that is ~1 ms a
layer, the kernel a tenth of it. Same rounding as the torch builder (bf16 after each op).
"""
from __future__ import annotations

import ctypes

import torch

from tessera.ops.activation import silu_and_mul_ref
from tessera.ops.cpu.build import Kernel
from tessera.ops.registry import register_op


_KERNEL = Kernel("silu_and_mul_bf16.c", "tessera_silu_and_mul_bf16",
                 (ctypes.c_void_p,) * 2 + (ctypes.c_int64,) * 2 + (ctypes.c_int,), None,
                 fallback_source="silu_and_mul_avx2.c")


@register_op("silu_and_mul", name="cpu_silu_and_mul_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_KERNEL.check)
def silu_and_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dtype != torch.bfloat16 or gate_up.shape[-1] % 2:
        return silu_and_mul_ref(gate_up)
    h = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty((*gate_up.shape[:-1], h), dtype=torch.bfloat16)
    rows = out.numel() // h if h else 0
    if rows:
        _KERNEL(gate_up.data_ptr(), out.data_ptr(), rows, h, torch.get_num_threads())
    return out
