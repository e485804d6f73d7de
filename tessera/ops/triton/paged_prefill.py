"""Varlen prefill attention over the paged cache in Triton: each program takes BLOCK_M
queries of one prefill sequence and one head and walks that sequence's cached keys
(prefix-cached context and this chunk alike: the chunk's K/V are written before attention
runs) in tiles of TILE_N tokens with an online softmax, looking each token's block up in the
table, so any power-of-two block size works. Causal by absolute position (key tiles past a
query tile's last position are never read), or up to each row's key limit where the step has
them (an image's tokens attending to each other), with sliding windows, soft-capping and
attention sinks (a logit per head in the softmax's denominator, gpt-oss); GQA reads the shared
KV head. An 8-bit float cache (kv_quant.py) is read as bytes and widened to the
query's dtype in-kernel (tessera/ops/triton/fp8.py, as in paged_decode.py)."""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.attention.kv_quant import QUANTIZED_KV
from tessera.ops.attention.metadata import AttentionMetadata
from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.paged_decode import (NO_WINDOW, _next_power_of_2, dot_precision, fp8_in_hardware,
                                             kv_cache_operands)


def prefill_tiles(head_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(query rows, key tokens) per step: 64 x 64 while a head row is at most 256 bytes
    (128 wide in bf16), smaller tiles for wider rows, which would spill registers. float32
    counts double: its IEEE tl.dot runs on FMAs, not tensor cores, and holds more live
    values (tests/ops/triton_compile.py reports registers and spills per shape). `dtype` is
    the query's, which an 8-bit cache's rows are widened to in registers."""
    row_bytes = head_size * dtype.itemsize * (2 if dtype == torch.float32 else 1)
    if row_bytes <= 256:
        return 64, 64
    if row_bytes <= 512:
        return 32, 32
    return (16, 32) if row_bytes <= 1024 else (16, 16)  # > 1024: MLA's 576-wide latent heads


@lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    global fp8  # a module global: the interpreter does not see this closure (fp8.py)
    from tessera.ops.triton import fp8

    # which rows are decodes and how wide the tables are change every step: unspecialised
    # (see paged_decode.py)
    @triton.jit(do_not_specialize=["first_seq", "first_row", "table_width"])
    def prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, lens_ptr, starts_ptr, limits_ptr,
                       sinks_ptr, first_seq, first_row, scale, softcap, window,
                       num_heads, num_kv_heads, head_size, table_width,
                       BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       TILE: tl.constexpr, USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                       KV_FORMAT: tl.constexpr, HW_FP8: tl.constexpr, HAS_LIMITS: tl.constexpr,
                       USE_SINKS: tl.constexpr):
        seq = first_seq + tl.program_id(0)
        head = tl.program_id(1)
        tile = tl.program_id(2)
        kv_head = head // (num_heads // num_kv_heads)
        start_row = tl.load(starts_ptr + seq)
        q_len = tl.load(starts_ptr + seq + 1) - start_row
        if tile * BLOCK_M < q_len:
            ctx = tl.load(lens_ptr + seq)
            m_idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            m_mask = m_idx < q_len
            q_pos = ctx - q_len + m_idx                      # absolute positions
            d = tl.arange(0, BLOCK_D)
            d_mask = d < head_size
            rows = start_row - first_row + m_idx              # rows of the prefill query tensor
            q = tl.load(q_ptr + (rows[:, None] * num_heads + head) * head_size + d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            if HAS_LIMITS:  # the last key each row sees (its own position, or past it)
                q_limit = tl.load(limits_ptr + rows, mask=m_mask, other=0)
                last = tl.minimum(tl.max(tl.where(m_mask, q_limit, 0)) + 1, ctx)
            else:
                q_limit = q_pos
                last = tl.minimum(ctx - q_len + (tile + 1) * BLOCK_M, ctx)  # keys past this are masked
            lowest = tl.maximum(ctx - q_len + tile * BLOCK_M - window + 1, 0)
            row = num_kv_heads * head_size
            offs = tl.arange(0, TILE)
            for pos0 in range((lowest // TILE) * TILE, last, TILE):
                k_pos = pos0 + offs
                in_ctx = k_pos < ctx
                block = tl.load(tables_ptr + seq * table_width + k_pos // BLOCK_SIZE, mask=in_ctx, other=0)
                base = (block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE) * row + kv_head * head_size
                kv_mask = in_ctx[:, None] & d_mask[None, :]
                k = fp8.load_kv(k_cache_ptr + base[:, None] + d[None, :], kv_mask, q, KV_FORMAT, True, HW_FP8)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
                if USE_SOFTCAP:
                    s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
                allowed = (k_pos[None, :] <= q_limit[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
                allowed = allowed & m_mask[:, None]
                s = tl.where(allowed, s, -float("inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows with nothing yet
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                v = fp8.load_kv(v_cache_ptr + base[:, None] + d[None, :], kv_mask, q, KV_FORMAT, True, HW_FP8)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new
            if USE_SINKS:  # the sink's exp in the denominator, rescaled to max(m, sink)
                sink = tl.load(sinks_ptr + head).to(tl.float32)
                top = tl.maximum(m_i, sink)
                kept = tl.exp(m_i - top)
                out = acc * (kept / (l_i * kept + tl.exp(sink - top)))[:, None]
            else:
                out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + (rows[:, None] * num_heads + head) * head_size + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])

    return prefill_kernel


@register_op("paged_attention", name="triton_paged_prefill", priority=20, devices=("cuda",),
             phases=("prefill",), kv_dtypes=(None, *QUANTIZED_KV), check=triton_missing, key_limits=True,
             sinks=True)
def triton_paged_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, sliding_window: int | None = None,
                         softcap: float | None = None, sinks: torch.Tensor | None = None,
                         hardware_fp8: bool | None = None) -> torch.Tensor:
    """query [T, Hq, D]: the prefill rows (after the decodes), whose K/V are already in the
    cache -> [T, Hq, D]. `key` / `value` are not read (the cache holds them, in the model
    dtype or an 8-bit float, read widened to the query's dtype; `hardware_fp8` overrides
    paged_decode.fp8_in_hardware, for tests)."""
    num_heads, head_size = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    first = meta.num_decodes
    num_prefills = meta.num_seqs - first
    out = torch.empty_like(query)
    if num_prefills == 0:
        return out
    max_q = max(meta.query_lens_list[first:])
    block_m, tile = prefill_tiles(head_size, query.dtype)
    grid = (num_prefills, num_heads, -(-max_q // block_m))
    hw_fp8 = fp8_in_hardware(k_cache, hardware_fp8)
    k_cache, v_cache, fmt = kv_cache_operands(k_cache, v_cache)
    limits = meta.key_limits
    _kernel()[grid](
        query.contiguous(), k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, meta.seq_lens if limits is None else limits,
        meta.seq_lens if sinks is None else sinks, first, meta.num_decode_tokens, scale, softcap or 1.0,
        sliding_window or NO_WINDOW, num_heads, num_kv_heads, head_size, meta.block_tables.shape[1],
        BLOCK_SIZE=block_size, BLOCK_D=_next_power_of_2(max(head_size, 16)), BLOCK_M=block_m,
        TILE=tile, USE_SOFTCAP=softcap is not None, PRECISION=dot_precision(query.dtype),
        KV_FORMAT=fmt, HW_FP8=hw_fp8, HAS_LIMITS=limits is not None, USE_SINKS=sinks is not None,
        num_warps=8 if head_size > 256 else 4)  # a 1024-wide accumulator over 4 warps would spill
    return out
