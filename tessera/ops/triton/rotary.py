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

from dataclasses import dataclass
from functools import lru_cache

import torch

from tessera.ops.registry import register_op
from tessera.ops.rotary import rotary_ref
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.launch import launch_options


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    # module globals: the interpreter does not see this closure's names (fp8.py)
    global grid_dependency, rotation
    from tessera.ops.triton import grid_dependency, rotation

    @triton.jit
    def rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                      q_stride, k_stride, cos_stride, sin_stride, num_q_heads, head_size,
                      BLOCK_H: tl.constexpr, ROUND_BF16: tl.constexpr, PDL: tl.constexpr):
        grid_dependency.start(PDL)
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half = head_size // 2
        if head < num_q_heads:
            src = q_ptr + token * q_stride + head * head_size
            dst = q_out_ptr + (token * num_q_heads + head) * head_size
        else:
            num_k_heads = tl.num_programs(1) - num_q_heads
            src = k_ptr + token * k_stride + (head - num_q_heads) * head_size
            dst = k_out_ptr + (token * num_k_heads + head - num_q_heads) * head_size
        o1, o2, i, mask = rotation.rotate_head(src, cos_ptr + token * cos_stride, sin_ptr + token * sin_stride,
                                               half, BLOCK_H, ROUND_BF16)
        tl.store(dst + i, o1, mask=mask)
        tl.store(dst + half + i, o2, mask=mask)

    return rotary_kernel


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its rows (a view where it already has: q/k views of QKV)."""
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass
class RotaryLaunch:
    """What a rotary kernel launch takes (this one's, rotary_kv_write.py's): q / k and the
    cos / sin rows with unit strides along rows, the new q / k, the heads of each."""

    q: torch.Tensor
    k: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_out: torch.Tensor
    k_out: torch.Tensor
    num_q: int
    num_k: int
    block_h: int  # half a head, to a power of two


def rotary_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  head_size: int) -> RotaryLaunch:
    if head_size % 2 or q.shape[-1] % head_size or k.shape[-1] % head_size:
        raise ValueError(f"rotary needs an even head_size dividing q and k, got {head_size} "
                         f"for widths {q.shape[-1]}, {k.shape[-1]}")
    # [tokens, heads, width] views (MLA's rotary parts of wider heads) as rows, copied if need be
    q, k = (rows_of(t.reshape(t.shape[0], -1)) for t in (q, k))
    return RotaryLaunch(q, k, rows_of(cos.reshape(cos.shape[0], -1)), rows_of(sin.reshape(sin.shape[0], -1)),
                        torch.empty(q.shape, dtype=q.dtype, device=q.device),
                        torch.empty(k.shape, dtype=k.dtype, device=k.device),
                        q.shape[-1] // head_size, k.shape[-1] // head_size,
                        1 << max(0, (head_size // 2 - 1).bit_length()))


@register_op("rotary", name="triton_rotary", priority=20, devices=("cuda",), check=triton_missing)
def triton_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  head_size: int, full_head: int | None = None,
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq*D], k: [T, Hk*D]; cos/sin: [T, 1, D] -> new q, k of the same shapes.
    Partial or interleaved rotary runs the torch builder."""
    if full_head not in (None, head_size) or interleaved:
        return rotary_ref(q, k, cos, sin, head_size, full_head, interleaved)
    run = rotary_launch(q, k, cos, sin, head_size)
    if run.q.shape[0]:
        _kernel()[(run.q.shape[0], run.num_q + run.num_k)](
            run.q, run.k, run.cos, run.sin, run.q_out, run.k_out, run.q.stride(0), run.k.stride(0),
            run.cos.stride(0), run.sin.stride(0), run.num_q, head_size, BLOCK_H=run.block_h,
            ROUND_BF16=q.dtype == torch.bfloat16, num_warps=1, enable_fp_fusion=False, **launch_options(q))
    return run.q_out, run.k_out
