"""The C grouped quantizers (ops/cpu/quantize_groups.c: int4, and the CPU int8 format) give the
torch versions' bits exactly, for float32 and bf16 weights across magnitudes, float16
subnormal steps and degenerate groups."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.cpu.quantize_groups import _INT4, kernel_runs, quantize_int4_cpu, quantize_int8_cpu
from tessera.ops.linear_int4 import CHUNK_ROWS, _quantize_rows, quantize_int4
from tessera.ops.linear_int8 import _quantize_groups, quantize_int8_groups

pytestmark = pytest.mark.skipif(not kernel_runs(), reason=str(_INT4.check(None)))


def torch_parts(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    parts = [_quantize_rows(weight[i:i + CHUNK_ROWS]) for i in range(0, weight.shape[0], CHUNK_ROWS)]
    return tuple(torch.cat(p) for p in zip(*parts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1.0, 300.0])
def test_the_same_bits_as_torch(dtype, scale):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=g) * scale * torch.exp(2 * torch.randn(96, 1, generator=g))
    w[0, :32] = 0.0                     # a constant group: step 0
    w[1, :32] = -1e-9                   # its minimum rounds up to -0.0, stepped down
    w[2, :32], w[2, 7] = 1e-8, -1e-8    # a range inside float16's subnormals
    w[3, :32] = torch.arange(32) / 31   # codes at every half step
    w[4, :32] = torch.linspace(-65000, 65000, 32)  # near float16's largest
    w = w.clamp(-65000, 65000).to(dtype)  # (what int4_quantizable lets through)
    want, got = torch_parts(w), quantize_int4_cpu(w)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(quantize_int4(w), want))


def test_what_it_does_not_take_goes_to_torch():
    assert quantize_int4_cpu(torch.randn(4, 48)) is None           # k not a multiple of 32
    assert quantize_int4_cpu(torch.randn(4, 64).half()) is None    # float16 weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1.0, 300.0])
def test_int8_the_same_bits_as_torch(dtype, scale):
    g = torch.Generator().manual_seed(8)
    w = torch.randn(96, 256, generator=g) * scale * torch.exp(2 * torch.randn(96, 1, generator=g))
    w[0, :32] = 0.0                                     # a zero group: step 0, codes 0
    w[1, :32] = (torch.arange(-16, 16) * 2 + 1) / 2     # -15.5 .. 15.5: ties, both signs
    w[1, 0] = 127.0                                     # (the step: 1)
    w[2, :32], w[2, 7] = 1e-8, -3e-8                    # tiny weights: steps of ~2e-10
    w[3, :32] = torch.linspace(-8e6, 8e6, 32)           # huge ones
    w[5, 32:64] = 1e-9                                  # a step 1e-5 of its row's: float16 subnormal
    w = w.to(dtype)
    want, got = _quantize_groups(w), quantize_int8_cpu(w)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert all(torch.equal(a, b) for a, b in zip(quantize_int8_groups(w), want))
    assert quantize_int8_cpu(torch.randn(4, 48)) is None
