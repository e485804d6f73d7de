"""Paged attention (the pure-torch reference ops and the Attention layer) against naive dense
causal attention, on random data with scattered block tables and GQA."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tessera.ops.attention import Attention, AttentionMetadata, attention_context
from tessera.ops.attention import torch_paged
from tessera.ops.attention.torch_paged import kv_write_ref, paged_decode_ref, paged_prefill_ref
from tessera.ops.registry import OpTarget


@dataclass
class Case:
    meta: AttentionMetadata
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query: torch.Tensor        # [T, Hq, D] this step's queries, decodes first
    key: torch.Tensor          # [T, Hk, D] this step's new keys
    value: torch.Tensor
    dense_k: list[torch.Tensor]  # per sequence, every key [ctx_len, Hk, D]
    dense_v: list[torch.Tensor]
    specs: list[tuple[int, int]]
    scale: float


def make_case(specs: list[tuple[int, int]], *, block_size: int, num_heads: int, num_kv_heads: int,
              head_size: int, seed: int, spare_blocks: int = 5) -> Case:
    """specs: (context length including this step, query length) per sequence, decodes first.

    Cache slots of earlier tokens are filled; slots of this step's tokens are left for the
    caller to write (the layer and kv_write do that). Every other slot holds large values, so
    attending to anything outside a sequence's context shows up in the result.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in specs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), 50.0)
    v_cache = torch.full_like(k_cache, -80.0)
    order = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-contiguous
    tables, slots, queries, keys, values, dense_k, dense_v = [], [], [], [], [], [], []
    for (ctx, q_len), nb in zip(specs, blocks_per_seq):
        table = [order.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(ctx, num_kv_heads, head_size, generator=g)
        v = torch.randn(ctx, num_kv_heads, head_size, generator=g)
        dense_k.append(k)
        dense_v.append(v)
        for pos in range(ctx):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < ctx - q_len:
                k_cache.view(-1, num_kv_heads, head_size)[slot] = k[pos]
                v_cache.view(-1, num_kv_heads, head_size)[slot] = v[pos]
            else:
                slots.append(slot)
        queries.append(torch.randn(q_len, num_heads, head_size, generator=g))
        keys.append(k[ctx - q_len:])
        values.append(v[ctx - q_len:])
    max_blocks = max(blocks_per_seq)
    # Padding points at a real block that belongs to some other sequence.
    block_tables = torch.full((len(specs), max_blocks), tables[0][0], dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    q_lens = [q for _, q in specs]
    num_decodes = 0
    while num_decodes < len(specs) and q_lens[num_decodes] == 1:
        num_decodes += 1
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long), block_tables=block_tables,
        seq_lens=torch.tensor([c for c, _ in specs], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), num_decodes=num_decodes,
        num_decode_tokens=num_decodes, seq_lens_list=[c for c, _ in specs], query_lens_list=q_lens)
    return Case(meta, k_cache, v_cache, torch.cat(queries), torch.cat(keys), torch.cat(values),
                dense_k, dense_v, specs, head_size ** -0.5)


