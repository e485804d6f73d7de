"""The Triton attention kernels (kv_write, paged decode and prefill: windows, soft-capping,
key limits, attention sinks, wide heads of large groups) against the pure-torch ops; run by
tests/ops/triton_cases.py, through the interpreter on CPU or on a GPU."""
from __future__ import annotations

import torch

from tessera.ops.attention.torch_paged import kv_write_ref, paged_decode_ref, paged_prefill_ref
from tessera.ops.triton import paged_decode, semaphores
from tessera.ops.triton.kv_write import triton_kv_write
from tessera.ops.triton.paged_decode import triton_paged_decode
from tessera.ops.triton.paged_prefill import triton_paged_prefill
from tessera.ops.triton.rotary_kv_write import triton_rotary_kv_write
from tessera.ops.rotary import rotary_ref

from tests.ops.test_attention import make_case

MERGES = (None, False)  # merge_plan's choice (fused for these shapes), and merge_kernel


def counters_are_zero(device: str) -> bool:
    """Every counter a fused merge or split-K sum took is back to zero after its launch."""
    return not semaphores.counters(torch.device(device), 0).any().item()


def check_kv_write(device: str) -> None:
    case = make_case([(9, 1), (20, 3), (5, 5)], block_size=4, num_heads=4, num_kv_heads=2,
                     head_size=24, seed=1)
    slots = case.meta.slot_mapping.clone()
    slots[1] = -1  # a padded row writes nothing
    want_k, want_v = case.k_cache.clone(), case.v_cache.clone()
    kv_write_ref(case.key, case.value, want_k, want_v, slots, has_padding=True)
    got_k, got_v = case.k_cache.clone().to(device), case.v_cache.clone().to(device)
    triton_kv_write(case.key.to(device), case.value.to(device), got_k, got_v, slots.to(device), True)
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v), "kv_write differs"


def check_rotary_kv_write(device: str) -> None:
    """Rotary and the cache write in one kernel equal rotary, then kv_write, bit for bit:
    float32, bf16 and fp16 models and a bf16 model over an fp8 cache, q / k / v as strided
    views of one QKV row, a padded row (slot -1) writing nothing."""
    g = torch.Generator().manual_seed(13)
    for dtype, kv_dtype in ((torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                            (torch.bfloat16, torch.float8_e4m3fn)):
        for heads, kv_heads, head_size in ((4, 2, 64), (3, 1, 24)):
            qkv = (torch.randn(6, (heads + 2 * kv_heads) * head_size, generator=g) * 3).to(dtype)
            q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=1)
            angles = torch.rand(6, head_size // 2, generator=g) * 6
            rows = torch.cat((angles.cos(), angles.cos(), angles.sin(), angles.sin()), dim=-1).to(dtype)
            cos, sin = rows[:, None, :head_size], rows[:, None, head_size:]
            slots = torch.tensor([5, 0, -1, 9, 14, 3])
            caches = [torch.randn(4, 4, kv_heads, head_size, generator=g).to(kv_dtype or dtype) for _ in range(2)]
            want_q, want_k = rotary_ref(q, k, cos, sin, head_size)
            want_caches = [c.clone() for c in caches]
            kv_write_ref(want_k.view(6, kv_heads, head_size), v.view(6, kv_heads, head_size), *want_caches, slots,
                         has_padding=True)
            got_caches = [c.to(device) for c in caches]
            got_q, got_k = triton_rotary_kv_write(q.to(device), k.to(device), v.to(device), cos.to(device),
                                                  sin.to(device), head_size, *got_caches, slots.to(device), True)
            case = (dtype, kv_dtype, head_size)
            assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_k.cpu(), want_k), case
            for got, want in zip(got_caches, want_caches):  # as bytes: fp8 has no CPU equality
                assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), case


