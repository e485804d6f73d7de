"""The fused bf16 gated activations on CPU (silu_and_mul_bf16.c): `silu_and_mul`, and
`gelu_tanh_and_mul` (Gemma's MLP) from the same source built with TESSERA_GELU_TANH.

torch's version chunks the packed projection and runs the activation and mul as two ops
with two full-size temporaries; at prefill sizes (1024 x 1536 on the default model) that is
~1 ms a layer, the kernel a tenth of it. Same rounding as the torch builder (bf16 after each
op). A decode step whose every op is a kernel is captured and replayed (decode_graphs.py):
with torch's gelu in the MLP, Gemma's steps ran eagerly.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Callable

import torch

from tessera.ops.activation import gelu_tanh_and_mul_ref, gelu_tanh_mul_ref, silu_and_mul_ref, silu_mul_ref
from tessera.ops.cpu.build import Kernel
from tessera.ops.registry import register_op


_KERNEL = Kernel("silu_and_mul_bf16.c", "tessera_silu_and_mul_bf16",
                 (ctypes.c_void_p,) * 2 + (ctypes.c_int64,) * 2 + (ctypes.c_int,), None,
                 fallback_source="silu_and_mul_avx2.c")
_GELU_KERNEL = dataclasses.replace(_KERNEL, defines=("TESSERA_GELU_TANH 1",))
# the same loop over two tensors' rows (gate, its stride, up, its stride, out, rows, h, threads)
_SILU_ROWS = Kernel("silu_and_mul_bf16.c", "tessera_act_mul_rows_bf16",
                    (ctypes.c_void_p, ctypes.c_int64) * 2 + (ctypes.c_void_p,) + (ctypes.c_int64,) * 2 + (ctypes.c_int,),
                    None, fallback_source="silu_and_mul_avx2.c")
_GELU_ROWS = dataclasses.replace(_SILU_ROWS, defines=("TESSERA_GELU_TANH 1",))


@register_op("silu_and_mul", name="cpu_silu_and_mul_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_KERNEL.check)
def silu_and_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated(_KERNEL, silu_and_mul_ref, gate_up)


@register_op("gelu_tanh_and_mul", name="cpu_gelu_tanh_and_mul_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_GELU_KERNEL.check)
def gelu_tanh_and_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated(_GELU_KERNEL, gelu_tanh_and_mul_ref, gate_up)


@register_op("gelu_tanh_mul", name="cpu_gelu_tanh_mul_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_GELU_ROWS.check)
def gelu_tanh_mul_bf16(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh_mul_ref's op: gate and up as 2-D rows of one shape (any row strides)."""
    return _two_tensors(_GELU_ROWS, gelu_tanh_mul_ref, gate, up)


@register_op("silu_mul", name="cpu_silu_mul_bf16", priority=10, devices=("cpu",),
             dtypes=(torch.bfloat16,), check=_SILU_ROWS.check)
def silu_mul_bf16(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu_mul_ref's op: gate and up as 2-D rows of one shape (any row strides)."""
    return _two_tensors(_SILU_ROWS, silu_mul_ref, gate, up)


def _two_tensors(kernel: Kernel, reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not (gate.dtype == up.dtype == torch.bfloat16 and gate.dim() == 2 and gate.shape == up.shape
            and gate.stride(1) == 1 and up.stride(1) == 1):
        return reference(gate, up)
    rows, h = gate.shape
    out = torch.empty((rows, h), dtype=torch.bfloat16)
    if rows and h:
        kernel(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), rows, h,
               torch.get_num_threads())
    return out


@functools.lru_cache(maxsize=None)
def silu_and_mul_kernel() -> Kernel | None:
    """silu_and_mul_bf16.c's kernel (gate_up, out, rows, h, threads), where it runs here."""
    return None if _KERNEL.check(None) else _KERNEL


@functools.lru_cache(maxsize=None)
def gelu_tanh_and_mul_kernel() -> Kernel | None:
    """The same source's GELU (tanh) build, where it runs here."""
    return None if _GELU_KERNEL.check(None) else _GELU_KERNEL


def _gated(kernel: Kernel, reference: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dtype != torch.bfloat16 or gate_up.shape[-1] % 2:
        return reference(gate_up)
    h = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty((*gate_up.shape[:-1], h), dtype=torch.bfloat16)
    rows = out.numel() // h if h else 0
    if rows:
        kernel(gate_up.data_ptr(), out.data_ptr(), rows, h, torch.get_num_threads())
    return out
