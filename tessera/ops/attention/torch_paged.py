"""Pure-torch paged attention: the CPU path, the test oracle and the fallback.

KV cache layout per layer: [num_blocks, block_size, num_kv_heads, head_size] for K and V,
in the model dtype or an 8-bit float (kv_quant.py): written rounded, read back widened.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.ops.attention.kv_quant import QUANTIZED_KV, quantize_kv
from tessera.ops.attention.metadata import AttentionMetadata
from tessera.ops.registry import register_op

ANY_KV = (None, *QUANTIZED_KV)


def _as_stored(x: torch.Tensor) -> torch.Tensor:
    """8-bit floats as bytes (CPU index_copy_ has no float8 kernel); others as they are."""
    return x.view(torch.uint8) if x.dtype in QUANTIZED_KV else x


@register_op("kv_write", name="torch_kv_write", priority=0, kv_dtypes=ANY_KV)
def kv_write_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, has_padding: bool = False) -> None:
    """key/value: [T, Hk, D]. With `has_padding`, rows whose slot is -1 are not written."""
    if has_padding:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for x, cache in ((key, k_cache), (value, v_cache)):
        rows = cache.view(-1, *cache.shape[2:])  # [slots, Hk, D]
        _as_stored(rows).index_copy_(0, slot_mapping, _as_stored(quantize_kv(x, cache.dtype)))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The first `length` cached tokens of one sequence as `dtype`: [length, Hk, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length].to(dtype)


def _softmax_attend(scores: torch.Tensor, mask: torch.Tensor | None, v: torch.Tensor,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax(scores) @ v, in float32 before the product; masked scores (mask False) drop
    out. scores [B, H, Lq, Lk] with query heads in dim 1 (or [B, Hk, G, Lk]: grouped), sinks
    [H] (or [Hk * G]): one more logit per head in each row's denominator, with no value."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    scores = scores.float()
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v
    sink = sinks.float().view(scores.shape[1], -1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float | None, causal: bool = True,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hk, Lk, D]; mask True = attend (None: causal, Lq == Lk, or
    with `causal` False every query sees every key).

    Without soft-capping or sinks this is SDPA; with them (gemma2's scores become
    softcap * tanh(scores / softcap) before masking, gpt-oss's sinks join each softmax) it
    is written out, since SDPA can express neither.
    """
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None and causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return _softmax_attend(scores, mask, v, sinks)


# a window's queries are taken this many at a time (at least), each tile over the keys its
# rows can see: at 4096 tokens and ModernBERT's 64 each side, 15x less time than one
# masked pass over the whole prompt
WINDOW_TILE = 128


def _attend_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: torch.Tensor | None,
                     scale: float, sliding_window: int | None, softcap: float | None,
                     sinks: torch.Tensor | None) -> torch.Tensor:
    """One sequence's prefill rows: q [Lq, Hq, D] (the last Lq of its Lk positions) over
    k / v [Lk, Hk, D], each query up to its own position or its key limit (`limits`, [Lq]),
    within the window. Returns [Lq, Hq, D]."""
    q_len, ctx_len = q.shape[0], k.shape[0]
    tile = max(sliding_window or 0, WINDOW_TILE)
    if sliding_window is not None and q_len > 2 * tile:  # keys outside a tile's windows are never read
        ends = (limits.tolist() if limits is not None else None)
        out = torch.empty_like(q)
        for a in range(0, q_len, tile):
            b = min(a + tile, q_len)
            first = ctx_len - q_len + a
            lo = max(first - sliding_window + 1, 0)
            hi = (max(ends[a:b]) if ends is not None else first + b - a - 1) + 1
            out[a:b] = _attend_rows(q[a:b], k[lo:hi], v[lo:hi], first, lo, None if limits is None else limits[a:b],
                                    scale, sliding_window, softcap, sinks)
        return out
    return _attend_rows(q, k, v, ctx_len - q_len, 0, limits, scale, sliding_window, softcap, sinks)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_first: int, k_first: int,
                 limits: torch.Tensor | None, scale: float, sliding_window: int | None,
                 softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [Lq, Hq, D] at positions q_first.. over k / v [Lk, Hk, D] at positions k_first..:
    the query at p sees keys up to p (or its limit), within the window. [Lq, Hq, D]."""
    q_len, k_len = q.shape[0], k.shape[0]
    # every row sees every key (an encoder's prompt, or a causal chunk over exactly its own
    # keys): no mask, which SDPA runs far faster than an all-true one
    full = (limits is not None and sliding_window is None and k_first == 0 and q_first == 0
            and k_len == q_len and bool((limits >= k_len - 1).all()))
    causal_alone = limits is None and sliding_window is None and k_first == q_first and k_len == q_len
    mask = None
    if not full and not causal_alone:
        q_pos = torch.arange(q_first, q_first + q_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(k_first, k_first + k_len, device=q.device).unsqueeze(0)
        mask = k_pos <= (q_pos if limits is None else limits.to(q_pos.device).unsqueeze(1))
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    o = _attend(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                mask, scale, softcap, causal=not full, sinks=sinks)
    return o.squeeze(0).transpose(0, 1)


@register_op("paged_attention", name="torch_paged_prefill", priority=0, phases=("prefill",),
             kv_dtypes=ANY_KV, key_limits=True, sinks=True)
def paged_prefill_ref(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, sliding_window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention for the prefill rows (after the decode rows), one sequence at a time.

    query: [T, Hq, D] for the prefill tokens only; key/value: the same tokens' new K/V.
    With `sliding_window` w, the query at absolute position p sees keys in (p - w, p]; with
    `meta.key_limits`, in (p - w, key_limits[row]] (a row may see past its own position).
    Returns [T, Hq, D].
    """
    out = torch.empty_like(query)
    start = 0
    for i in range(meta.num_decodes, meta.num_seqs):
        q_len, ctx_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        q = query[start:start + q_len]
        if ctx_len == q_len and k_cache.dtype == key.dtype:
            # nothing cached before this chunk: the fresh K/V are what the cache holds
            k, v = key[start:start + q_len], value[start:start + q_len]
        else:
            k = _gather_context(k_cache, meta.block_tables[i], ctx_len, query.dtype)
            v = _gather_context(v_cache, meta.block_tables[i], ctx_len, query.dtype)
        limits = None if meta.key_limits is None else meta.key_limits[start:start + q_len]
        o = _attend_sequence(q, k, v, limits, scale, sliding_window, softcap, sinks)
        out[start:start + q_len] = o
        start += q_len
    return out


@register_op("paged_attention", name="torch_paged_decode", priority=0, phases=("decode",),
             kv_dtypes=ANY_KV, sinks=True)
def paged_decode_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence for the first `num_decodes` sequences, batched.

    Query heads are grouped under their KV head, so GQA needs no K/V repetition:
    q [B, Hk, G, D] attends over k [B, Hk, L, D] with a length (and window) mask.
    The whole context is gathered even with a window; masking keeps the result exact.
    Returns [B, Hq, D].
    """
    b = meta.num_decodes
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    tables, mask = meta.decode_view(k_cache.shape[1], sliding_window)
    k = k_cache[tables].flatten(1, 2).transpose(1, 2).to(query.dtype)  # [B, Hk, L, D]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2).to(query.dtype)
    q = query.view(b, num_kv_heads, -1, head_size)
    if softcap is None and sinks is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:  # [B, Hk, G, D] against [B, Hk, L, D] is already grouped: no repetition needed
        scores = (q @ k.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        o = _softmax_attend(scores, mask, v, sinks)
    return o.reshape(b, -1, head_size)
