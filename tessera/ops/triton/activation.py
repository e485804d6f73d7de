"""Gated activations over a packed gate-up row in Triton: one kernel instead of torch's
chunk, activation and product (three kernels and an intermediate per layer and step).
The activation is rounded to the model dtype before the product, as the torch op does."""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.launch import launch_options

BLOCK = 1024  # output elements per program


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    global gating, grid_dependency  # module globals: the interpreter does not see this closure (fp8.py)
    from tessera.ops.triton import gating, grid_dependency

    @triton.jit
    def gated_kernel(x_ptr, out_ptr, width, x_stride, ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        grid_dependency.start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * width + cols, gating.gated(gate, up, ACT).to(out_ptr.dtype.element_ty), mask=mask)

    return gated_kernel


def _gated(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and width:
        _kernel()[(rows.shape[0], -(-width // BLOCK))](rows, out, width, rows.stride(0),
                                                       ACT=2 if gelu_tanh else 1, BLOCK=BLOCK,
                                                       **launch_options(gate_up))
    return out


@register_op("silu_and_mul", name="triton_silu_and_mul", priority=20, devices=("cuda",), check=triton_missing)
def triton_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated(gate_up, gelu_tanh=False)


@register_op("gelu_tanh_and_mul", name="triton_gelu_tanh_and_mul", priority=20, devices=("cuda",),
             check=triton_missing)
def triton_gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _gated(gate_up, gelu_tanh=True)
