"""Rotary embedding (rotate-half layout) of q and k in one Triton kernel: one program per
(token, head) over q's heads then k's, reading q and k where the QKV projection left them
(strided views, no copy). torch's builder is ~12 kernels per layer. Rounds each product and
the sum to the model dtype, as the torch op does, so results match it exactly. In bf16 (the
GPU default) the roundings are integer operations: on an H100 the `.to(bf16).to(float32)`
round trips did not round (folded away, it seems: the kernel was one bf16 step off torch in
a quarter of the values, as if it rounded once), and the interpreter's own conversion rounds
toward zero (rounding.py). In float32 nothing rounds between the products and their sum, so the
compiler fused them into FMAs (an H200 run: 346 of 1536 values off torch's separate ops):
fusion is off for this kernel."""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    global rounding  # a module global: the interpreter does not see this closure (fp8.py)
    from tessera.ops.triton import rounding

    @triton.jit
    def rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                      q_stride, k_stride, cos_stride, sin_stride, num_q_heads, head_size,
                      BLOCK_H: tl.constexpr, ROUND_BF16: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half = head_size // 2
        i = tl.arange(0, BLOCK_H)
        mask = i < half
        if head < num_q_heads:
            src = q_ptr + token * q_stride + head * head_size
            dst = q_out_ptr + (token * num_q_heads + head) * head_size
        else:
            num_k_heads = tl.num_programs(1) - num_q_heads
            src = k_ptr + token * k_stride + (head - num_q_heads) * head_size
            dst = k_out_ptr + (token * num_k_heads + head - num_q_heads) * head_size
        x1 = tl.load(src + i, mask=mask, other=0.0)
        x2 = tl.load(src + half + i, mask=mask, other=0.0)
        c1 = tl.load(cos_ptr + token * cos_stride + i, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + token * cos_stride + half + i, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + token * sin_stride + i, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + token * sin_stride + half + i, mask=mask, other=0.0).to(tl.float32)
        dt = x1.dtype
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product rounded
        o1 = rounding.rounded(a1 * c1, ROUND_BF16, dt) + rounding.rounded(-a2 * s1, ROUND_BF16, dt)
        o2 = rounding.rounded(a2 * c2, ROUND_BF16, dt) + rounding.rounded(a1 * s2, ROUND_BF16, dt)
        tl.store(dst + i, rounding.rounded(o1, ROUND_BF16, dt).to(dt), mask=mask)
        tl.store(dst + half + i, rounding.rounded(o2, ROUND_BF16, dt).to(dt), mask=mask)

    return rotary_kernel


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@register_op("rotary", name="triton_rotary", priority=20, devices=("cuda",), check=triton_missing)
def triton_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq*D], k: [T, Hk*D]; cos/sin: [T, 1, D] -> new q, k of the same shapes."""
    if head_size % 2 or q.shape[-1] % head_size or k.shape[-1] % head_size:
        raise ValueError(f"rotary needs an even head_size dividing q and k, got {head_size} "
                         f"for widths {q.shape[-1]}, {k.shape[-1]}")
    q, k = _rows(q), _rows(k)
    cos, sin = _rows(cos.reshape(cos.shape[0], -1)), _rows(sin.reshape(sin.shape[0], -1))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    tokens = q.shape[0]
    num_q, num_k = q.shape[-1] // head_size, k.shape[-1] // head_size
    if tokens:
        _kernel()[(tokens, num_q + num_k)](
            q, k, cos, sin, q_out, k_out, q.stride(0), k.stride(0), cos.stride(0), sin.stride(0),
            num_q, head_size, BLOCK_H=1 << max(0, (head_size // 2 - 1).bit_length()),
            ROUND_BF16=q.dtype == torch.bfloat16, num_warps=1, enable_fp_fusion=False)
    return q_out, k_out
