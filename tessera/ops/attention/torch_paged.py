"""Pure-torch paged attention: the CPU path, the test oracle and the fallback.

KV cache layout per layer: [num_blocks, block_size, num_kv_heads, head_size] for K and V.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.ops.attention.metadata import AttentionMetadata
from tessera.ops.registry import register_op


@register_op("kv_write", name="torch_kv_write", priority=0)
def kv_write_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, has_padding: bool = False) -> None:
    """key/value: [T, Hk, D]. With `has_padding`, rows whose slot is -1 are not written."""
    if has_padding:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, Hk, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


@register_op("paged_attention", name="torch_paged_prefill", priority=0, phases=("prefill",))
def paged_prefill_ref(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """Causal attention for the prefill rows (after the decode rows), one sequence at a time.

    query: [T, Hq, D] for the prefill tokens only; key/value: the same tokens' new K/V.
    Returns [T, Hq, D].
    """
    out = torch.empty_like(query)
    start = 0
    for i in range(meta.num_decodes, meta.num_seqs):
        q_len, ctx_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        q = query[start:start + q_len]
        if ctx_len == q_len:  # nothing cached before this chunk: use the fresh K/V directly
            k, v = key[start:start + q_len], value[start:start + q_len]
        else:
            k = _gather_context(k_cache, meta.block_tables[i], ctx_len)
            v = _gather_context(v_cache, meta.block_tables[i], ctx_len)
        # Query j sits at absolute position ctx_len - q_len + j and sees keys up to it.
        mask = None
        if ctx_len != q_len:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= q_pos
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=True)
        out[start:start + q_len] = o.squeeze(0).transpose(0, 1)
        start += q_len
    return out


@register_op("paged_attention", name="torch_paged_decode", priority=0, phases=("decode",))
def paged_decode_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query token per sequence for the first `num_decodes` sequences, batched.

    Query heads are grouped under their KV head, so GQA needs no K/V repetition:
    q [B, Hk, G, D] attends over k [B, Hk, L, D] with a length mask. Returns [B, Hq, D].
    """
    b = meta.num_decodes
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    tables, mask = meta.decode_view(k_cache.shape[1])
    k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, Hk, L, D]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2)
    q = query.view(b, num_kv_heads, -1, head_size)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, -1, head_size)
