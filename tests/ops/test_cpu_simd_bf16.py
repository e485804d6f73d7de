"""simd_bf16.h, the bf16 arithmetic every AVX512 kernel uses: its conversions and dot
products against torch, in the build this CPU gets (native AVX512-BF16 / VNNI instructions,
or the AVX512F emulation); and the whole kernel suite once more in the builds this CPU
would not pick (emulated AVX512, AVX2), so every build is tested wherever the suite runs."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.ops.cpu import build

pytestmark = pytest.mark.skipif(build.unavailable_reason("gemm_bf16.c") is not None,
                                reason=str(build.unavailable_reason("gemm_bf16.c")))

_PROBE = r"""
#include <stdint.h>
#include "simd_bf16.h"
void to_bf16(const float *x, uint16_t *out, int64_t n) {  /* n % 16 == 0 */
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), f32x16_to_bf16(_mm512_loadu_ps(x + i)));
}
void to_bf16_pairs(const float *x, uint16_t *out, int64_t n) {  /* n % 32 == 0 */
    for (int64_t i = 0; i < n; i += 32)
        _mm512_storeu_si512(out + i, f32x32_to_bf16(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
}
void to_bf16_x4(const float *x, uint16_t *out) {
    _mm_storel_epi64((__m128i *)out, f32x4_to_bf16(_mm_loadu_ps(x)));
}
void dot_bf16(const uint16_t *a, const uint16_t *b, float *out) {  /* 32 pairs -> 16 lanes */
    _mm512_storeu_ps(out, dot_bf16_pairs(_mm512_setzero_ps(), _mm512_loadu_si512(a), _mm512_loadu_si512(b)));
}
void dot_i16(const int16_t *a, const int16_t *b, int32_t *out) {
    _mm512_storeu_si512(out, dot_i16_pairs(_mm512_set1_epi32(7), _mm512_loadu_si512(a), _mm512_loadu_si512(b)));
}
int native(void) { return TESSERA_NATIVE_BF16; }
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> ctypes.CDLL:
    lib = build.load_source("simd_probe", _PROBE, tmp_path_factory.mktemp("kernels"))
    ptr, n = ctypes.c_void_p, ctypes.c_int64
    for name, args in {"to_bf16": (ptr, ptr, n), "to_bf16_pairs": (ptr, ptr, n), "to_bf16_x4": (ptr, ptr),
                       "dot_bf16": (ptr, ptr, ptr), "dot_i16": (ptr, ptr, ptr), "native": ()}.items():
        getattr(lib, name).argtypes = list(args)
    return lib


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def test_float_to_bf16_rounds_like_torch(probe):
    bits = torch.tensor([
        0x3f808000, 0x3f818000,  # ties: to even (down, then up)
        0x3f808001, 0x3f807fff,  # just above / below a tie
        0x7f7fffff,              # the largest float rounds to inf, as in torch
        0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xffc12345,  # inf, -inf, NaNs
        0x00000000, 0x80000000, 0x3f800000, 0xbf800000,
        0x00800000, 0x80800000,  # smallest normals
    ], dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(16 * 20)])
    x = x[:x.numel() // 32 * 32].contiguous()
    want = x.to(torch.bfloat16).view(torch.int16)
    for fn in (probe.to_bf16, probe.to_bf16_pairs):
        out = torch.empty(x.numel(), dtype=torch.int16)
        fn(_ptr(x), _ptr(out), x.numel())
        nan = torch.isnan(x)
        assert torch.equal(out[~nan], want[~nan])
        # NaN stays NaN (payloads may differ)
        assert torch.isnan(out[nan].view(torch.bfloat16)).all()
    out4 = torch.empty(4, dtype=torch.int16)
    probe.to_bf16_x4(_ptr(x), _ptr(out4))
    assert torch.equal(out4, want[:4])


def test_emulated_rounding_keeps_subnormals_as_torch_does(probe):
    if probe.native():
        pytest.skip("vcvtneps2bf16 flushes subnormal inputs to zero; only the emulation matches torch there")
    x = (torch.arange(1, 17, dtype=torch.int32) * 0x1234).view(torch.float32)  # subnormals
    out = torch.empty(16, dtype=torch.int16)
    probe.to_bf16(_ptr(x), _ptr(out), 16)
    assert torch.equal(out, x.to(torch.bfloat16).view(torch.int16))


def test_bf16_pair_dot_products(probe):
    a = torch.randn(32).to(torch.bfloat16)
    b = torch.randn(32).to(torch.bfloat16)
    out = torch.empty(16)
    probe.dot_bf16(_ptr(a), _ptr(b), _ptr(out))
    exact = (a.double() * b.double()).view(16, 2).sum(1)
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-6)


def test_int16_pair_dot_products(probe):
    a = torch.randint(-16383, 16384, (32,), dtype=torch.int16)
    b = torch.randint(-127, 128, (32,), dtype=torch.int16)
    out = torch.empty(16, dtype=torch.int32)
    probe.dot_i16(_ptr(a), _ptr(b), _ptr(out))
    assert torch.equal(out.long(), (a.long() * b.long()).view(16, 2).sum(1) + 7)


# the suites that run every C kernel against its torch twin, and decode graphs end to end
_KERNEL_TESTS = ["ops/test_cpu_gemm.py", "ops/test_linear_int8.py", "ops/test_linear_int4.py", "ops/test_cpu_paged_decode.py",
                 "ops/test_moe_quantized.py", "ops/test_moe_layer_cpu.py",
                 "ops/test_cpu_norm.py", "ops/test_cpu_rotary.py", "ops/test_cpu_activation.py",
                 "ops/test_cpu_kv_write.py", "ops/test_cpu_embedding.py", "ops/test_cpu_graph.py",
                 "ops/test_cpu_simd_bf16.py", "ops/test_cpu_gated_delta.py", "ops/test_cpu_ssm_scan.py",
                 "ops/test_cpu_gating.py", "ops/test_cpu_scored_routing.py", "ops/test_cpu_layer_norm.py",
                 "ops/test_cpu_latent_attention.py",
                 "runner/test_decode_graphs.py"]


def _other_build_reason(isa: str) -> str | None:
    if isa == "avx512" and not build.extensions_used():
        return "this CPU has neither avx512_bf16 nor avx512_vnni: the whole suite runs the emulated build"
    if isa == "avx2" and (build.missing_cpu_flags() or build.missing_cpu_flags("gemm_bf16_avx2.c")):
        return "the AVX2 builds run in the main suite here (no AVX512), or cannot run at all"
    return None


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_every_kernel_in_the_other_builds(isa, tmp_path):
    """On a CPU with the extensions the rest of the suite tests the native build; here the
    kernel suites run once more with TESSERA_CPU_KERNEL_ISA=avx512 (the AVX512F emulation
    that Skylake-to-Ice-Lake CPUs get) and =avx2 (the builds for CPUs without AVX512)."""
    reason = _other_build_reason(isa)
    if reason:
        pytest.skip(reason)
    here = Path(__file__).parent.parent
    env = {**os.environ, build.ISA_ENV: isa, "OMP_NUM_THREADS": "2"}  # threaded paths too (conftest.py)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         *[str(here / name) for name in _KERNEL_TESTS], "-k", "not other_builds"],
        env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


def test_the_isa_switch_drops_the_extensions(monkeypatch):
    monkeypatch.setenv(build.ISA_ENV, "avx512")
    assert build.extensions_used() == ()
    assert "-mavx512bf16" not in build.build_flags() and "-mavx512vnni" not in build.build_flags()
    assert "widened to float32" in build.isa_description()
