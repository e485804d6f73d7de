"""The launch shared by the weight-only Triton linears (int4_linear.py, int8_linear.py): x of
any leading shape as rows, one program per 64 outputs and per 16 rows (calls of at most 16
rows: decode) or 64 rows, the output in x's dtype."""
from __future__ import annotations

from typing import Any

import torch

BLOCK_N = 64


def launch_rows(kernel: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int,
                **constexprs: Any) -> torch.Tensor:
    """y [..., n] = x [..., k] times `weight` (+ bias) through `kernel`, whose arguments are
    (x, w, bias, out, M, N, K, x_stride, w_stride, out_stride, HAS_BIAS, BLOCK_M, BLOCK_N,
    then `constexprs`)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        block_m = 16 if m <= 16 else 64
        kernel[(-(-n // BLOCK_N), -(-m // block_m))](
            rows, weight, bias if bias is not None else rows, out, m, n, k,
            rows.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, num_warps=4, num_stages=3, **constexprs)
    return out.reshape(*x.shape[:-1], n)
