"""The AVX512 bf16 GEMM builder against torch's bf16 linear: every shape class (k not a
multiple of 32, n not a multiple of 4, 1..MAX_ROWS rows, register-tile and L2-block edges, bias), the fall-back to F.linear above
its row limit, and the registry's choice and refusal reasons. Skipped where the CPU has
no AVX512 or no C compiler (the registry then keeps torch_linear, tested here too)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.ops.cpu import build
from tessera.ops.cpu import linear as cpu_linear
from tessera.ops.registry import OpSpec, select_op

needs_kernel = pytest.mark.skipif(cpu_linear.kernel_unavailable() is not None,
                                  reason=str(cpu_linear.kernel_unavailable()))


def assert_bf16_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """Within one bf16 rounding of the exact (float64) result: accumulation order may differ
    from torch's, so the rounded outputs may differ by an ulp, never more. Where the sum
    nearly cancels, float32 accumulation in any order errs by a few units of roundoff of
    sum |x w| (2^-20 of it allowed: far below what one wrong term would cost)."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -7
    accumulation = F.linear(x.double().abs(), w.double().abs()) * 2.0 ** -20
    err = (got.double() - exact).abs()
    assert (err <= ulp + accumulation + 1e-6).all(), f"max error {err.max():.4g} over one bf16 ulp"
    torch_err = (F.linear(x, w, b).double() - exact).abs()
    assert err.max() <= torch_err.max() * 1.5 + 1e-6  # no worse than torch's own rounding


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 32, 200])
@pytest.mark.parametrize("n, k", [(64, 64), (30, 45), (7, 577), (1001, 96), (4, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_torch(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = cpu_linear._gemm(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert_bf16_close(got, x, w, b)


@needs_kernel
def test_builder_handles_batches_views_and_falls_back_beyond_its_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).bfloat16()
    x3 = torch.randn(1, 3, 40, generator=g).bfloat16()            # leading dims flattened
    assert cpu_linear.gemm_linear(x3, w, None).shape == (1, 3, 48)
    assert_bf16_close(cpu_linear.gemm_linear(x3, w, None).view(3, 48), x3.view(3, 40), w, None)
    strided = torch.randn(2, 80, generator=g).bfloat16()[:, ::2]  # non-contiguous input
    assert_bf16_close(cpu_linear.gemm_linear(strided, w, None), strided, w, None)
    big = torch.randn(cpu_linear.MAX_ROWS + 1, 40, generator=g).bfloat16()
    torch.testing.assert_close(cpu_linear.gemm_linear(big, w, None), F.linear(big, w), rtol=0, atol=0)
    x32 = torch.randn(2, 40, generator=g)                           # float32 goes to torch
    torch.testing.assert_close(cpu_linear.gemm_linear(x32, w.float(), None), F.linear(x32, w.float()))


@needs_kernel
def test_registry_prefers_the_kernel_for_bf16_on_cpu_only():
    assert select_op(OpSpec("linear", "cpu", torch.bfloat16)).builder.name == "cpu_gemm_bf16"
    choice = select_op(OpSpec("linear", "cpu", torch.float32))
    assert choice.builder.name == "torch_linear"
    assert any(name == "cpu_gemm_bf16" and "dtype" in " ".join(r) for name, r in choice.rejected)


def test_without_the_instruction_set_the_registry_says_why(monkeypatch):
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse2", "sse4_2"}))
    select_op.cache_clear()
    try:
        choice = select_op(OpSpec("linear", "cpu", torch.bfloat16))
        assert choice.builder.name == "torch_linear"
        assert ("cpu_gemm_bf16", ("this CPU lacks avx512f, avx512bw, avx512vl, fma",)) in choice.rejected
        assert ("cpu_gemm_bf16_avx2", ("this CPU lacks avx2, fma",)) in choice.rejected
    finally:
        select_op.cache_clear()


def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "compiler", lambda: str(tmp_path / "no-such-compiler"))
    build.load_kernel.cache_clear()
    try:
        with pytest.raises((build.KernelBuildError, OSError)):
            build.load_kernel("gemm_bf16.c", tmp_path / "cache")
    finally:
        build.load_kernel.cache_clear()


# ---- packed weights (the builder's `prepare`) ------------------------------------------


def _unless_builds(source: str):
    reason = build.unavailable_reason(source)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


_PACKED_BUILDERS = [
    pytest.param(cpu_linear.gemm_linear, marks=_unless_builds("gemm_bf16.c"), id="avx512"),
    pytest.param(cpu_linear.gemm_linear_avx2, marks=_unless_builds("gemm_bf16_avx2.c"), id="avx2"),
]


@pytest.fixture
def without_amx(monkeypatch):
    """The AVX512 packed kernel at every row count (on an AMX host the tiles take most rows)."""
    monkeypatch.setattr(cpu_linear, "has_amx", lambda: False)
    monkeypatch.setattr(cpu_linear, "amx_kernel_ready", lambda: False)


@pytest.mark.usefixtures("without_amx")
@pytest.mark.parametrize("linear", _PACKED_BUILDERS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 12, 13, 32, 200])
@pytest.mark.parametrize("n, k", [(16, 2), (48, 578), (80, 64), (1024, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_kernel_matches_torch(linear, m, n, k, bias):
    """Odd and even panel counts (80 / 16 = 5), row tiles (12 rows AVX512, 4 AVX2) and their
    remainders (row blocks: test_packed_kernel_across_row_blocks)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_linear.pack_weight(w)
    assert packed.shape == (n // 16, k // 2, 32) and torch.equal(cpu_linear.unpack_weight(packed), w)
    got = linear(x, packed, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert_bf16_close(got, x, w, b)


@needs_kernel
def test_pack_leaves_unpackable_weights_alone_and_checks_inputs():
    for w in (torch.randn(24, 64).bfloat16(), torch.randn(32, 63).bfloat16(), torch.randn(32, 64)):
        assert cpu_linear.pack_weight(w) is w  # 24 rows, odd k, float32: used as loaded
    w = torch.randn(32, 64).bfloat16()
    packed = cpu_linear.pack_weight(w)
    assert cpu_linear.pack_weight(packed) is packed
    x = torch.randn(2, 3, 64).bfloat16()
    assert_bf16_close(cpu_linear.gemm_linear(x, packed, None).view(6, 32), x.view(6, 64), w, None)
    assert cpu_linear.gemm_linear(x[:, :0], packed, None).shape == (2, 0, 32)
    with pytest.raises(ValueError, match="64"):
        cpu_linear.gemm_linear(torch.randn(2, 32).bfloat16(), packed, None)


@needs_kernel
def test_layers_pack_after_loading_and_a_tied_head_leaves_the_embedding_rows():
    from tessera.ops.embedding import LMHead, VocabEmbedding
    from tessera.ops.linear import Linear
    from tessera.ops.registry import OpTarget
    from tessera.ops.weights import prepare_weights

    target = OpTarget("cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    linear, odd = Linear(64, 48, target, bias=True), Linear(64, 40, target)
    embed = VocabEmbedding(96, 64, target)
    head = LMHead(96, 64, target, tied_to=embed)
    for p in (linear.weight, linear.bias, odd.weight, embed.weight):
        p.data.copy_(torch.randn(p.shape, generator=g))
    plain_w, plain_rows = linear.weight.data.clone(), embed.weight.data.clone()
    x = torch.randn(3, 64, generator=g).bfloat16()
    before = (linear(x), odd(x), head(x))
    module = torch.nn.ModuleList([linear, odd, embed, head])
    prepare_weights(module)
    assert cpu_linear.is_packed(linear.weight) and torch.equal(cpu_linear.unpack_weight(linear.weight), plain_w)
    assert not cpu_linear.is_packed(odd.weight)           # 40 features: not a multiple of 16
    assert cpu_linear.is_packed(head.weight) and torch.equal(embed.weight.data, plain_rows)
    ids = torch.tensor([0, 5, 95])
    torch.testing.assert_close(embed(ids), plain_rows[ids], rtol=0, atol=0)
    for got, want in zip((linear(x), odd(x), head(x)), before):
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


@needs_kernel
@pytest.mark.usefixtures("without_amx")
def test_packed_kernel_across_row_blocks():
    """More rows than one 4 MB block of x (1024 rows at k = 2048): blocks and their remainder."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1100, 2048, generator=g).bfloat16()
    w = torch.randn(48, 2048, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    assert_bf16_close(cpu_linear.gemm_linear(x, cpu_linear.pack_weight(w), b), x, w, b)


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_without_the_amx_kernel_a_prefills_rows_go_to_torch_on_the_unpacked_weight(monkeypatch, bias):
    """An AMX CPU whose compiler cannot build gemm_packed_amx.c: from AMX_MIN_ROWS rows,
    torch's GEMM (AMX tiles under oneDNN) on the weight unpacked for the call, exactly
    F.linear on the plain weight; fewer rows keep the packed kernel's result exactly. (The
    dispatch is tested on any host: F.linear runs everywhere.)"""
    monkeypatch.setattr(cpu_linear, "has_amx", lambda: True)
    monkeypatch.setattr(cpu_linear, "amx_kernel_ready", lambda: False)
    g = torch.Generator().manual_seed(11)
    n, k, rows = 96, 160, cpu_linear.AMX_MIN_ROWS
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None  # (float32: brought to bf16 as the kernel's path does)
    packed = cpu_linear.pack_weight(w)
    bf16_b = None if b is None else b.bfloat16()
    for m in (rows, rows + 7):
        x = torch.randn(2, m, k, generator=g).bfloat16()[1]  # (a view)
        assert torch.equal(cpu_linear.gemm_linear(x, packed, b), F.linear(x, w, bf16_b))
    x = torch.randn(rows - 1, k, generator=g).bfloat16()
    kernel = cpu_linear._packed_linear(cpu_linear._GEMM_PACKED, x, packed, b)
    assert torch.equal(cpu_linear.gemm_linear(x, packed, b), kernel)
    assert_bf16_close(cpu_linear.gemm_linear(x, packed, b), x, w, bf16_b)


needs_amx_kernel = pytest.mark.skipif(not cpu_linear.amx_kernel_ready(), reason="no AMX, or its kernel does not build")


@needs_amx_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 15, 16, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("n, k", [(16, 32), (48, 64), (80, 96), (1024, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_kernel_matches_torch(m, n, k, bias):
    """Odd and even panel counts, one and two row tiles, rows past the last whole 16 (padded)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    got = cpu_linear._packed_linear(cpu_linear._GEMM_PACKED_AMX, x, cpu_linear.pack_weight(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert_bf16_close(got, x, w, b)


@needs_amx_kernel
def test_amx_kernel_takes_x_in_blocks_of_rows():
    """At k = 4096 a block of x is 64 rows (amx_row_block: 512 KB): 145 rows are two whole
    blocks and one of 17 (a whole tile and a padded one). Every row gets the bits it gets
    alone in a call of fewer rows than a block, and the product is torch's."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(48, 4096, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    packed = cpu_linear.pack_weight(w)
    x = torch.randn(145, 4096, generator=g).bfloat16()
    whole = cpu_linear._packed_linear(cpu_linear._GEMM_PACKED_AMX, x, packed, b)
    parts = [cpu_linear._packed_linear(cpu_linear._GEMM_PACKED_AMX, x[a:a + 40], packed, b) for a in range(0, 145, 40)]
    assert torch.equal(torch.cat(parts), whole)
    assert_bf16_close(whole, x, w, b)


@needs_amx_kernel
def test_on_amx_a_rows_bits_do_not_depend_on_its_batch_and_the_dispatch():
    """Each row is its own tile row over the same k steps: 40 rows at once or in batches of
    3, 17 and 20 give the same bits. gemm_linear takes the AMX kernel from
    AMX_KERNEL_MIN_ROWS rows when k is a multiple of 32, the AVX512 kernel otherwise."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=g).bfloat16()
    packed = cpu_linear.pack_weight(w)
    x = torch.randn(40, 128, generator=g).bfloat16()
    whole = cpu_linear.gemm_linear(x, packed, None)
    assert torch.equal(whole, cpu_linear._packed_linear(cpu_linear._GEMM_PACKED_AMX, x, packed, None))
    parts = [cpu_linear.gemm_linear(x[a:b], packed, None) for a, b in ((0, 3), (3, 20), (20, 40))]
    assert torch.equal(torch.cat(parts), whole)
    few = x[:cpu_linear.AMX_KERNEL_MIN_ROWS - 1]
    assert torch.equal(cpu_linear.gemm_linear(few, packed, None),
                       cpu_linear._packed_linear(cpu_linear._GEMM_PACKED, few, packed, None))
    odd_w = torch.randn(64, 80, generator=g).bfloat16()  # k = 80: not whole steps of 32
    odd_x = torch.randn(8, 80, generator=g).bfloat16()
    odd = cpu_linear.pack_weight(odd_w)
    assert torch.equal(cpu_linear.gemm_linear(odd_x, odd, None),
                       cpu_linear._packed_linear(cpu_linear._GEMM_PACKED, odd_x, odd, None))


def test_unpacking_gives_the_weight_back_as_its_own_tensor():
    w = torch.randn(48, 70).bfloat16()
    packed = cpu_linear.pack_weight(w)
    plain = cpu_linear.unpack_weight(packed)
    assert plain.is_contiguous() and torch.equal(plain, w) and plain.data_ptr() != packed.data_ptr()


# ---- the AVX2 kernel (CPUs without AVX512): same packed layout ---------------------------
needs_avx2_kernel = _unless_builds("gemm_bf16_avx2.c")


@needs_avx2_kernel
def test_avx2_builder_handles_views_row_blocks_and_unpackable_weights():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(48, 2048, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    x = torch.randn(1100, 2048, generator=g).bfloat16()  # more than one 4 MB block of float32 rows
    assert_bf16_close(cpu_linear.gemm_linear_avx2(x, cpu_linear.pack_weight(w), b), x, w, b)
    x3 = torch.randn(2, 3, 2048, generator=g).bfloat16()
    got = cpu_linear.gemm_linear_avx2(x3, cpu_linear.pack_weight(w), None)
    assert got.shape == (2, 3, 48)
    assert_bf16_close(got.view(6, 48), x3.view(6, 2048), w, None)
    odd = torch.randn(40, 64, generator=g).bfloat16()  # not packable: F.linear
    xo = torch.randn(3, 64, generator=g).bfloat16()
    torch.testing.assert_close(cpu_linear.gemm_linear_avx2(xo, odd, None), F.linear(xo, odd), rtol=0, atol=0)
    with pytest.raises(ValueError, match="2048"):
        cpu_linear.gemm_linear_avx2(torch.randn(2, 64).bfloat16(), cpu_linear.pack_weight(w), None)


@needs_avx2_kernel
def test_without_avx512_the_registry_takes_the_avx2_kernel(monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    select_op.cache_clear()
    try:
        choice = select_op(OpSpec("linear", "cpu", torch.bfloat16))
        assert choice.builder.name == "cpu_gemm_bf16_avx2"
        # forced by the setting on an AVX512 CPU ("AVX512 (...=avx2)"), or flag by flag
        # ("avx512f, avx512bw, ...") on a CPU without it
        (reason,) = dict(choice.rejected)["cpu_gemm_bf16"]
        assert reason.startswith("this CPU lacks") and "avx512" in reason.lower()
        # the small kernels and the int8 GEMM run their AVX2 builds under the same builders
        from tessera.ops.cpu import linear_int8 as cpu_int8
        from tessera.ops.cpu import norm as cpu_norm

        assert select_op(OpSpec("rms_norm", "cpu", torch.bfloat16)).builder.name == "cpu_rms_norm_bf16"
        assert cpu_norm._KERNEL.runnable_source() == "rms_norm_avx2.c"
        assert select_op(OpSpec("linear", "cpu", torch.bfloat16, quant="int8")).builder.name == "cpu_gemm_int8"
        assert cpu_int8._KERNEL.runnable_source() == "gemm_int8_avx2.c"
    finally:
        select_op.cache_clear()


@needs_avx2_kernel
def test_avx2_rows_come_out_the_same_in_any_batch():
    """A row's output does not depend on the rows beside it: from three rows on, both paths
    (widening in registers below 24 rows, a float32 copy of the panel from 24) and every
    tile split sum in the same order, bit for bit (padded decode-graph buckets rely on it)."""
    g = torch.Generator().manual_seed(12)
    w = cpu_linear.pack_weight(torch.randn(80, 576, generator=g).bfloat16())
    b = torch.randn(80, generator=g).bfloat16()
    x = torch.randn(64, 576, generator=g).bfloat16()
    want = cpu_linear.gemm_linear_avx2(x[:3], w, b)
    for m in (4, 5, 7, 16, 23, 24, 25, 31, 64):
        got = cpu_linear.gemm_linear_avx2(x[:m], w, b)
        assert torch.equal(got[:3], want), m
    two = cpu_linear.gemm_linear_avx2(x[:2], w, b)  # one and two rows: their own order
    assert torch.equal(cpu_linear.gemm_linear_avx2(x[:1], w, b), two[:1])
    assert_bf16_close(two, x[:2], cpu_linear.unpack_weight(w), b)


def test_amx_builds_are_a_family_of_their_own(monkeypatch):
    """*_amx.c files and sources built with TESSERA_AMX take AMX's compiler flags and need
    the CPU's amx_tile / amx_bf16 (and AVX512-BF16); TESSERA_CPU_KERNEL_ISA other than
    native turns them off, as it does the extensions."""
    monkeypatch.setenv(build.ISA_ENV, "native")  # (the other-builds run sets it for the whole suite)
    amx = (build.AMX_DEFINE,)
    assert build.kernel_family("gemm_packed_amx.c") == build.kernel_family("gemm_int8.c", amx) == "amx"
    assert build.kernel_family("gemm_int8.c") == "avx512"
    assert {"-mamx-tile", "-mamx-bf16", "-mavx512bf16"} <= set(build.build_flags("gemm_int8.c", amx))
    assert "-mamx-tile" not in build.build_flags("gemm_int8.c")
    avx512 = frozenset({"avx512f", "avx512bw", "avx512vl", "fma", "avx512_bf16"})
    monkeypatch.setattr(build, "cpu_flags", lambda: avx512)
    assert build.missing_cpu_flags("gemm_packed_amx.c") == ["amx_tile", "amx_bf16"]
    assert build.missing_cpu_flags("gemm_int8.c", amx) == ["amx_tile", "amx_bf16"]
    monkeypatch.setattr(build, "cpu_flags", lambda: avx512 | {"amx_tile", "amx_bf16"})
    assert build.missing_cpu_flags("gemm_packed_amx.c") == []
    monkeypatch.setenv(build.ISA_ENV, "avx512")
    assert build.missing_cpu_flags("gemm_packed_amx.c") == [f"AMX ({build.ISA_ENV}=avx512)"]
    assert build.missing_cpu_flags("gemm_int8.c") == []
