"""Attention sinks (gpt-oss): a learned logit per query head joins every softmax's
denominator and adds no value. The pure-torch ops against a float64 softmax written out
per query and head; the C kernels (AVX512 bf16 decode, AVX2 decode and prefill, their fp8
cache builds, contexts split across threads and merged) against the torch ops on the same
data. Sinks include one far above every score (the kernels must not overflow) and one far
below (no effect)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.ops.attention import Attention
from tessera.ops.attention.kv_quant import quantize_kv
from tessera.ops.attention.torch_paged import kv_write_ref, paged_decode_ref, paged_prefill_ref
from tessera.ops.cpu import paged_decode as cpu_decode
from tessera.ops.cpu import paged_prefill as cpu_prefill
from tessera.ops.registry import OpLookupError, OpSpec, OpTarget, select_op

from tests.ops.test_attention import GEOMETRIES, Case, make_case
from tests.ops.test_cpu_fp8_kv import _close_to_float32, _with_threads


def make_sinks(num_heads: int, seed: int) -> torch.Tensor:
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0] = 40.0    # dominates every score: the head attends to almost nothing
    if num_heads > 2:
        sinks[-1] = -60.0  # never matters
    return sinks


def naive_with_sinks(case: Case, sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    """float64, one query and head at a time: softmax over [scores, sink], sink dropped."""
    out, row = [], 0
    num_heads = case.query.shape[1]
    group = num_heads // case.dense_k[0].shape[1]
    for (ctx, q_len), k, v in zip(case.specs, case.dense_k, case.dense_v):
        for j in range(q_len):
            pos = ctx - q_len + j
            first = 0 if window is None else max(0, pos - window + 1)
            heads = []
            for h in range(num_heads):
                kh, vh = k[first:pos + 1, h // group].double(), v[first:pos + 1, h // group].double()
                logits = torch.cat((kh @ case.query[row, h].double() * case.scale, sinks[h:h + 1].double()))
                heads.append(torch.softmax(logits, dim=0)[:-1] @ vh)
            out.append(torch.stack(heads))
            row += 1
    return torch.stack(out).float()


@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size", GEOMETRIES)
@pytest.mark.parametrize("window", [None, 6])
def test_torch_ops_match_a_written_out_softmax(num_heads, num_kv_heads, head_size, block_size, window):
    specs = [(9, 1), (30, 1), (17, 17), (40, 12)]  # two decodes, a prompt, a chunk after a prefix
    case = make_case(specs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, seed=num_heads + head_size)
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    sinks = make_sinks(num_heads, seed=head_size)
    nd = case.meta.num_decodes
    decode = paged_decode_ref(case.query[:nd], case.k_cache, case.v_cache, case.meta, case.scale, window, None, sinks)
    prefill = paged_prefill_ref(case.query[nd:], case.key[nd:], case.value[nd:], case.k_cache, case.v_cache,
                                case.meta, case.scale, window, None, sinks)
    want = naive_with_sinks(case, sinks, window)
    torch.testing.assert_close(torch.cat((decode, prefill)), want, atol=2e-5, rtol=1e-4)
    # the sink is what makes the difference: head 0 attends to almost nothing
    assert want[:, 0].abs().max() < 1e-6
    plain = paged_decode_ref(case.query[:nd], case.k_cache, case.v_cache, case.meta, case.scale, window)
    assert (plain[:, 0] - decode[:, 0]).abs().max() > 0.1


def _bf16_data(case: Case, kv_dtype: torch.dtype | None):
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    if kv_dtype is None:
        k, v = case.k_cache.bfloat16(), case.v_cache.bfloat16()
        return k, v, k.float(), v.float()
    k, v = quantize_kv(case.k_cache, kv_dtype), quantize_kv(case.v_cache, kv_dtype)
    return k, v, k.float(), v.float()


# kv None: the bf16 cache (the AVX512 kernel where the CPU has AVX512-BF16, else AVX2);
# fp8: the AVX2 kernel's fp8 build, which splits long contexts across threads
KV_DTYPES = pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])


def _decode_kernel(kv_dtype):
    return cpu_decode.paged_decode_bf16 if kv_dtype is None else cpu_decode.paged_decode_fp8


def _prefill_kernel(kv_dtype):
    return cpu_prefill.paged_prefill_bf16 if kv_dtype is None else cpu_prefill.paged_prefill_fp8


def _skip_unless_built(kernel_module, kv_dtype):
    kernel = kernel_module._KERNEL if kv_dtype is None else kernel_module._FP8_KERNELS[kv_dtype]
    reasons = kernel.check(None)
    if reasons:
        pytest.skip("; ".join(reasons))


@KV_DTYPES
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(8, 2, 64), (4, 1, 128), (6, 3, 20)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("lengths", [(37, 1, 20), (37, 1, 20, 5, 64, 3, 17, 33, 2, 50), (1000,), (700, 1, 300)],
                         ids=["3-seqs", "10-seqs", "one-long", "three-long"])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_decode_kernels(kv_dtype, num_heads, num_kv_heads, head_size, window, lengths, threads):
    _skip_unless_built(cpu_decode, kv_dtype)
    case = make_case([(n, 1) for n in lengths], block_size=16, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_size=head_size, seed=len(lengths) + head_size)
    k, v, kf, vf = _bf16_data(case, kv_dtype)
    q16, sinks = case.query.bfloat16(), make_sinks(num_heads, seed=head_size)
    got = _with_threads(threads, lambda: _decode_kernel(kv_dtype)(q16, k, v, case.meta, case.scale, window, None, sinks))
    _close_to_float32(got, paged_decode_ref(q16.float(), kf, vf, case.meta, case.scale, window, None, sinks))


@KV_DTYPES
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(8, 2, 64), (4, 4, 24), (6, 3, 20)])
@pytest.mark.parametrize("window", [None, 90])
@pytest.mark.parametrize("specs", [[(9, 1), (37, 37), (100, 30), (300, 200)], [(1300, 260)], [(2000, 3)]],
                         ids=["mixed", "chunk-after-prefix", "split-keys"])
def test_cpu_prefill_kernels(kv_dtype, num_heads, num_kv_heads, head_size, window, specs):
    _skip_unless_built(cpu_prefill, kv_dtype)
    case = make_case(specs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, seed=head_size + len(specs))
    k, v, kf, vf = _bf16_data(case, kv_dtype)
    nd = case.meta.num_decodes
    q16, key16, value16 = case.query[nd:].bfloat16(), case.key[nd:].bfloat16(), case.value[nd:].bfloat16()
    sinks = make_sinks(num_heads, seed=head_size + 1)
    got = _with_threads(2, lambda: _prefill_kernel(kv_dtype)(q16, key16, value16, k, v, case.meta, case.scale,
                                                              window, None, sinks))
    # fresh K/V of another dtype than the cache's: the reference reads every key from the
    # cache, as the kernel does (it would take a whole prompt's fresh, unquantized rows)
    _close_to_float32(got, paged_prefill_ref(q16.float(), key16.double(), value16.double(), kf, vf, case.meta,
                                  case.scale, window, None, sinks))


def test_builders_state_whether_they_implement_sinks():
    spec = OpSpec(kind="paged_attention", device="cuda", dtype=torch.bfloat16, phase="decode", sinks=True)
    choice = select_op(spec)
    assert choice.builder.sinks
    plain = OpSpec(kind="paged_attention", device="cpu", dtype=torch.float32, phase="prefill", sinks=True)
    assert select_op(plain).builder.name == "torch_paged_prefill"


def test_a_builder_without_sinks_is_passed_over_with_the_reason(monkeypatch):
    from tessera.ops import registry

    # every builder implements sinks today: one that did not would be skipped, saying why
    without = [dataclasses.replace(b, sinks=False) for b in registry._BUILDERS["paged_attention"]]
    monkeypatch.setitem(registry._BUILDERS, "paged_attention", without)
    registry.select_op.cache_clear()
    try:
        with pytest.raises(OpLookupError, match="no attention sinks"):
            select_op(OpSpec(kind="paged_attention", device="cpu", dtype=torch.float32, phase="decode", sinks=True))
    finally:
        registry.select_op.cache_clear()


def test_layer_needs_sinks_exactly_when_built_with_them():
    target = OpTarget(device="cpu", dtype=torch.float32)
    layer = Attention(4, 8, 2, 8 ** -0.5, target, sinks=True)
    layer.kv_cache = (torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8))
    q, kv = torch.zeros(1, 32), torch.zeros(1, 16)
    with pytest.raises(ValueError, match="exactly when"):
        layer(q, kv, kv)
    plain = Attention(4, 8, 2, 8 ** -0.5, target)
    plain.kv_cache = layer.kv_cache
    with pytest.raises(ValueError, match="exactly when"):
        plain(q, kv, kv, sinks=torch.zeros(4))
