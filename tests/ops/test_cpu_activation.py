"""The fused bf16 SiLU-and-mul kernel against the pure-torch builder: the same two bf16
roundings (after silu, after the product), so outputs agree exactly except where the
vectorised exp's last float32 bit tips a rounding (one bf16 ulp, rarely)."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.activation import silu_and_mul_ref
from tessera.ops.cpu.activation import silu_and_mul_bf16
from tessera.ops.cpu import activation as cpu_activation
from tessera.ops.registry import OpSpec, select_op

UNAVAILABLE = "; ".join(cpu_activation._KERNEL.check(None)) or None  # either build; else the registry keeps torch_*
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (3, 2 * 7), (5, 4, 2 * 48), (300, 2 * 1536)])
def test_matches_the_torch_builder(shape):
    g = torch.Generator().manual_seed(shape[-1] + shape[0])
    gate_up = (4 * torch.randn(shape, generator=g)).bfloat16()
    got, want = silu_and_mul_bf16(gate_up), silu_and_mul_ref(gate_up)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2.0 ** -7 + 1e-30).all(), diff.max()
    assert (diff == 0).float().mean() > 0.99


def test_extremes_saturate_like_torch():
    gate = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, float("inf")]).bfloat16()
    gate_up = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)
    torch.testing.assert_close(silu_and_mul_bf16(gate_up), silu_and_mul_ref(gate_up), rtol=0, atol=0)


def test_every_bf16_gate_value_like_torch():
    """All 65536 bf16 patterns as gates (denormals, the exp's clamps, infinities, NaNs), with
    unit and random up values: within one bf16 step of torch, nearly always its bits (denormal
    results may flush to zero), and the same non-finite results."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for up in (torch.ones_like(gate), (3 * torch.randn(gate.shape, generator=g)).bfloat16()):
        gate_up = torch.cat([gate, up]).view(1, -1)
        got, want = silu_and_mul_bf16(gate_up)[0].float(), silu_and_mul_ref(gate_up)[0].float()
        finite = torch.isfinite(want)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got[torch.isinf(want)], want[torch.isinf(want)])
        diff = (got[finite] - want[finite]).abs()
        assert (diff <= want[finite].abs() * 2.0 ** -7 + 1e-30).all(), diff.max()
        # a denormal silu(gate) (~ gate / 2) or product: exact, or flushed to zero where the
        # CPU's own bf16 conversion runs (vcvtneps2bf16, AVX512-BF16, treats denormals as zero)
        smallest = torch.finfo(torch.float32).tiny
        tiny = finite & ((gate.float().abs() < 2 * smallest) | (want.abs() < smallest))
        assert ((got[tiny] == want[tiny]) | (got[tiny] == 0)).all()
        normal = finite & ~tiny
        assert (got[normal] == want[normal]).float().mean() > 0.999


def test_other_dtypes_go_to_torch_and_the_registry_prefers_the_kernel_for_bf16():
    x = torch.randn(2, 10)
    torch.testing.assert_close(silu_and_mul_bf16(x), silu_and_mul_ref(x))
    assert select_op(OpSpec("silu_and_mul", "cpu", torch.bfloat16)).builder.name == "cpu_silu_and_mul_bf16"
    assert select_op(OpSpec("silu_and_mul", "cpu", torch.float32)).builder.name == "torch_silu_and_mul"
