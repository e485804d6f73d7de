"""`--quantization int4`'s quantizer in C (quantize_int4.c): the same bits as the torch
version in tessera/ops/linear_int4.py, in one pass over the weight, rows over threads, so a
model quantizes at load several times faster (docs/benchmarks.md, session 35)."""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera.ops.cpu.build import Kernel
from tessera.ops.linear_int4 import GROUP

_KERNEL = Kernel("quantize_int4.c", "tessera_quantize_int4",
                 (ctypes.c_void_p, ctypes.c_int) + (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 2 + (ctypes.c_int,),
                 ctypes.c_int)


@functools.lru_cache(maxsize=None)
def kernel_runs() -> bool:
    """Whether the kernel builds and runs here, asked once: a failed build (no compiler) is
    not retried per matrix; torch's version runs then."""
    return not _KERNEL.check(None)


def quantize_int4_cpu(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """quantize_int4(weight) for a CPU float32 or bf16 [n, k] weight (k a multiple of 32),
    or None where the kernel does not apply (another device or dtype, no compiler)."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2
            or weight.shape[1] % GROUP or not kernel_runs()):
        return None
    w = weight.contiguous()
    n, k = w.shape
    codes = torch.empty((n, k), dtype=torch.uint8)
    d = torch.empty((n, k // GROUP), dtype=torch.float16)
    m = torch.empty((n, k // GROUP), dtype=torch.float16)
    if _KERNEL(w.data_ptr(), int(w.dtype == torch.bfloat16), codes.data_ptr(), d.data_ptr(), m.data_ptr(),
               n, k, torch.get_num_threads()):
        raise ValueError(f"int4 quantization: bad shape {tuple(w.shape)}")
    return codes, d, m
