"""Mamba-2's decode scan for CPU (ssm_scan.h, built as ssm_scan.c or, without AVX512,
ssm_scan_avx2.c): the `ssm_scan` op's decode phase, ssm_scan_decode_ref's signature and
semantics.

The torch reference gathers the slots' states, decays them, adds the write, scatters them
back and reads them again for y: several passes and full-size temporaries over a state of
2 MiB per sequence per layer at 64 heads of 64 x 128. The kernel makes one in-place pass,
taking x, B, C where the conv left them (column slices of its output) and dt where the
projection did. Its products and sums are rounded as torch's (the new state is torch's
wherever libm's step and decay equal torch's; they may differ in the last bit); y's dot
over d_state runs in another order.

It passes every size as a kernel argument and allocates only its output, so a decode step
made of kernels stays capturable (ops/cpu/graph.py).
"""
from __future__ import annotations

import ctypes

import torch

from tessera.ops.cpu.build import Kernel
from tessera.ops.linear_attention.mamba2 import ssm_scan_decode_ref
from tessera.ops.registry import register_op

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SCAN = Kernel("ssm_scan.c", "tessera_ssm_scan_decode", (_P,) * 7 + (_F, _F) + (_P,) * 3 + (_I64,) * 9 + (_INT, _INT),
               ctypes.c_int, fallback_source="ssm_scan_avx2.c")
_DTYPES = (torch.float32, torch.bfloat16)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [B, H, D] with its heads side by side in each row (rows may have any stride)."""
    _, s1, s2 = t.stride()
    return t if s2 == 1 and s1 == t.shape[2] else t.contiguous()


def _accepted(x, dt, dt_bias, A, B, C, D, state, slots) -> bool:
    """Types and shapes the kernel takes (anything else runs the torch reference)."""
    if x.dim() != 3 or B.dim() != 3 or dt.dim() != 2:
        return False
    b, h, p = x.shape
    n = B.shape[2]
    return (x.dtype in _DTYPES and B.dtype is x.dtype and C.dtype is x.dtype and dt.dtype in _DTYPES
            and dt_bias.dtype in _DTYPES and D.dtype in _DTYPES and A.dtype is torch.float32
            and state.dtype is torch.float32 and slots.dtype is torch.int64 and state.is_contiguous()
            and state.dim() == 4 and state.shape[1:] == (h, p, n) and C.shape == B.shape and B.shape[0] == b
            and dt.shape == (b, h) and dt_bias.shape == A.shape == D.shape == (h,) and slots.shape == (b,))


@register_op("ssm_scan", name="cpu_ssm_scan_decode", priority=10, devices=("cpu",), dtypes=_DTYPES,
             phases=("decode",), check=_SCAN.check)
def ssm_scan_decode(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor, limits: tuple[float, float], state: torch.Tensor,
                    slots: torch.Tensor) -> torch.Tensor:
    """ssm_scan_decode_ref's op: x [B, H, P], dt [B, H] (before softplus), dt_bias, A (float32),
    D [H], B, C [B, G, N], state [slots, H, P, N] float32 (updated in place at `slots` [B])
    -> [B, H, P] in x's dtype."""
    if not _accepted(x, dt, dt_bias, A, B, C, D, state, slots):
        return ssm_scan_decode_ref(x, dt, dt_bias, A, B, C, D, limits, state, slots)
    b, h, p = x.shape
    g, n = B.shape[1:]
    x, B, C = _rows(x), _rows(B), _rows(C)
    if dt.stride(1) != 1:
        dt = dt.contiguous()
    dt_bias, A, D, slots = dt_bias.contiguous(), A.contiguous(), D.contiguous(), slots.contiguous()
    out = torch.empty((b, h, p), dtype=x.dtype)
    bf16 = torch.bfloat16
    dtypes = (x.dtype is bf16) | (dt.dtype is bf16) << 1 | (dt_bias.dtype is bf16) << 2 | (D.dtype is bf16) << 3
    # nonzero: a shape the kernel does not take (d_state past its buffers, H % G), before it
    # touched anything
    if b and _SCAN(x.data_ptr(), dt.data_ptr(), dt_bias.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(),
                   D.data_ptr(), limits[0], limits[1], state.data_ptr(), slots.data_ptr(), out.data_ptr(),
                   b, h, p, n, g, x.stride(0), dt.stride(0), B.stride(0), C.stride(0), dtypes,
                   torch.get_num_threads()):
        return ssm_scan_decode_ref(x, dt, dt_bias, A, B, C, D, limits, state, slots)
    return out
