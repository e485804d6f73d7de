"""KV write by slot mapping in Triton: one program per token copies its K and V rows into
the paged cache; slot -1 (padded rows of a captured graph) writes nothing. With an 8-bit
float cache (kv_quant.py) the rows are rounded to it in-kernel (tessera/ops/triton/fp8.py),
bit for bit as kv_quant.quantize_kv, and stored as bytes."""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.attention.kv_quant import QUANTIZED_KV
from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.launch import launch_options
from tessera.ops.triton.paged_decode import kv_cache_operands


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    global fp8, grid_dependency  # module globals: the interpreter does not see this closure (fp8.py)
    from tessera.ops.triton import fp8, grid_dependency

    @triton.jit
    def kv_write_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, row_size,
                        BLOCK: tl.constexpr, KV_FORMAT: tl.constexpr, PDL: tl.constexpr):
        grid_dependency.start(PDL)
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            for start in range(0, row_size, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < row_size
                src = token * row_size + cols
                dst = slot * row_size + cols
                fp8.store_kv(k_cache_ptr + dst, tl.load(key_ptr + src, mask=mask), mask, KV_FORMAT)
                fp8.store_kv(v_cache_ptr + dst, tl.load(value_ptr + src, mask=mask), mask, KV_FORMAT)

    return kv_write_kernel


@register_op("kv_write", name="triton_kv_write", priority=20, devices=("cuda",),
             kv_dtypes=(None, *QUANTIZED_KV), check=triton_missing)
def triton_kv_write(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, has_padding: bool = False) -> None:
    """key/value [T, Hk, D] into caches [num_blocks, block_size, Hk, D] at `slot_mapping`,
    in the caches' dtype: the model's, or an 8-bit float (float32 / bf16 / fp16 rows
    rounded to nearest even, saturating)."""
    tokens = key.shape[0]
    if tokens == 0:
        return
    row_size = key.shape[1] * key.shape[2]
    k_cache, v_cache, kv_format = kv_cache_operands(k_cache, v_cache)
    _kernel()[(tokens,)](key.contiguous(), value.contiguous(), k_cache, v_cache,
                         slot_mapping, row_size, BLOCK=256, KV_FORMAT=kv_format, **launch_options(key))
