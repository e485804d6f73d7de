"""Rotary and the KV cache write in one Triton kernel: a decode step's layer otherwise
launches two small kernels between its QKV projection and attention (1.3 + 2.6 us on an
H200, plus the launch gap between them: docs/benchmarks.md, session 30).

One program per (token, head) over q's heads then k's, reading q, k and v where the QKV
projection left them (strided views). A q head is rotated into the new q; a k head is
rotated into the new k and, with the token's v head, written to the cache at the token's
slot (none for slot -1: a captured graph's padded rows), in the cache's dtype: the
model's, or an 8-bit float rounded in-kernel as kv_write.py does. Rotation rounds as the
torch op does (rotation.py), so q, k and the cache hold exactly what rotary followed by
kv_write gives. Whole rotate-half heads only: layers with partial or interleaved rotary
take the two ops (Attention.forward)."""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.attention.kv_quant import QUANTIZED_KV
from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.launch import launch_options
from tessera.ops.triton.paged_decode import kv_cache_operands
from tessera.ops.triton.rotary import rotary_launch, rows_of


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    # module globals: the interpreter does not see this closure's names (fp8.py)
    global fp8, grid_dependency, rotation
    from tessera.ops.triton import fp8, grid_dependency, rotation

    @triton.jit
    def rotary_kv_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, k_cache_ptr,
                               v_cache_ptr, slot_ptr, q_stride, k_stride, v_stride, cos_stride, sin_stride,
                               num_q_heads, head_size, BLOCK_H: tl.constexpr, ROUND_BF16: tl.constexpr,
                               KV_FORMAT: tl.constexpr, PDL: tl.constexpr):
        grid_dependency.start(PDL)
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half = head_size // 2
        cos_row, sin_row = cos_ptr + token * cos_stride, sin_ptr + token * sin_stride
        if head < num_q_heads:
            o1, o2, i, mask = rotation.rotate_head(q_ptr + token * q_stride + head * head_size, cos_row, sin_row,
                                                   half, BLOCK_H, ROUND_BF16)
            dst = q_out_ptr + (token * num_q_heads + head) * head_size
            tl.store(dst + i, o1, mask=mask)
            tl.store(dst + half + i, o2, mask=mask)
        else:
            kv_head = head - num_q_heads
            num_kv_heads = tl.num_programs(1) - num_q_heads
            o1, o2, i, mask = rotation.rotate_head(k_ptr + token * k_stride + kv_head * head_size, cos_row,
                                                   sin_row, half, BLOCK_H, ROUND_BF16)
            row = (token * num_kv_heads + kv_head) * head_size
            tl.store(k_out_ptr + row + i, o1, mask=mask)
            tl.store(k_out_ptr + row + half + i, o2, mask=mask)
            slot = tl.load(slot_ptr + token)
            if slot >= 0:
                cached = (slot * num_kv_heads + kv_head) * head_size
                fp8.store_kv(k_cache_ptr + cached + i, o1, mask, KV_FORMAT)
                fp8.store_kv(k_cache_ptr + cached + half + i, o2, mask, KV_FORMAT)
                v_src = v_ptr + token * v_stride + kv_head * head_size
                fp8.store_kv(v_cache_ptr + cached + i, tl.load(v_src + i, mask=mask), mask, KV_FORMAT)
                fp8.store_kv(v_cache_ptr + cached + half + i, tl.load(v_src + half + i, mask=mask), mask,
                             KV_FORMAT)

    return rotary_kv_write_kernel


@register_op("rotary_kv_write", name="triton_rotary_kv_write", priority=20, devices=("cuda",),
             kv_dtypes=(None, *QUANTIZED_KV), check=triton_missing)
def triton_rotary_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, head_size: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor,
                           has_padding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq*D], k / v: [T, Hk*D]; cos / sin: [T, 1, D] -> rotated q [T, Hq*D] and k
    [T, Hk*D]; the rotated k and v go into caches [num_blocks, block_size, Hk, D] at
    `slot_mapping` (slot -1 writes nothing, whatever `has_padding` says)."""
    if v.shape[-1] != k.shape[-1]:
        raise ValueError(f"rotary_kv_write needs v as wide as k, got {v.shape[-1]} and {k.shape[-1]}")
    run = rotary_launch(q, k, cos, sin, head_size)
    v = rows_of(v)
    if run.q.shape[0]:
        k_cache, v_cache, kv_format = kv_cache_operands(k_cache, v_cache)
        _kernel()[(run.q.shape[0], run.num_q + run.num_k)](
            run.q, run.k, v, run.cos, run.sin, run.q_out, run.k_out, k_cache, v_cache, slot_mapping,
            run.q.stride(0), run.k.stride(0), v.stride(0), run.cos.stride(0), run.sin.stride(0), run.num_q,
            head_size, BLOCK_H=run.block_h, ROUND_BF16=q.dtype == torch.bfloat16, KV_FORMAT=kv_format,
            num_warps=1, enable_fp_fusion=False, **launch_options(q))
    return run.q_out, run.k_out
