"""MXFP4 expert stacks on CUDA, in Triton (gpt-oss's experts kept packed on GPUs too).

Each program dequantizes a tile of one expert's weight in registers, straight from the
checkpoint's layout (tessera/weights/mxfp4.py: per output row, 16 bytes of E2M1 codes per
32 inputs, the low nibble first, and a power-of-two scale per 32): a code's magnitude is
0.5 * m for exponent bits 0, else 2^(e - 1) * (1 + m / 2), its fourth bit the sign; times
the block's scale, every value is exact in bf16, which tl.dot multiplies on the matrix
unit. The weight crosses memory once, at 4.25 bits per value. The expert dispatch (sorting
a step's (token, expert) pairs) is ops/moe.py's `run_grouped`, a launch per expert used.

Tiles are fixed (64 outputs by 64 inputs; 16 rows of x when an expert has at most 16, else
64): nothing here has been timed on a GPU yet.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch

from tessera.ops.moe_mxfp4 import Mxfp4Stack, run_mxfp4_experts
from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing
from tessera.weights.mxfp4 import BLOCK

BLOCK_N = 64


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def mxfp4_linear_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, x_stride, out_stride,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        rows = w_ptr + n.to(tl.int64)[:, None] * (K // 2)       # [BLOCK_N, 1]: each row's code bytes
        scale_rows = s_ptr + n.to(tl.int64)[:, None] * (K // GROUP)
        groups: tl.constexpr = BLOCK_K // GROUP
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):                          # K % BLOCK_K == 0 (the caller's choice)
            packed = tl.load(rows + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :], mask=n_ok[:, None], other=0)
            codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))
            exponent = (codes >> 1) & 3
            half = (codes & 1).to(tl.float32) * 0.5
            magnitude = tl.where(exponent == 0, half, tl.exp2(exponent.to(tl.float32) - 1.0) * (1.0 + half))
            value = tl.where((codes & 8) != 0, -magnitude, magnitude)
            s = tl.load(scale_rows + (k0 // GROUP + tl.arange(0, groups))[None, :], mask=n_ok[:, None], other=127)
            scale = tl.exp2(s.to(tl.float32) - 127.0)
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, groups, GROUP)), (BLOCK_N, BLOCK_K))
            w = (value * scale).to(x_ptr.dtype.element_ty)
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m.to(tl.int64)[:, None] * x_stride + k[None, :], mask=m_ok[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m.to(tl.int64)[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    return mxfp4_linear_kernel


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, 32 G] @ W.T (+ bias) -> [T, rows] in x's dtype, W as blocks [rows, G, 16] and
    scales [rows, G] (contiguous uint8)."""
    rows, groups = scales.shape
    k = x.shape[-1]
    if k != groups * BLOCK:
        raise ValueError(f"input has {k} features; the MXFP4 weight takes {groups * BLOCK}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((x.shape[0], rows), dtype=x.dtype, device=x.device)
    if x.shape[0] and rows:
        block_m = 16 if x.shape[0] <= 16 else 64
        bias = None if bias is None else bias.to(x.dtype).contiguous()
        _kernel()[(-(-rows // BLOCK_N), -(-x.shape[0] // block_m))](
            x, blocks, scales, bias if bias is not None else x, out, x.shape[0], rows, k, x.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=64 if k % 64 == 0 else BLOCK,
            GROUP=BLOCK, num_warps=4, num_stages=3)
    return out


@register_op("moe_experts", name="triton_mxfp4_experts", priority=10, devices=("cuda",),
             dtypes=(torch.bfloat16, torch.float16), quant=("mxfp4",), check=triton_missing)
def triton_mxfp4_experts(x: torch.Tensor, w13: Mxfp4Stack, w2: Mxfp4Stack, weights: torch.Tensor,
                         ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                         activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """moe_mxfp4.mxfp4_experts_ref with each projection in the kernel."""
    return run_mxfp4_experts(mxfp4_linear, x, w13, w2, weights, ids, b13, b2, activation)
