"""The grouped quantizers in C (quantize_groups.c): `--quantization int4`'s and the CPU int8
format's, the same bits as the torch versions in tessera/ops/linear_int4.py and
linear_int8.py, in one pass over the weight, rows over threads, so a model quantizes at load
several times faster (docs/benchmarks.md, sessions 35 and 37)."""
from __future__ import annotations

import ctypes
import functools

import torch

from tessera.ops.cpu.build import Kernel

GROUP = 32  # (linear_int4.GROUP, linear_int8.GROUP)
_INT4 = Kernel("quantize_groups.c", "tessera_quantize_int4",
               (ctypes.c_void_p, ctypes.c_int) + (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 2 + (ctypes.c_int,),
               ctypes.c_int)
_INT8 = Kernel("quantize_groups.c", "tessera_quantize_int8",
               (ctypes.c_void_p, ctypes.c_int) + (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 2 + (ctypes.c_int,),
               ctypes.c_int)


@functools.lru_cache(maxsize=None)
def kernel_runs() -> bool:
    """Whether the kernels build and run here, asked once: a failed build (no compiler) is
    not retried per matrix; torch's versions run then."""
    return not _INT4.check(None)


def _takes(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and weight.shape[1] % GROUP == 0 and kernel_runs())


def _run(kernel: Kernel, weight: torch.Tensor,
         *parts: tuple[tuple[int, ...], torch.dtype]) -> tuple[torch.Tensor, ...]:
    """`kernel` on `weight` (one _takes) into new tensors of `parts` (shape, dtype)."""
    w = weight.contiguous()
    n, k = w.shape
    out = tuple(torch.empty(shape, dtype=dtype) for shape, dtype in parts)
    status = kernel(w.data_ptr(), int(w.dtype == torch.bfloat16), *(o.data_ptr() for o in out),
                    n, k, torch.get_num_threads())
    if status == 2:
        raise MemoryError("grouped quantization: no memory for a row's steps")
    if status:
        raise ValueError(f"grouped quantization: bad shape {tuple(w.shape)}")
    return out


def quantize_int4_cpu(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """quantize_int4(weight) for a CPU float32 or bf16 [n, k] weight (k a multiple of 32),
    or None where the kernel does not apply (another device or dtype, no compiler)."""
    if not _takes(weight):
        return None
    n, k = weight.shape
    groups = (n, k // GROUP)
    return _run(_INT4, weight, ((n, k), torch.uint8), (groups, torch.float16), (groups, torch.float16))


def quantize_int8_cpu(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """quantize_int8_groups(weight) for a CPU float32 or bf16 [n, k] weight (k a multiple of
    32), or None where the kernel does not apply."""
    if not _takes(weight):
        return None
    n, k = weight.shape
    return _run(_INT8, weight, ((n, k), torch.int8), ((n, k // GROUP), torch.float16), ((n,), torch.float32))
