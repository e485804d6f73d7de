"""Int4 weight-only linear layers on CUDA (`--quantization int4`), in Triton.

The weight keeps the reference builder's row layout (tessera/ops/linear_int4.py: per output
feature the k / 2 bytes of codes, then each group of 32's float16 step d and offset m), so
the two builders share one prepared tensor. Each program dequantizes a tile of the weight
in registers (a nibble per weight, then d * q + m in float32, then the activation dtype)
and multiplies it on the matrix unit: the weight crosses memory once, at 5 bits per value,
where the reference builder writes and reads a whole dequantized copy per call.

Tiles are fixed (64 outputs by 64 inputs, or 32 where in-features are not a multiple of 64;
16 rows of x when a call has at most 16, else 64): nothing here has been timed on a GPU yet
(docs/benchmarks.md says what awaits one).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.linear_int4 import GROUP, linear_int4_rows, pack_int4_rows
from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.int8_linear import triton_int8_linear
from tessera.ops.triton.weight_only import launch_rows


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def int4_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        rows = w_ptr + n.to(tl.int64)[:, None] * w_stride   # [BLOCK_N, 1] byte pointers
        scales = rows + K // 2                              # each row's (d, m) float16 pairs
        groups: tl.constexpr = BLOCK_K // GROUP
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):                     # K % BLOCK_K == 0 (the caller's choice)
            packed = tl.load(rows + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :],
                             mask=n_ok[:, None], other=0)
            codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))
            g = scales + (k0 // GROUP + tl.arange(0, groups))[None, :] * 4  # [BLOCK_N, groups]
            # little-endian float16 bytes: d at g, m at g + 2
            step = (tl.load(g, mask=n_ok[:, None], other=0).to(tl.uint16)
                    | (tl.load(g + 1, mask=n_ok[:, None], other=0).to(tl.uint16) << 8))
            offset = (tl.load(g + 2, mask=n_ok[:, None], other=0).to(tl.uint16)
                      | (tl.load(g + 3, mask=n_ok[:, None], other=0).to(tl.uint16) << 8))
            step = step.to(tl.float16, bitcast=True).to(tl.float32)
            offset = offset.to(tl.float16, bitcast=True).to(tl.float32)
            step = tl.reshape(tl.broadcast_to(step[:, :, None], (BLOCK_N, groups, GROUP)), (BLOCK_N, BLOCK_K))
            offset = tl.reshape(tl.broadcast_to(offset[:, :, None], (BLOCK_N, groups, GROUP)), (BLOCK_N, BLOCK_K))
            w = (codes.to(tl.float32) * step + offset).to(x_ptr.dtype.element_ty)
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m.to(tl.int64)[:, None] * x_stride + k[None, :], mask=m_ok[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m.to(tl.int64)[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    return int4_linear_kernel


def int4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] times a pack_int4_rows weight [n, 5 k / 8] (+ bias), in x's dtype."""
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] != 5 * k // 8 or k % GROUP:
        raise ValueError(f"int4_linear: input has {k} features; the int4 weight {tuple(weight.shape)} "
                         f"expects {weight.shape[1] * 8 // 5}")
    return launch_rows(_kernel(), x, weight, bias, n, BLOCK_K=64 if k % 64 == 0 else GROUP, GROUP=GROUP)


@register_op("linear", name="triton_int4_linear", priority=10, devices=("cuda",),
             dtypes=(torch.bfloat16, torch.float16), quant=("int4",), check=triton_missing,
             prepare=pack_int4_rows)
def triton_int4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.dtype == torch.int8:  # a matrix the file keeps wider, in int8's layout (an expert stack)
        return triton_int8_linear(x, weight, bias)
    if weight.dtype != torch.uint8 or x.dtype not in (torch.bfloat16, torch.float16):
        return linear_int4_rows(x, weight, bias)  # float weights kept by pack_int4_rows
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return int4_linear(x, weight, None if bias is None else bias.contiguous())