def check_paged_decode(device: str) -> None:
    """GQA groups of 3, 1 (MHA) and 8 (MQA) on the rows of one tile; blocks smaller than,
    equal to and larger than a tile; partitions chosen automatically (contexts of 37 and
    70: one or two tiles each) and forced to 16 tokens (merged from 3 and 5 parts, and
    from 38 for a 600-token context: more than one merge chunk), merged in the partition
    kernel by its last program and by merge_kernel."""
    for heads, kv_heads, head_size in ((9, 3, 64), (4, 4, 24), (8, 1, 16)):
        for block_size in (4, 16, 128):
            for window, softcap in ((None, None), (5, None), (None, 2.0), (7, 1.5)):
                for partition_size, lens, fused in ((None, (37, 1, 70), None), (16, (37, 1, 70), None),
                                                    (16, (37, 1, 70), False), (16, (600, 3), None),
                                                    (16, (600, 3), False)):
                    if partition_size and len(lens) == 2 and (block_size, window) != (16, None):
                        continue  # the long context once per shape is enough (interpreter time)
                    if fused is False and (block_size, softcap) != (16, None):
                        continue  # merge_kernel once per shape and window
                    case = make_case([(n, 1) for n in lens], block_size=block_size, num_heads=heads,
                                     num_kv_heads=kv_heads, head_size=head_size, seed=head_size + block_size)
                    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
                    want = paged_decode_ref(case.query, case.k_cache, case.v_cache, case.meta, case.scale,
                                            window, softcap)
                    meta = case.meta
                    for name in ("block_tables", "seq_lens", "slot_mapping", "query_start_loc"):
                        setattr(meta, name, getattr(meta, name).to(device))
                    got = triton_paged_decode(case.query.to(device), case.k_cache.to(device),
                                              case.v_cache.to(device), meta, case.scale, window, softcap,
                                              partition_size=partition_size, fused_merge=fused)
                    err = (got.cpu() - want).abs().max().item()
                    assert err < 1e-4, (heads, kv_heads, head_size, block_size, window, softcap,
                                        partition_size, lens, fused, err)
                    assert counters_are_zero(device)


