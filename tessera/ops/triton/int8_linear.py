"""Int8 weight-only linear layers on CUDA (`--quantization int8`, and the LM head under
int4), in Triton.

The weight keeps the reference builder's row layout (tessera/ops/linear_int8.py: per output
feature its k int8 values, then its float32 scale's four bytes), so the two builders share
one prepared tensor. Each program converts a tile of int8 values to the activation dtype in
registers (exact: |q| <= 127) and multiplies on the matrix unit; the per-feature scale
multiplies the float32 sums once at the end. The weight crosses memory once, at one byte per
value, where the reference builder writes and reads a widened copy per call.

Tiles are fixed (64 outputs by 64 inputs; 16 rows of x when a call has at most 16, else 64):
nothing here has been timed on a GPU yet (docs/benchmarks.md says what awaits one).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.linear_int8 import linear_int8_rows, quantize_rows
from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.weight_only import launch_rows

BLOCK_K = 64


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def int8_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        rows = w_ptr + n.to(tl.int64)[:, None] * w_stride   # [BLOCK_N, 1] byte pointers
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            x = tl.load(x_ptr + m.to(tl.int64)[:, None] * x_stride + k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
        # each row's float32 scale: four little-endian bytes after its K values
        scale_at = w_ptr + n.to(tl.int64) * w_stride + K
        bits = tl.zeros((BLOCK_N,), dtype=tl.uint32)
        for b in tl.static_range(4):
            byte = tl.load(scale_at + b, mask=n_ok, other=0).to(tl.uint8, bitcast=True)
            bits |= byte.to(tl.uint32) << (8 * b)
        acc *= bits.to(tl.float32, bitcast=True)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m.to(tl.int64)[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    return int8_linear_kernel


def int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] times a quantize_rows weight [n, k + 4] (+ bias), in x's dtype."""
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] != k + 4:
        raise ValueError(f"int8_linear: input has {k} features; the int8 weight {tuple(weight.shape)} "
                         f"expects {weight.shape[1] - 4}")
    return launch_rows(_kernel(), x, weight, bias, n, BLOCK_K=BLOCK_K)


@register_op("linear", name="triton_int8_linear", priority=10, devices=("cuda",),
             dtypes=(torch.bfloat16, torch.float16), quant=("int8",), check=triton_missing,
             prepare=quantize_rows)
def triton_int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype not in (torch.bfloat16, torch.float16):
        return linear_int8_rows(x, weight, bias)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return int8_linear(x, weight, None if bias is None else bias.contiguous())
