"""The AVX512-BF16 GEMM builder against torch's bf16 linear: every shape class (k not a
multiple of 32, n not a multiple of 4, 1..MAX_ROWS rows, register-tile and L2-block edges, bias), the fall-back to F.linear above
its row limit, and the registry's choice and refusal reasons. Skipped where the CPU has
no AVX512-BF16 or no C compiler (the registry then keeps torch_linear, tested here too)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.ops.cpu import linear as cpu_linear
from tessera.ops.registry import OpSpec, select_op

needs_kernel = pytest.mark.skipif(cpu_linear.kernel_unavailable() is not None,
                                  reason=str(cpu_linear.kernel_unavailable()))


def assert_bf16_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    """Within one bf16 rounding of the exact (float64) result: accumulation order may differ
    from torch's, so the rounded outputs may differ by an ulp, never more."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    ulp = exact.abs().clamp_min(1e-3) * 2.0 ** -7
    err = (got.double() - exact).abs()
    assert (err <= ulp + 1e-6).all(), f"max error {err.max():.4g} over one bf16 ulp"
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
    monkeypatch.setattr(cpu_linear, "cpu_has_avx512_bf16", lambda: False)
    select_op.cache_clear()
    try:
        choice = select_op(OpSpec("linear", "cpu", torch.bfloat16))
        assert choice.builder.name == "torch_linear"
        assert ("cpu_gemm_bf16", ("this CPU has no AVX512-BF16",)) in choice.rejected
    finally:
        select_op.cache_clear()


def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    from tessera.ops.cpu import build

    monkeypatch.setattr(build, "compiler", lambda: str(tmp_path / "no-such-compiler"))
    build.load_kernel.cache_clear()
    try:
        with pytest.raises((build.KernelBuildError, OSError)):
            build.load_kernel("gemm_bf16.c", tmp_path / "cache")
    finally:
        build.load_kernel.cache_clear()
