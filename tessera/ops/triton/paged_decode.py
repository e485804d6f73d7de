"""Paged decode attention in Triton: one query token per sequence against its cached
blocks, GQA without repeating K/V, sliding windows and soft-capping.

Long contexts are split: each program takes one (sequence, query head, partition of
`partition_size` tokens) and keeps a running max / sum / weighted V over its blocks
(online softmax); a second kernel merges the partitions. With one partition the merge is
a copy, so short contexts pay almost nothing for it.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from tessera.ops.attention.metadata import AttentionMetadata
from tessera.ops.registry import register_op
from tessera.ops.triton.availability import triton_missing

PARTITION_SIZE = 512  # tokens per program; a multiple of every block size the cache uses
NO_WINDOW = 1 << 30   # "no sliding window" as a window longer than any context


@lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr,
                       m_ptr, l_ptr, acc_ptr, scale, softcap, window,
                       num_heads, num_kv_heads, head_size, table_width, num_partitions,
                       BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, PARTITION: tl.constexpr,
                       USE_SOFTCAP: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        part = tl.program_id(2)
        kv_head = head // (num_heads // num_kv_heads)
        length = tl.load(lens_ptr + seq)
        first = tl.maximum(length - window, 0)  # window: the host passes a huge one for "none"
        start = tl.maximum(part * PARTITION, first)
        end = tl.minimum((part + 1) * PARTITION, length)
        d = tl.arange(0, BLOCK_D)
        dmask = d < head_size
        q = tl.load(q_ptr + (seq * num_heads + head) * head_size + d, mask=dmask, other=0.0).to(tl.float32)
        m = -float("inf")
        l = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        row = num_kv_heads * head_size
        block_start = (start // BLOCK_SIZE) * BLOCK_SIZE
        for pos0 in range(block_start, end, BLOCK_SIZE):
            block = tl.load(tables_ptr + seq * table_width + pos0 // BLOCK_SIZE)
            offs = tl.arange(0, BLOCK_SIZE)
            pos = pos0 + offs
            valid = (pos >= start) & (pos < end)
            base = (block * BLOCK_SIZE + offs) * row + kv_head * head_size
            kmask = valid[:, None] & dmask[None, :]
            k = tl.load(k_cache_ptr + base[:, None] + d[None, :], mask=kmask, other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale
            if USE_SOFTCAP:
                s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)  # softcap * tanh(s / softcap)
            s = tl.where(valid, s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            p = tl.where(valid, p, 0.0)
            v = tl.load(v_cache_ptr + base[:, None] + d[None, :], mask=kmask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l = l * alpha + tl.sum(p, axis=0)
            m = m_new
        out = (seq * num_heads + head) * num_partitions + part
        tl.store(m_ptr + out, m)
        tl.store(l_ptr + out, l)
        tl.store(acc_ptr + out * head_size + d, acc, mask=dmask)

    @triton.jit
    def merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, num_heads, head_size, num_partitions,
                     BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        p = tl.arange(0, BLOCK_P)
        pmask = p < num_partitions
        base = (seq * num_heads + head) * num_partitions
        m = tl.load(m_ptr + base + p, mask=pmask, other=-float("inf"))
        l = tl.load(l_ptr + base + p, mask=pmask, other=0.0)
        m_all = tl.max(m, axis=0)
        w = tl.where(pmask & (l > 0), tl.exp(m - m_all), 0.0)
        total = tl.sum(w * l, axis=0)
        d = tl.arange(0, BLOCK_D)
        dmask = d < head_size
        acc = tl.load(acc_ptr + (base + p)[:, None] * head_size + d[None, :],
                      mask=pmask[:, None] & dmask[None, :], other=0.0)
        o = tl.sum(w[:, None] * acc, axis=0) / total
        tl.store(out_ptr + (seq * num_heads + head) * head_size + d,
                 o.to(out_ptr.dtype.element_ty), mask=dmask)

    return partial_kernel, merge_kernel


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@register_op("paged_attention", name="triton_paged_decode", priority=20, devices=("cuda",),
             phases=("decode",), check=triton_missing)
def triton_paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                        softcap: float | None = None, partition_size: int = PARTITION_SIZE) -> torch.Tensor:
    """query [B, Hq, D] -> [B, Hq, D] for the first `num_decodes` sequences."""
    b = meta.num_decodes
    num_heads, head_size = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if partition_size % block_size:
        raise ValueError(f"partition_size {partition_size} must be a multiple of block_size {block_size}")
    max_len = max(meta.seq_lens_list[:b])
    num_partitions = -(-max_len // partition_size)
    q = query[:b].contiguous()
    tables = meta.block_tables[:b].contiguous()
    lens = meta.seq_lens[:b].contiguous()
    stats = torch.empty((b, num_heads, num_partitions), dtype=torch.float32, device=q.device)
    m, l = stats, torch.empty_like(stats)
    acc = torch.empty((b, num_heads, num_partitions, head_size), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    partial_kernel, merge_kernel = _kernels()
    block_d = _next_power_of_2(head_size)
    partial_kernel[(b, num_heads, num_partitions)](
        q, k_cache, v_cache, tables, lens, m, l, acc, scale, softcap or 1.0,
        sliding_window or NO_WINDOW,
        num_heads, num_kv_heads, head_size, tables.shape[1], num_partitions,
        BLOCK_SIZE=block_size, BLOCK_D=block_d, PARTITION=partition_size,
        USE_SOFTCAP=softcap is not None)
    merge_kernel[(b, num_heads)](m, l, acc, out, num_heads, head_size, num_partitions,
                                 BLOCK_D=block_d, BLOCK_P=_next_power_of_2(num_partitions))
    return out
