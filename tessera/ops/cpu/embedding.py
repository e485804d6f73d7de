"""The CPU `embedding` builder (embedding.c): a row gather in one C call.

F.embedding is a single op already; the kernel exists so that a decode step is kernel
calls from end to end (tessera/ops/cpu/graph.py replays it without Python). Bit-exact: it
copies bytes. A scaled embedding (Gemma's) multiplies in the same call, rounding as torch.
"""
from __future__ import annotations

import ctypes

import torch

from tessera.ops.cpu.build import Kernel
from tessera.ops.embedding import embedding_ref
from tessera.ops.registry import register_op


_KERNEL = Kernel("embedding.c", "tessera_embedding",
                 (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 3, ctypes.c_int)
_SCALED = Kernel("embedding.c", "tessera_embedding_scaled",
                 (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 3 + (ctypes.c_float, ctypes.c_int), ctypes.c_int)


@register_op("embedding", name="cpu_embedding", priority=10, devices=("cpu",), check=_KERNEL.check)
def embedding_cpu(input_ids: torch.Tensor, weight: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    if (input_ids.dtype != torch.int64 or not input_ids.is_contiguous() or weight.dim() != 2
            or not weight.is_contiguous()
            or (scale is not None and weight.dtype not in (torch.bfloat16, torch.float32))):
        return embedding_ref(input_ids, weight, scale)
    out = torch.empty((*input_ids.shape, weight.shape[1]), dtype=weight.dtype)
    if scale is None:
        failed = _KERNEL(input_ids.data_ptr(), weight.data_ptr(), out.data_ptr(), input_ids.numel(),
                         weight.shape[1] * weight.element_size(), weight.shape[0])
    else:
        failed = _SCALED(input_ids.data_ptr(), weight.data_ptr(), out.data_ptr(), input_ids.numel(),
                         weight.shape[1], weight.shape[0], scale, int(weight.dtype == torch.bfloat16))
    if failed:
        bad = input_ids[(input_ids < 0) | (input_ids >= weight.shape[0])]
        raise IndexError(f"ids {bad.unique().tolist()[:8]} are outside the table's {weight.shape[0]} rows")
    return out
