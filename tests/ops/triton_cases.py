"""The Triton kernels against the pure-torch ops, run by tests/ops/test_triton_kernels.py
in a subprocess with TRITON_INTERPRET=1 (Triton reads it at import), on CPU tensors, or
directly on a GPU when one is present (`python -m tests.ops.triton_cases cuda`)."""
from __future__ import annotations

import sys

import torch

from tessera.ops.attention.torch_paged import kv_write_ref, paged_decode_ref, paged_prefill_ref
from tessera.ops.triton.kv_write import triton_kv_write
from tessera.ops.triton.paged_decode import triton_paged_decode
from tessera.ops.triton.paged_prefill import triton_paged_prefill

from tests.ops.test_attention import make_case


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


def check_paged_decode(device: str) -> None:
    """GQA groups of 3, 1 (MHA) and 8 (MQA) on the rows of one tile; blocks smaller than,
    equal to and larger than a tile; partitions chosen automatically (contexts of 37 and
    70: one or two tiles each) and forced to 16 tokens (merged from 3 and 5 parts, and
    from 38 for a 600-token context: more than one merge chunk)."""
    for heads, kv_heads, head_size in ((9, 3, 64), (4, 4, 24), (8, 1, 16)):
        for block_size in (4, 16, 128):
            for window, softcap in ((None, None), (5, None), (None, 2.0), (7, 1.5)):
                for partition_size, lens in ((None, (37, 1, 70)), (16, (37, 1, 70)), (16, (600, 3))):
                    if partition_size and len(lens) == 2 and (block_size, window) != (16, None):
                        continue  # the long context once per shape is enough (interpreter time)
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
                                              partition_size=partition_size)
                    err = (got.cpu() - want).abs().max().item()
                    assert err < 1e-4, (heads, kv_heads, head_size, block_size, window, softcap,
                                        partition_size, lens, err)


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


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    check_kv_write(dev)
    check_paged_decode(dev)
    check_paged_prefill(dev)
    print("triton kernels OK")
