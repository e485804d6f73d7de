"""The bf16 rotary builder for `rotary` on CPU (rotary_bf16.c).

torch's rotate-half is ~10 small ops per call (view, chunk, neg, cat, two muls, add,
flatten) on each of q and k; at decode sizes their dispatch is most of its cost. The kernel
reads q and k where the packed QKV projection left them and rounds as the torch builder
does, so results are bit-exact.
"""
from __future__ import annotations

import ctypes

import torch

from tessera.ops.cpu.build import Kernel
from tessera.ops.registry import register_op
from tessera.ops.rotary import rotary_ref


_KERNEL = Kernel("rotary_bf16.c", "tessera_rotary_bf16",
                 (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64) * 2 + (ctypes.c_void_p,) * 2 + (ctypes.c_int64,)
                 + (ctypes.c_void_p,) * 2 + (ctypes.c_int64,) * 5 + (ctypes.c_int,) * 2, None,
                 fallback_source="rotary_avx2.c")


def _rows(x: torch.Tensor) -> bool:
    """2-D with contiguous rows (a column slice of a contiguous matrix is fine), or 3-D
    [tokens, heads, width] with each head's values adjacent (heads any stride apart: MLA's
    rotary parts of its query heads)."""
    return x.stride(-1) == 1 and (x.dim() == 2 or (x.dim() == 3 and x.stride(1) >= x.shape[2]))


def _heads(x: torch.Tensor, width: int) -> tuple[int, int]:
    """(heads, values from one head to the next) of a _rows tensor."""
    return (x.shape[1] // width, width) if x.dim() == 2 else (x.shape[1], x.stride(1))


@register_op("rotary", name="cpu_rotary_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_KERNEL.check)
def rotary_bf16(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                head_size: int, full_head: int | None = None,
                interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_ref's op; with `full_head`, each head's other dimensions are copied in the
    same pass; `interleaved` pairs are turned in place (rotary_forms.h). q and k may be
    [tokens, heads, width] views (out: [tokens, heads * width], as rotary_ref's)."""
    tokens, width = q.shape[0], full_head or head_size
    if (head_size % 2 or width < head_size or q.shape[-1] % width or k.shape[-1] % width
            or any(t.dtype != torch.bfloat16 for t in (q, k, cos, sin))
            or not (_rows(q) and _rows(k)) or cos.shape[-1] != head_size
            or cos.numel() != tokens * head_size or cos.shape[0] != tokens or sin.shape != cos.shape
            or k.shape[0] != tokens
            or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0)):
        return rotary_ref(q, k, cos, sin, head_size, full_head, interleaved)
    (q_heads, q_head), (k_heads, k_head) = _heads(q, width), _heads(k, width)
    q_out = torch.empty((tokens, q_heads * width), dtype=torch.bfloat16)
    k_out = torch.empty((tokens, k_heads * width), dtype=torch.bfloat16)
    if tokens:
        _KERNEL(q.data_ptr(), q.stride(0), q_head, k.data_ptr(), k.stride(0), k_head, cos.data_ptr(), sin.data_ptr(),
                cos.stride(0), q_out.data_ptr(), k_out.data_ptr(), tokens, q_heads, k_heads, head_size, width,
                int(interleaved), torch.get_num_threads())
    return q_out, k_out
