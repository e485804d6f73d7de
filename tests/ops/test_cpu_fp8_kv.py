"""The CPU kernels over an 8-bit float KV cache (--kv-cache-dtype fp8), both formats:

- kv_write_fp8.c rounds bf16 / float32 rows into the cache bit for bit as
  kv_quant.quantize_kv (torch's conversion after saturation) does, ties, subnormals,
  infinities and huge values included;
- the AVX2 decode and prefill kernels built for fp8 read the same bytes as the pure-torch
  attention widened to float32 does, within float32 summation order and the bf16 output
  rounding (scattered blocks, GQA, head sizes off the SIMD width, windows, soft-capping,
  contexts long enough to be split across threads).
"""
from __future__ import annotations

import pytest
import torch

from tessera.ops.attention.kv_quant import QUANTIZED_KV, quantize_kv
from tessera.ops.attention.torch_paged import kv_write_ref, paged_decode_ref, paged_prefill_ref
from tessera.ops.cpu import kv_write as cpu_kv_write
from tessera.ops.cpu import paged_decode as cpu_paged_decode
from tessera.ops.cpu import paged_prefill as cpu_paged_prefill
from tessera.ops.registry import OpSpec, select_op

from tests.ops.test_attention import make_case

UNAVAILABLE = "; ".join(cpu_paged_decode._FP8_KERNELS[torch.float8_e4m3fn].check(None)
                        + cpu_kv_write._FP8_KERNELS[torch.float8_e4m3fn].check(None)) or None
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
FORMATS = pytest.mark.parametrize("kv_dtype", QUANTIZED_KV, ids=["e4m3", "e5m2"])


def _hard_values(kv_dtype: torch.dtype) -> torch.Tensor:
    """Float32 values at every rounding edge of `kv_dtype`: all codes, the midpoints between
    neighbouring codes (ties go to even) and a hair either side of them, beyond the
    largest value, infinities, and random magnitudes across 15 decades."""
    codes = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    eps = mids.abs() * 1e-6 + 1e-30
    limit = torch.finfo(kv_dtype).max
    extremes = torch.tensor([limit * 1.03, limit * 1.1, 1e30, float("inf"), 0.0, -0.0, 1e-30])
    g = torch.Generator().manual_seed(0)
    random = torch.randn(20000, generator=g) * torch.logspace(-9, 6, 20000)
    values = torch.cat([finite, mids, mids + eps, mids - eps, extremes, random])
    return torch.cat([values, -values])