def naive_attention(case: Case) -> torch.Tensor:
    """Dense causal attention in float64, one query and one head at a time."""
    out = []
    num_heads = case.query.shape[1]
    num_kv_heads = case.dense_k[0].shape[1]
    group = num_heads // num_kv_heads
    row = 0
    for (ctx, q_len), k, v in zip(case.specs, case.dense_k, case.dense_v):
        for j in range(q_len):
            pos = ctx - q_len + j
            q = case.query[row].double()
            heads = []
            for h in range(num_heads):
                kh, vh = k[:pos + 1, h // group].double(), v[:pos + 1, h // group].double()
                weights = torch.softmax(kh @ q[h] * case.scale, dim=0)
                heads.append(weights @ vh)
            out.append(torch.stack(heads))
            row += 1
    return torch.stack(out).float()


GEOMETRIES = [  # (num_heads, num_kv_heads, head_size, block_size)
    (4, 2, 16, 4),
    (4, 4, 8, 16),
    (8, 1, 16, 8),
    (6, 3, 8, 1),
]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size", GEOMETRIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_decode_matches_dense_attention(num_heads, num_kv_heads, head_size, block_size, seed):
    lengths = [1, block_size, 2 * block_size + 1, 37, 5]
    case = make_case([(n, 1) for n in lengths], block_size=block_size, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_size=head_size, seed=seed)
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = paged_decode_ref(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.shape == case.query.shape
    torch.testing.assert_close(out, naive_attention(case), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size", GEOMETRIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_prefill_matches_dense_causal_attention(num_heads, num_kv_heads, head_size, block_size, seed):
    specs = [
        (9, 9),     # a fresh prompt: nothing cached before it
        (23, 7),    # a chunk that follows 16 cached tokens
        (block_size * 3, block_size),  # a chunk starting exactly at a block boundary
        (12, 2),    # a short chunk after cached context
        (6, 6),
    ]
    case = make_case(specs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, seed=seed)
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = paged_prefill_ref(case.query, case.key, case.value, case.k_cache, case.v_cache,
                            case.meta, case.scale)
    torch.testing.assert_close(out, naive_attention(case), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size", GEOMETRIES)
def test_attention_layer_mixed_decode_and_prefill_batch(num_heads, num_kv_heads, head_size, block_size):
    specs = [(17, 1), (1, 1), (block_size + 3, 1), (10, 10), (30, 5), (4, 1)]
    # (4, 1) after prefills is a one-token chunk following cached context: a prefill row.
    case = make_case(specs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, seed=7)
    assert case.meta.num_decodes == 3
    layer = Attention(num_heads, head_size, num_kv_heads, case.scale, OpTarget("cpu", torch.float32))
    layer.kv_cache = (case.k_cache, case.v_cache)
    with attention_context(case.meta):
        out = layer(case.query.flatten(1), case.key.flatten(1), case.value.flatten(1))
    assert out.shape == (case.query.shape[0], num_heads * head_size)
    expected = naive_attention(case).flatten(1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    # The layer wrote this step's K/V into the cache slots it was given.
    flat_k = case.k_cache.view(-1, num_kv_heads, head_size)
    torch.testing.assert_close(flat_k[case.meta.slot_mapping], case.key)


def test_attention_layer_needs_a_bound_cache_and_a_context():
    layer = Attention(4, 8, 2, 8 ** -0.5, OpTarget("cpu", torch.float32))
    q, kv = torch.randn(1, 32), torch.randn(1, 16)
    with pytest.raises(RuntimeError, match="not bound"):
        layer(q, kv, kv)
    layer.kv_cache = (torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8))
    with pytest.raises(RuntimeError, match="attention_context"):
        layer(q, kv, kv)
    with pytest.raises(ValueError, match="multiple"):
        Attention(6, 8, 4, 1.0, OpTarget("cpu", torch.float32))


def test_kv_write_skips_padding_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    key = torch.arange(1, 7, dtype=torch.float32).view(3, 1, 2)
    value = -key
    kv_write_ref(key, value, k_cache, v_cache, torch.tensor([5, -1, 2]), has_padding=True)
    flat_k, flat_v = k_cache.view(-1, 1, 2), v_cache.view(-1, 1, 2)
    torch.testing.assert_close(flat_k[5], key[0])
    torch.testing.assert_close(flat_k[2], key[2])
    torch.testing.assert_close(flat_v[2], value[2])
    written = {2, 5}
    for slot in range(8):
        if slot not in written:
            assert not flat_k[slot].any() and not flat_v[slot].any()


def test_naive_reference_is_not_trivially_equal():
    """Sanity check of the oracle: dropping causality or the scale changes the answer."""
    case = make_case([(8, 8)], block_size=4, num_heads=2, num_kv_heads=1, head_size=8, seed=3)
    expected = naive_attention(case)
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    wrong_scale = paged_prefill_ref(case.query, case.key, case.value, case.k_cache, case.v_cache,
                                    case.meta, case.scale * 2)
    assert not torch.allclose(wrong_scale, expected, atol=1e-3)
    q = case.query.transpose(0, 1)
    k = case.key.transpose(0, 1).expand(2, -1, -1)
    v = case.value.transpose(0, 1).expand(2, -1, -1)
    non_causal = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(8), -1) @ v
    assert not torch.allclose(non_causal.transpose(0, 1), expected, atol=1e-3)


# --- sliding window and soft-capping ----------------------------------------------------------

def naive_windowed(case: Case, window: int | None, softcap: float | None,
                   limits: list[int] | None = None) -> torch.Tensor:
    """Dense attention in float64 where the query at position p sees keys in (p - window, p]
    (transformers' sliding-window causal mask) and scores are soft-capped, if asked; with
    `limits` (one per row), keys in (p - window, limits[row]]."""
    out = []
    group = case.query.shape[1] // case.dense_k[0].shape[1]
    row = 0
    for (ctx, q_len), k, v in zip(case.specs, case.dense_k, case.dense_v):
        for j in range(q_len):
            pos = ctx - q_len + j
            lo = 0 if window is None else max(0, pos - window + 1)
            hi = pos if limits is None else limits[row]
            q = case.query[row].double()
            heads = []
            for h in range(q.shape[0]):
                kh, vh = k[lo:hi + 1, h // group].double(), v[lo:hi + 1, h // group].double()
                scores = kh @ q[h] * case.scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                heads.append(torch.softmax(scores, dim=0) @ vh)
            out.append(torch.stack(heads))
            row += 1
    return torch.stack(out).float()


FEATURES = [(3, None), (8, None), (1, None), (None, 2.0), (5, 3.0)]  # (window, softcap)


@pytest.mark.parametrize("window, softcap", FEATURES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size", GEOMETRIES[:3])
def test_windowed_softcapped_decode_and_prefill_match_dense(window, softcap, num_heads, num_kv_heads,
                                                            head_size, block_size):
    specs = [(1, 1), (block_size + 3, 1), (37, 1), (9, 9), (23, 7), (block_size * 3, block_size), (12, 2)]
    case = make_case(specs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, seed=11)
    layer = Attention(num_heads, head_size, num_kv_heads, case.scale, OpTarget("cpu", torch.float32),
                      sliding_window=window, softcap=softcap)
    layer.kv_cache = (case.k_cache, case.v_cache)
    with attention_context(case.meta):
        out = layer(case.query.flatten(1), case.key.flatten(1), case.value.flatten(1))
    expected = naive_windowed(case, window, softcap)
    torch.testing.assert_close(out.view_as(case.query), expected, atol=1e-5, rtol=1e-4)


def span_limits(case: Case, spans: dict[int, list[tuple[int, int]]]) -> list[int]:
    """Each row's key limit: its own position, or for a row in one of its sequence's spans
    [a, b) of absolute positions, b - 1 (the span's tokens see each other)."""
    limits = []
    for i, (ctx, q_len) in enumerate(case.specs):
        for pos in range(ctx - q_len, ctx):
            ends = [b - 1 for a, b in spans.get(i, []) if a <= pos < b]
            limits.append(ends[0] if ends else pos)
    return limits


# sequences (decodes first): spans inside each prefill chunk, one at its start after cached
# context, one ending at its end, one of a single token, two in one chunk
LIMIT_SPECS = [(9, 1), (30, 1), (12, 12), (40, 24), (25, 9), (16, 16)]
LIMIT_SPANS = {2: [(3, 9)], 3: [(16, 22), (30, 31), (33, 40)], 4: [(16, 25)], 5: [(0, 16)]}


@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (None, 2.0), (7, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_limits_let_a_span_see_itself(window, softcap, dtype):
    """Rows with key limits (an image's tokens attending to each other) see their span's
    later keys and nothing past it, through the layer: the torch op takes such steps even
    where a faster prefill kernel (the CPU's bf16 one) serves the others."""
    case = make_case(LIMIT_SPECS, block_size=4, num_heads=4, num_kv_heads=2, head_size=16, seed=21)
    limits = span_limits(case, LIMIT_SPANS)
    nd = case.meta.num_decodes
    assert limits[:nd] == [ctx - 1 for ctx, _ in LIMIT_SPECS[:nd]]  # decodes: causal
    case.meta.key_limits = torch.tensor(limits[nd:])
    layer = Attention(4, 16, 2, case.scale, OpTarget("cpu", dtype), sliding_window=window, softcap=softcap)
    layer.kv_cache = (case.k_cache.to(dtype), case.v_cache.to(dtype))
    with attention_context(case.meta):
        out = layer(*(x.to(dtype).flatten(1) for x in (case.query, case.key, case.value)))
    expected = naive_windowed(case, window, softcap, limits)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.view_as(case.query).float(), expected, **tol)
    assert layer._limited is paged_prefill_ref
    # the spans matter: causal attention gives another answer
    assert not torch.allclose(naive_windowed(case, window, softcap), expected, atol=1e-3)


@pytest.mark.parametrize("window, lookahead", [(3, None), (8, None), (4, 3), (9, 8)])
@pytest.mark.parametrize("tile", [4, torch_paged.WINDOW_TILE])
def test_long_windowed_chunks_in_tiles_match_dense(monkeypatch, window, lookahead, tile):
    """A windowed chunk longer than two tiles runs a tile of queries at a time over only the
    keys they see (made 4 rows here so that small cases take that path): the same answer.
    With a lookahead and an encoder's key limits (every row up to its chunk's end), the
    window spans both sides (ModernBERT's local layers)."""
    monkeypatch.setattr(torch_paged, "WINDOW_TILE", tile)
    specs = [(9, 1), (40, 40), (50, 33), (61, 25), (7, 7)]
    case = make_case(specs, block_size=4, num_heads=4, num_kv_heads=2, head_size=16, seed=31)
    limits = None
    if lookahead is not None:
        limits = [min(pos + lookahead, ctx - 1) for ctx, q_len in specs[1:] for pos in range(ctx - q_len, ctx)]
        case.meta.key_limits = torch.tensor([ctx - 1 for ctx, q_len in specs[1:] for _ in range(q_len)])
        limits = [specs[0][0] - 1, *limits]  # the decode row: causal
    layer = Attention(4, 16, 2, case.scale, OpTarget("cpu", torch.float32), sliding_window=window,
                      lookahead=lookahead)
    layer.kv_cache = (case.k_cache, case.v_cache)
    with attention_context(case.meta):
        out = layer(case.query.flatten(1), case.key.flatten(1), case.value.flatten(1))
    expected = naive_windowed(case, window, None, limits)
    torch.testing.assert_close(out.view_as(case.query), expected, atol=1e-5, rtol=1e-4)
    if lookahead is not None:  # the keys past a row matter
        assert not torch.allclose(naive_windowed(case, window, None), expected, atol=1e-3)


def test_window_and_softcap_change_the_answer():
    """The oracle and the builders really apply both: results differ from plain attention."""
    case = make_case([(20, 20)], block_size=4, num_heads=2, num_kv_heads=1, head_size=8, seed=5)
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    plain = naive_attention(case)
    torch.testing.assert_close(naive_windowed(case, None, None), plain, atol=1e-6, rtol=1e-6)
    windowed = paged_prefill_ref(case.query, case.key, case.value, case.k_cache, case.v_cache,
                                 case.meta, case.scale, sliding_window=4)
    capped = paged_prefill_ref(case.query, case.key, case.value, case.k_cache, case.v_cache,
                               case.meta, case.scale, softcap=0.5)
    assert not torch.allclose(windowed, plain, atol=1e-3)
    assert not torch.allclose(capped, plain, atol=1e-3)
    # a window at least as long as the context is full attention
    wide = paged_prefill_ref(case.query, case.key, case.value, case.k_cache, case.v_cache,
                             case.meta, case.scale, sliding_window=20)
    torch.testing.assert_close(wide, plain, atol=1e-5, rtol=1e-4)


def test_attention_spec_states_window_and_softcap():
    """A builder can refuse the features through its `check`; the layer asks for them."""
    from tessera.ops.registry import OpBuilder, OpSpec, select_op

    target = OpTarget("cpu", torch.float32)
    spec = target.spec("paged_attention", phase="decode", head_size=8, sliding_window=True, softcap=True)
    assert select_op(spec).builder.name == "torch_paged_decode"
    no_window = OpBuilder(name="fast", kind="paged_attention", priority=9, impl=lambda: None,
                          check=lambda s: ["sliding window not supported"] if s.sliding_window else [])
    assert no_window.rejections(spec) == ["sliding window not supported"]
    assert no_window.rejections(OpSpec("paged_attention", "cpu", torch.float32, phase="decode")) == []
    with pytest.raises(ValueError, match="sliding_window"):
        Attention(4, 8, 2, 1.0, target, sliding_window=0)
