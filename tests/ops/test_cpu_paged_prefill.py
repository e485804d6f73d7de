"""The bf16 paged prefill kernel (paged_prefill_avx2.c), and on AMX hosts its AMX build
(paged_prefill_amx.h), against the pure-torch prefill on the same bf16 cache: first chunks and chunks after a cached prefix in one call, behind
decode rows; scattered block tables (every other slot holds large values, so reading
outside a context shows); GQA groups of 1 to 16; head sizes that are not a multiple of 8
or 16 (padded dims); prompts that cross key tiles (64) and work items (128 rows); windows
and soft-capping. Errors against a float32 computation of the same bf16 data are at bf16
rounding level and no worse than torch's own bf16 SDPA."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.attention.torch_paged import kv_write_ref, paged_prefill_ref
from tessera.ops.cpu import paged_prefill as cpu_paged_prefill
from tessera.ops.cpu.paged_prefill import paged_prefill_bf16
from tessera.ops.registry import OpSpec, select_op

from tests.ops.test_attention import make_case

UNAVAILABLE = "; ".join(cpu_paged_prefill._KERNEL.check(None)) or None
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

# (context after the step, query length): decodes first, then a whole prompt, chunks after
# a prefix (short and long), and a prompt long enough for several tiles and items
SPECS = {
    "mixed": [(9, 1), (40, 1), (37, 37), (100, 30), (300, 200), (70, 2)],
    "long": [(700, 700)],
    "chunk-after-prefix": [(1300, 260)],
}


@pytest.fixture(params=["avx2", "amx"])
def build(request, monkeypatch):
    """The float32 FMA kernel on every host; the AMX build where it runs (head sizes padded
    to steps of 32: 16, 20, 24 here)."""
    if request.param == "amx":
        if cpu_paged_prefill.amx_kernel() is None:
            pytest.skip("no AMX, or its build does not compile")
    else:
        monkeypatch.setattr(cpu_paged_prefill, "amx_kernel", lambda: None)
    return request.param


def _run(specs, *, num_heads, num_kv_heads, head_size, block_size, window, softcap, threads=2):
    case = make_case(specs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, seed=head_size + block_size + len(specs))
    kv_write_ref(case.key, case.value, case.k_cache, case.v_cache, case.meta.slot_mapping)
    nd = case.meta.num_decodes
    k16, v16 = case.k_cache.bfloat16(), case.v_cache.bfloat16()
    q16, key16, value16 = case.query[nd:].bfloat16(), case.key[nd:].bfloat16(), case.value[nd:].bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_prefill_bf16(q16, key16, value16, k16, v16, case.meta, case.scale, window, softcap)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.bfloat16 and got.shape == q16.shape
    exact = paged_prefill_ref(q16.float(), key16.float(), value16.float(), k16.float(), v16.float(),
                              case.meta, case.scale, window, softcap)
    torch_bf16 = paged_prefill_ref(q16, key16, value16, k16, v16, case.meta, case.scale, window, softcap)
    err = (got.float() - exact).abs().max().item()
    assert err <= 2e-2, err
    assert err <= 1.5 * (torch_bf16.float() - exact).abs().max().item() + 4e-3, err
    return got


@pytest.mark.parametrize("num_heads, num_kv_heads, head_size",
                         [(9, 3, 64), (8, 2, 128), (4, 4, 24), (16, 1, 16), (4, 2, 20), (2, 1, 256)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (90, None), (None, 2.0), (70, 1.5)])
@pytest.mark.parametrize("specs", ["mixed"])
@pytest.mark.usefixtures("build")
def test_matches_torch_prefill(num_heads, num_kv_heads, head_size, block_size, window, softcap, specs):
    _run(SPECS[specs], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
         block_size=block_size, window=window, softcap=softcap)


@pytest.mark.parametrize("specs", ["long", "chunk-after-prefix"])
@pytest.mark.parametrize("window, softcap", [(None, None), (300, None), (None, 2.0)])
@pytest.mark.usefixtures("build")
def test_long_prompts_and_chunks(specs, window, softcap):
    _run(SPECS[specs], num_heads=9, num_kv_heads=3, head_size=64, block_size=16, window=window, softcap=softcap)


@pytest.mark.parametrize("window", [2**31 + 100, 2**32, 2**32 + 5, 10**12])
@pytest.mark.usefixtures("build")
def test_windows_past_32_bits_mean_no_window(window):
    # the kernel's masks are 32-bit lanes: bounds are clamped before narrowing (they wrapped)
    kwargs = dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, softcap=None)
    wide = _run([(40, 40), (100, 30)], window=window, **kwargs)
    assert torch.equal(wide, _run([(40, 40), (100, 30)], window=None, **kwargs))


# A few new tokens after a long cached prefix make fewer work items than 4 per thread: with
# 2 threads their keys are split into parts (of >= 256 keys, whole 64-key tiles) merged
# afterwards. Windows shorter and longer than a part; group 16 on one KV head (one block,
# eight parts); decode rows ahead.
@pytest.mark.parametrize("specs", [[(5, 1), (2000, 10)], [(3000, 5)], [(1300, 60), (900, 3)], [(700, 40)]],
                         ids=["after-decodes", "eight-parts", "two-seqs", "two-parts"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", [(9, 3, 64), (16, 1, 64), (4, 2, 20), (2, 1, 512)])
@pytest.mark.parametrize("window, softcap", [(None, None), (300, None), (1000, 2.0)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.usefixtures("build")
def test_long_prefix_short_chunk_splits_keys(specs, num_heads, num_kv_heads, head_size, window, softcap, threads):
    _run(specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, block_size=16,
         window=window, softcap=softcap, threads=threads)


@pytest.mark.usefixtures("build")
def test_threads_do_not_change_the_bits():
    # each work item's sums run in one order whatever thread takes it (without a key split)
    kwargs = dict(num_heads=9, num_kv_heads=3, head_size=64, block_size=16, window=None, softcap=None)
    one = _run(SPECS["mixed"], threads=1, **kwargs)
    two = _run(SPECS["mixed"], threads=2, **kwargs)
    assert torch.equal(one, two)


def test_amx_hosts_without_its_amx_build_keep_torch(monkeypatch):
    monkeypatch.setattr(cpu_paged_prefill, "cpu_flags", lambda: frozenset({"avx2", "fma", "amx_bf16"}))
    monkeypatch.setattr(cpu_paged_prefill, "amx_kernel", lambda: None)
    assert "AMX" in " ".join(cpu_paged_prefill._check(None))


def test_block_size_not_a_power_of_two_runs_through_torch():
    _run([(3, 1), (50, 50), (90, 20)], num_heads=4, num_kv_heads=2, head_size=16, block_size=6,
         window=None, softcap=None)


def test_registry_prefers_it_for_bf16_prefill_only():
    spec = OpSpec("paged_attention", "cpu", torch.bfloat16, phase="prefill", sliding_window=True, softcap=True)
    reasons = cpu_paged_prefill._check(spec)  # (AMX hosts whose compiler lacks AMX: torch's SDPA)
    assert select_op(spec).builder.name == ("torch_paged_prefill" if reasons else "cpu_paged_prefill_bf16")
    assert select_op(OpSpec("paged_attention", "cpu", torch.float32, phase="prefill")).builder.name \
        == "torch_paged_prefill"
