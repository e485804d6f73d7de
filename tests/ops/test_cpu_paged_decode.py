"""The bf16 paged decode kernel against the pure-torch decode on the same bf16 cache:
scattered block tables, GQA and MHA, every head-size path (64/128/256 in registers,
others in memory, sizes not a multiple of 16 or 32), sliding
windows and soft-capping; errors against a float32 computation of the same bf16 data are
at bf16 rounding level and no worse than torch's own."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.attention.torch_paged import kv_write_ref, paged_decode_ref
from tessera.ops.cpu import paged_decode as cpu_paged_decode
from tessera.ops.cpu.paged_decode import paged_decode_bf16
from tessera.ops.registry import OpSpec, select_op

from tests.ops.test_attention import make_case

UNAVAILABLE = "; ".join(cpu_paged_decode._KERNEL.check(None)) or None  # either build
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


# head sizes 64 / 128 / 256 take the register-tiled value pass (groups larger than one
# tile of heads: 9/1 at 64, 8/2 at 128); others the generic one; 48 is not a multiple of 32
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size",
                         [(9, 3, 64), (9, 1, 64), (8, 2, 128), (2, 1, 256), (4, 4, 24), (8, 1, 16), (6, 2, 48)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 2.0), (7, 1.5)])
@pytest.mark.parametrize("lengths", [(37, 1, 20), (37, 1, 20, 5, 64, 3, 17, 33, 2, 50)], ids=["3-seqs", "10-seqs"])
def test_matches_torch_decode(num_heads, num_kv_heads, head_size, block_size, window, softcap, lengths):
    # 10 sequences are enough for a work item per sequence (all its KV heads), 3 are not
    case = make_case([(n, 1) for n in lengths], block_size=block_size, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_size=head_size, seed=head_size + block_size)
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    k16, v16, q16 = case.k_cache.bfloat16(), case.v_cache.bfloat16(), case.query.bfloat16()
    got = paged_decode_bf16(q16, k16, v16, case.meta, case.scale, window, softcap)
    assert got.dtype == torch.bfloat16 and got.shape == q16.shape
    exact = paged_decode_ref(q16.float(), k16.float(), v16.float(), case.meta, case.scale, window, softcap)
    torch_bf16 = paged_decode_ref(q16, k16, v16, case.meta, case.scale, window, softcap)
    err = (got.float() - exact).abs().max().item()
    assert err <= 2e-2, err
    assert err <= 1.5 * (torch_bf16.float() - exact).abs().max().item() + 4e-3


# Long contexts: a batch smaller than the threads' share of work splits each context into
# partitions of keys that are merged afterwards (the AVX2 kernel; the AVX512 one does not
# split, and must agree all the same); a context past 4096 keys is split whatever the batch.
# Lengths mix split and unsplit sequences in one call; 20 is a head size that is not a
# multiple of 8 (scalar tails in both passes).
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(9, 3, 64), (8, 2, 128), (4, 2, 20), (2, 1, 512)])
@pytest.mark.parametrize("window, softcap", [(None, None), (300, None), (None, 2.0)])
@pytest.mark.parametrize("lengths", [(1000,), (700, 1, 300), (4200, 1, 5, 9, 17, 2, 33, 64, 100)],
                         ids=["one", "three", "nine"])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_contexts_split_and_merged(num_heads, num_kv_heads, head_size, window, softcap, lengths, threads):
    case = make_case([(n, 1) for n in lengths], block_size=16, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_size=head_size, seed=len(lengths) + head_size)
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    k16, v16, q16 = case.k_cache.bfloat16(), case.v_cache.bfloat16(), case.query.bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_decode_bf16(q16, k16, v16, case.meta, case.scale, window, softcap)
    finally:
        torch.set_num_threads(before)
    exact = paged_decode_ref(q16.float(), k16.float(), v16.float(), case.meta, case.scale, window, softcap)
    torch_bf16 = paged_decode_ref(q16, k16, v16, case.meta, case.scale, window, softcap)
    err = (got.float() - exact).abs().max().item()
    assert err <= 1.5 * (torch_bf16.float() - exact).abs().max().item() + 4e-3, err


@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(9, 3, 64), (4, 2, 20)])
@pytest.mark.parametrize("lengths", [(37, 1, 20), (700, 1, 300, 2, 5, 9, 17, 33, 64)], ids=["3-seqs", "9-seqs"])
def test_a_query_sliced_from_the_packed_projection_is_read_in_place(num_heads, num_kv_heads, head_size, lengths):
    """Attention without rotary (NoPE layers: Granite 4.0-H, Nemotron-H) passes q as a column
    slice of the packed QKV rows: the kernel reads it there, with what a contiguous copy gives."""
    case = make_case([(n, 1) for n in lengths], block_size=16, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_size=head_size, seed=len(lengths))
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    k16, v16, q16 = case.k_cache.bfloat16(), case.v_cache.bfloat16(), case.query.bfloat16()
    b, width = q16.shape[0], num_heads * head_size
    packed = torch.randn(b, width + 2 * num_kv_heads * head_size).bfloat16()
    packed[:, :width] = q16.reshape(b, width)
    sliced = packed[:, :width].view(b, num_heads, head_size)
    assert not sliced.is_contiguous()
    want = paged_decode_bf16(q16.contiguous(), k16, v16, case.meta, case.scale)
    assert torch.equal(paged_decode_bf16(sliced, k16, v16, case.meta, case.scale), want)


def test_registry_prefers_it_for_bf16_decode_only():
    spec = OpSpec("paged_attention", "cpu", torch.bfloat16, phase="decode", sliding_window=True, softcap=True)
    assert select_op(spec).builder.name == "cpu_paged_decode_bf16"
    prefill = OpSpec("paged_attention", "cpu", torch.bfloat16, phase="prefill")
    assert select_op(prefill).builder.name != "cpu_paged_decode_bf16"
    assert select_op(OpSpec("paged_attention", "cpu", torch.float32, phase="decode")).builder.name \
        == "torch_paged_decode"