def check_paged_decode_skips_dead_partitions(device: str) -> None:
    """As a captured graph runs it: the host claims 600-token sequences (38 partitions of
    16) while the real ones are shorter, some windowed. Partitions before the window or past
    the end must be neither written nor read: the workspace starts as NaN, the output still
    matches, and exactly the live partitions were written (by merge_kernel's partition
    kernel; the fused one writes none where one is live)."""
    original = paged_decode.partition_workspace
    made: list[torch.Tensor] = []

    def poisoned(*args, **kwargs):
        bufs = original(*args, **kwargs)
        for buf in bufs:
            buf.fill_(float("nan"))
        made.append(bufs[0])
        return bufs

    paged_decode.partition_workspace = poisoned
    try:
        for window, fused in ((None, None), (20, None), (None, False), (20, False)):
            lens = (37, 1, 70, 16)
            case = make_case([(n, 1) for n in lens], block_size=16, num_heads=9, num_kv_heads=3,
                             head_size=64, seed=5)
            kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
            want = paged_decode_ref(case.query, case.k_cache, case.v_cache, case.meta, case.scale, window)
            meta = case.meta
            meta.seq_lens_list = [600] * len(lens)
            for name in ("block_tables", "seq_lens", "slot_mapping", "query_start_loc"):
                setattr(meta, name, getattr(meta, name).to(device))
            got = triton_paged_decode(case.query.to(device), case.k_cache.to(device), case.v_cache.to(device),
                                      meta, case.scale, window, partition_size=16, fused_merge=fused)
            err = (got.cpu() - want).abs().max().item()
            assert err < 1e-4, (window, fused, err)
            assert counters_are_zero(device)
            m = made.pop().cpu()  # [seqs, heads, 38 partitions]
            assert m.shape[-1] == 38
            for i, n in enumerate(lens):
                lo = max(n - window, 0) // 16 if window else 0
                hi = -(-n // 16)
                live = [lo <= p < hi and (fused is False or hi - lo > 1) for p in range(38)]
                written = ~m[i].isnan().all(dim=0)
                assert written.tolist() == live, (window, fused, n, written)
    finally:
        paged_decode.partition_workspace = original


def check_paged_prefill(device: str) -> None:
    """Two decodes, then a 24-token chunk over 16 cached tokens, a fresh 17-token prompt and
    a 40-token chunk over 30 cached ones: causal by absolute position through the cache.
    Blocks smaller and larger than a key tile; a 256-wide head takes the halved tiles."""
    for heads, kv_heads, head_size in ((9, 3, 64), (4, 4, 24), (2, 1, 256)):
        for block_size in (4, 16, 128):
            for window, softcap in ((None, None), (6, None), (None, 2.0)):
                case = make_case([(20, 1), (9, 1), (40, 24), (17, 17), (70, 40)], block_size=block_size,
                                 num_heads=heads, num_kv_heads=kv_heads, head_size=head_size,
                                 seed=block_size + head_size)
                kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
                nd = case.meta.num_decodes
                want = paged_prefill_ref(case.query[nd:], case.key[nd:], case.value[nd:], case.k_cache,
                                         case.v_cache, case.meta, case.scale, window, softcap)
                meta = case.meta
                for name in ("block_tables", "seq_lens", "slot_mapping", "query_start_loc"):
                    setattr(meta, name, getattr(meta, name).to(device))
                got = triton_paged_prefill(case.query[nd:].to(device), case.key[nd:].to(device),
                                           case.value[nd:].to(device), case.k_cache.to(device),
                                           case.v_cache.to(device), meta, case.scale, window, softcap)
                err = (got.cpu() - want).abs().max().item()
                assert err < 1e-4, (heads, kv_heads, head_size, block_size, window, softcap, err)


def check_paged_prefill_key_limits(device: str) -> None:
    """Rows with key limits (spans of tokens that see each other, as an image's do in Gemma
    3): the torch op's answer, with and without a window, over cached context."""
    from tests.ops.test_attention import LIMIT_SPANS, LIMIT_SPECS, span_limits

    for head_size, block_size in ((16, 4), (64, 16)):
        for window in (None, 5):
            case = make_case(LIMIT_SPECS, block_size=block_size, num_heads=4, num_kv_heads=2,
                             head_size=head_size, seed=head_size)
            kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
            nd = case.meta.num_decodes
            case.meta.key_limits = torch.tensor(span_limits(case, LIMIT_SPANS)[nd:])
            want = paged_prefill_ref(case.query[nd:], case.key[nd:], case.value[nd:], case.k_cache,
                                     case.v_cache, case.meta, case.scale, window)
            meta = case.meta
            for name in ("block_tables", "seq_lens", "slot_mapping", "query_start_loc", "key_limits"):
                setattr(meta, name, getattr(meta, name).to(device))
            got = triton_paged_prefill(case.query[nd:].to(device), case.key[nd:].to(device),
                                       case.value[nd:].to(device), case.k_cache.to(device),
                                       case.v_cache.to(device), meta, case.scale, window)
            err = (got.cpu() - want).abs().max().item()
            assert err < 1e-4, (head_size, block_size, window, err)


def check_attention_sinks(device: str) -> None:
    """Attention sinks (gpt-oss) in both kernels, one far above every score among them:
    decode merged from several partitions and from one, prefill over cached context, with
    and without a window."""
    from tests.ops.test_attention_sinks import make_sinks

    for window in (None, 5):
        for partition_size, fused in ((16, None), (16, False), (None, None)):
            case = make_case([(n, 1) for n in (37, 1, 70)] + [(40, 24), (17, 17)], block_size=4, num_heads=6,
                             num_kv_heads=2, head_size=24, seed=11)
            kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
            sinks = make_sinks(6, seed=3)
            nd = case.meta.num_decodes
            want_decode = paged_decode_ref(case.query[:nd], case.k_cache, case.v_cache, case.meta, case.scale,
                                           window, None, sinks)
            want_prefill = paged_prefill_ref(case.query[nd:], case.key[nd:], case.value[nd:], case.k_cache,
                                             case.v_cache, case.meta, case.scale, window, None, sinks)
            meta = case.meta
            for name in ("block_tables", "seq_lens", "slot_mapping", "query_start_loc"):
                setattr(meta, name, getattr(meta, name).to(device))
            k_cache, v_cache = case.k_cache.to(device), case.v_cache.to(device)
            got = triton_paged_decode(case.query[:nd].to(device), k_cache, v_cache, meta, case.scale, window,
                                      None, sinks.to(device), partition_size=partition_size, fused_merge=fused)
            err = (got.cpu() - want_decode).abs().max().item()
            assert err < 1e-4, ("decode sinks", window, partition_size, fused, err)
            assert counters_are_zero(device)
            got = triton_paged_prefill(case.query[nd:].to(device), case.key[nd:].to(device),
                                       case.value[nd:].to(device), k_cache, v_cache, meta, case.scale, window,
                                       None, sinks.to(device))
            err = (got.cpu() - want_prefill).abs().max().item()
            assert err < 1e-4, ("prefill sinks", window, err)


def check_wide_heads_of_large_groups(device: str) -> None:
    """MLA's shape: many query heads over one KV head wider than 256, so a group takes
    several programs (query_heads_per_program) and prefill the narrowest tiles; decode
    merged from partitions and not, prefill over cached context."""
    for partition_size, fused in ((16, None), (16, False), (None, None)):
        case = make_case([(37, 1), (1, 1), (20, 1), (40, 24)], block_size=16, num_heads=36, num_kv_heads=1,
                         head_size=320, seed=5)
        kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
        nd = case.meta.num_decodes
        want_decode = paged_decode_ref(case.query[:nd], case.k_cache, case.v_cache, case.meta, case.scale)
        want_prefill = paged_prefill_ref(case.query[nd:], case.key[nd:], case.value[nd:], case.k_cache,
                                         case.v_cache, case.meta, case.scale)
        meta = case.meta
        for name in ("block_tables", "seq_lens", "slot_mapping", "query_start_loc"):
            setattr(meta, name, getattr(meta, name).to(device))
        k_cache, v_cache = case.k_cache.to(device), case.v_cache.to(device)
        got = triton_paged_decode(case.query[:nd].to(device), k_cache, v_cache, meta, case.scale,
                                  partition_size=partition_size, fused_merge=fused)
        err = (got.cpu() - want_decode).abs().max().item()
        assert err < 1e-4, ("wide decode", partition_size, fused, err)
        assert counters_are_zero(device)
        got = triton_paged_prefill(case.query[nd:].to(device), case.key[nd:].to(device), case.value[nd:].to(device),
                                   k_cache, v_cache, meta, case.scale)
        err = (got.cpu() - want_prefill).abs().max().item()
        assert err < 1e-4, ("wide prefill", err)


def check_512_wide_heads(device: str) -> None:
    """Gemma 4's full-attention layers: 512-wide heads, two query heads per KV head, scale 1
    (normed queries and keys), decode and prefill over cached context."""
    case = make_case([(33, 1), (9, 1), (40, 24)], block_size=16, num_heads=4, num_kv_heads=2, head_size=512, seed=9)
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    nd = case.meta.num_decodes
    want_decode = paged_decode_ref(case.query[:nd], case.k_cache, case.v_cache, case.meta, 1.0)
    want_prefill = paged_prefill_ref(case.query[nd:], case.key[nd:], case.value[nd:], case.k_cache,
                                     case.v_cache, case.meta, 1.0)
    meta = case.meta
    for name in ("block_tables", "seq_lens", "slot_mapping", "query_start_loc"):
        setattr(meta, name, getattr(meta, name).to(device))
    k_cache, v_cache = case.k_cache.to(device), case.v_cache.to(device)
    got = triton_paged_decode(case.query[:nd].to(device), k_cache, v_cache, meta, 1.0)
    assert (got.cpu() - want_decode).abs().max().item() < 1e-4
    got = triton_paged_prefill(case.query[nd:].to(device), case.key[nd:].to(device), case.value[nd:].to(device),
                               k_cache, v_cache, meta, 1.0)
    assert (got.cpu() - want_prefill).abs().max().item() < 1e-4


ATTENTION_CHECKS = (check_kv_write, check_rotary_kv_write, check_paged_decode, check_paged_decode_skips_dead_partitions,
                    check_paged_prefill,
                    check_paged_prefill_key_limits, check_attention_sinks, check_wide_heads_of_large_groups,
                    check_512_wide_heads)