@FORMATS
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_write_rounds_as_torch_does(kv_dtype, src_dtype):
    values = _hard_values(kv_dtype).to(src_dtype)
    values = values[: values.numel() // 64 * 64].view(-1, 2, 32)  # [tokens, Hk, D]
    tokens = values.shape[0]
    slots = torch.randperm(tokens + 50, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[3] = -1  # a padded row writes nothing
    got_k = torch.zeros((tokens + 50) // 2 + 1, 2, 2, 32, dtype=kv_dtype)
    got_v, want_k, want_v = torch.zeros_like(got_k), torch.zeros_like(got_k), torch.zeros_like(got_k)
    cpu_kv_write.kv_write_cpu_fp8(values, -values, got_k, got_v, slots, has_padding=True)
    kv_write_ref(values, -values, want_k, want_v, slots, has_padding=True)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    assert torch.isfinite(got_k.float()).all()  # saturated, never inf or NaN
    assert got_k.view(torch.uint8).any()


@FORMATS
def test_write_refuses_a_slot_outside_the_cache(kv_dtype):
    key = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    k_cache = torch.zeros(2, 4, 2, 8, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    with pytest.raises(IndexError, match="outside the cache"):
        cpu_kv_write.kv_write_cpu_fp8(key, key, k_cache, v_cache, torch.tensor([0, 8, 1]))
    assert not k_cache.view(torch.uint8).any()  # nothing written, not even the good rows


@FORMATS
@pytest.mark.usefixtures("prefill_build")
def test_a_nan_written_reads_back_as_nan(kv_dtype):
    """A model that produces NaN keeps producing NaN, as the torch ops do: the cache does
    not turn it into a finite value."""
    case, k8, v8 = _fp8_case([(30, 1), (9, 1)], kv_dtype, num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    nan_row = torch.full((1, 2, 64), float("nan"), dtype=torch.bfloat16)
    # a token of the first sequence, in a block no other row uses as table padding
    slot = case.meta.block_tables[0, 1].long() * 16 + 3
    cpu_kv_write.kv_write_cpu_fp8(nan_row, nan_row, k8, v8, slot.view(1))
    q16 = case.query.bfloat16()
    got = cpu_paged_decode.paged_decode_fp8(q16, k8, v8, case.meta, case.scale)
    want = paged_decode_ref(q16.float(), k8, v8, case.meta, case.scale)
    assert got[0].isnan().all() and not got[1].isnan().any()
    assert torch.equal(got.isnan(), want.isnan())
    # prefill: a 5-token chunk of the first sequence after 25 cached (the NaN at position 19)
    prefill = make_case([(30, 5)], block_size=16, num_heads=4, num_kv_heads=2, head_size=64, seed=1)
    prefill.meta.block_tables[:] = case.meta.block_tables[:1]
    q = prefill.query.bfloat16()
    got = cpu_paged_prefill.paged_prefill_fp8(q, q[:, :2], q[:, :2], k8, v8, prefill.meta, prefill.scale)
    assert got.isnan().all()


def _fp8_case(specs, kv_dtype, *, num_heads, num_kv_heads, head_size, block_size):
    case = make_case(specs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, seed=head_size + block_size + len(specs))
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    return case, quantize_kv(case.k_cache, kv_dtype), quantize_kv(case.v_cache, kv_dtype)


def _close_to_float32(got: torch.Tensor, exact: torch.Tensor) -> None:
    """bf16 output rounding (relative 2^-8) on top of float32 summation order."""
    assert got.dtype == torch.bfloat16
    err = (got.float() - exact).abs()
    assert (err <= exact.abs() * 2 ** -8 + 2e-3).all(), err.max().item()


def _with_threads(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@FORMATS
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(9, 3, 64), (8, 2, 128), (4, 2, 20)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 2.0)])
@pytest.mark.parametrize("lengths", [(37, 1, 20), (1300, 3, 700)], ids=["short", "split"])
def test_decode_reads_the_fp8_cache(kv_dtype, num_heads, num_kv_heads, head_size, block_size,
                                    window, softcap, lengths):
    case, k8, v8 = _fp8_case([(n, 1) for n in lengths], kv_dtype, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size)
    q16 = case.query.bfloat16()
    got = _with_threads(2, lambda: cpu_paged_decode.paged_decode_fp8(
        q16, k8, v8, case.meta, case.scale, window, softcap))
    # the reference widens the same bytes to float32
    _close_to_float32(got, paged_decode_ref(q16.float(), k8, v8, case.meta, case.scale, window, softcap))


@pytest.fixture(params=["avx2", "amx"])
def prefill_build(request, monkeypatch):
    """The float32 FMA prefill kernel on every host; its AMX build where that runs."""
    if request.param == "amx":
        if any(cpu_paged_prefill.amx_kernel(dtype) is None for dtype in QUANTIZED_KV):
            pytest.skip("no AMX, or its build does not compile")
    else:
        monkeypatch.setattr(cpu_paged_prefill, "amx_kernel", lambda kv_dtype=None: None)
    return request.param


@FORMATS
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(9, 3, 64), (4, 2, 20)])
@pytest.mark.parametrize("window, softcap", [(None, None), (90, None), (None, 2.0)])
@pytest.mark.usefixtures("prefill_build")
def test_prefill_reads_the_fp8_cache(kv_dtype, num_heads, num_kv_heads, head_size, window, softcap):
    # decodes first, then a whole prompt, a chunk after a cached prefix, a multi-tile prompt
    specs = [(9, 1), (40, 1), (37, 37), (100, 30), (300, 200), (1300, 260)]
    case, k8, v8 = _fp8_case(specs, kv_dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, block_size=16)
    nd = case.meta.num_decodes
    q16, key16, value16 = case.query[nd:].bfloat16(), case.key[nd:].bfloat16(), case.value[nd:].bfloat16()
    got = _with_threads(2, lambda: cpu_paged_prefill.paged_prefill_fp8(
        q16, key16, value16, k8, v8, case.meta, case.scale, window, softcap))
    exact = paged_prefill_ref(q16.float(), key16.float(), value16.float(), k8, v8, case.meta,
                              case.scale, window, softcap)
    _close_to_float32(got, exact)
    # the chunk's own keys come from the cache, rounded: not the fresh bf16 ones
    fresh = paged_prefill_ref(q16.float(), key16.float(), value16.float(), case.k_cache, case.v_cache,
                              case.meta, case.scale, window, softcap)
    assert (got.float() - fresh).abs().max() > 1e-3


@FORMATS
def test_registry_picks_the_fp8_kernels(kv_dtype):
    def chosen(kind, dtype, phase=None):
        return select_op(OpSpec(kind, "cpu", dtype, phase=phase, kv_dtype=kv_dtype)).builder.name

    assert chosen("paged_attention", torch.bfloat16, "decode") == "cpu_paged_decode_fp8"
    assert chosen("paged_attention", torch.bfloat16, "prefill") in ("cpu_paged_prefill_fp8", "torch_paged_prefill")
    assert chosen("kv_write", torch.bfloat16) == "cpu_kv_write_fp8"
    assert chosen("kv_write", torch.float32) == "cpu_kv_write_fp8"
    # float32 models attend through the pure-torch ops; the bf16-cache kernels never take fp8
    assert chosen("paged_attention", torch.float32, "decode") == "torch_paged_decode"
    no_fp8 = OpSpec("paged_attention", "cpu", torch.bfloat16, phase="decode")
    assert select_op(no_fp8).builder.name == "cpu_paged_decode_bf16"
