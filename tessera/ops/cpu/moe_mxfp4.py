"""The MXFP4 expert builder for CPUs: each expert's two projections read its packed blocks
and widen them in registers, so decode streams a quarter of bf16's bytes. bf16 inputs on
AVX512 CPUs take mxfp4_linear.c: bf16 pair dots of the decoded weights; on AMX hosts, from
DEQUANTIZE_MIN_ROWS rows (a prefill's), the weights dequantized exactly and multiplied on AMX
tiles by torch's bf16 GEMM. A decode's steps run the whole layer in one call
(moe_experts.run_layer: the projections, the activation, gpt-oss's clamped SwiGLU included,
and the weighted sum in C, so a captured decode graph replays it). float32 inputs, and CPUs
with AVX2 only, take mxfp4_linear_avx2.c (float32 throughout) per expert, the activation
between the projections in torch."""
from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F

from tessera.ops.cpu.build import Kernel
from tessera.ops.cpu.linear import has_amx
from tessera.ops.cpu.moe_experts import MXFP4_BLOCKS, StackArgs, activation_args, decode_sized, run_layer
from tessera.ops.moe_mxfp4 import Mxfp4Stack, run_mxfp4_experts
from tessera.ops.registry import register_op

_ARGS = (ctypes.c_void_p,) * 5 + (ctypes.c_int64,) * 3 + (ctypes.c_int,)
_KERNEL = Kernel("mxfp4_linear_avx2.c", "tessera_mxfp4_linear", _ARGS, ctypes.c_int)
_BF16_KERNEL = Kernel("mxfp4_linear.c", "tessera_mxfp4_linear_bf16", _ARGS, ctypes.c_int)
_DEQUANTIZE = Kernel("mxfp4_linear.c", "tessera_mxfp4_dequantize_bf16",
                     (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 2 + (ctypes.c_int,), ctypes.c_int)
# From this many rows an expert's projection on an AMX host dequantizes its weights (exactly,
# in C, ~2 ms for gpt-oss-20b's 5760 x 2880 gate-up) and multiplies on AMX tiles through torch's
# bf16 GEMM; that matrix, 2 threads: 16 rows 4.7 ms either way, 32 rows 3.9 against the
# kernel's 12.0, 64 rows 6.7 against 24.9, 128 rows 10.5 against 50.7, 512 rows 24.6 against 264.
DEQUANTIZE_MIN_ROWS = 32


@lru_cache(maxsize=1)
def _bf16_kernel_runs() -> bool:
    """Whether this CPU runs the AVX512 bf16 build (decided once, not per projection)."""
    return not _BF16_KERNEL.check(None)


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, 32 G] @ W.T (+ bias) -> [T, rows] in x's dtype, W as blocks [rows, G, 16] and
    scales [rows, G] (contiguous uint8); float32 sums."""
    rows, groups = scales.shape
    if x.shape[-1] != groups * 32:
        raise ValueError(f"input has {x.shape[-1]} features; the MXFP4 weight takes {groups * 32}")
    kernel = _BF16_KERNEL if x.dtype == torch.bfloat16 and _bf16_kernel_runs() else _KERNEL
    if kernel is _BF16_KERNEL and x.shape[0] >= DEQUANTIZE_MIN_ROWS and has_amx():
        weight = torch.empty((rows, groups * 32), dtype=torch.bfloat16)
        if not _DEQUANTIZE(blocks.contiguous().data_ptr(), scales.contiguous().data_ptr(), weight.data_ptr(),
                           rows, groups, torch.get_num_threads()):
            return F.linear(x.contiguous(), weight, None if bias is None else bias.to(torch.bfloat16))
    xs = (x if kernel is _BF16_KERNEL else x.float()).contiguous()
    b = None if bias is None else bias.float().contiguous()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    if x.shape[0] and kernel(xs.data_ptr(), blocks.data_ptr(), scales.data_ptr(), None if b is None else b.data_ptr(),
                             out.data_ptr(), x.shape[0], rows, groups, torch.get_num_threads()):
        raise MemoryError("mxfp4_linear could not allocate its buffers")
    return out.to(x.dtype)


@register_op("moe_experts", name="cpu_mxfp4_experts", priority=10, devices=("cpu",), quant=("mxfp4",),
             check=_KERNEL.check)
def mxfp4_experts_cpu(x: torch.Tensor, w13: Mxfp4Stack, w2: Mxfp4Stack, weights: torch.Tensor,
                      ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                      activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """moe_mxfp4.mxfp4_experts_ref with each projection in the kernel."""
    if decode_sized(x, weights, ids, b13, b2) and _bf16_kernel_runs():
        act = activation_args(activation)
        (blocks13, _), (blocks2, _) = w13, w2
        inter = blocks13.shape[1] // 2
        if (act is not None and blocks13.shape[2] * 32 == x.shape[1] and blocks2.shape[1] == x.shape[1]
                and blocks2.shape[2] * 32 == inter and blocks2.shape[0] == blocks13.shape[0]
                and all(t.is_contiguous() for t in (*w13, *w2))):
            return run_layer(x, weights, ids, blocks13.shape[0], inter, _stack_args(w13), b13,
                             _stack_args(w2), b2, act)
    return run_mxfp4_experts(mxfp4_linear, x, w13, w2, weights, ids, b13, b2, activation)


def _stack_args(stack: Mxfp4Stack) -> StackArgs:
    blocks, scales = stack
    kernel = _BF16_KERNEL.address
    return (MXFP4_BLOCKS, blocks.data_ptr(), blocks.stride(0), scales.data_ptr(), scales.stride(0), kernel, kernel, 1)
