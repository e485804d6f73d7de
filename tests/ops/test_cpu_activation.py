"""The fused bf16 gated-activation kernels (SiLU-and-mul, and Gemma's GELU(tanh)-and-mul
built from the same source) with the same two bf16 roundings as the torch builders (after
the activation, after the product), so outputs agree exactly except where the vectorised
exp's last float32 bits tip a rounding (one bf16 ulp, rarely). GELU is checked against its
float64 value so rounded: torch computes 1 + tanh(y) in float32, which cancels for gates
below about -3 (its results there are off by up to a float32 step of 1, times x / 2); the
kernel's x * sigmoid(2y) has no cancellation."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.activation import gelu_tanh_and_mul_ref, gelu_tanh_mul_ref, silu_and_mul_ref, silu_mul_ref
from tessera.ops.cpu.activation import gelu_tanh_and_mul_bf16, gelu_tanh_mul_bf16, silu_and_mul_bf16, silu_mul_bf16
from tessera.ops.cpu import activation as cpu_activation
from tessera.ops.registry import OpSpec, select_op

UNAVAILABLE = "; ".join(cpu_activation._KERNEL.check(None)) or None  # either build; else the registry keeps torch_*
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def gelu_tanh_and_mul_f64(gate_up: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(gelu_tanh(gate)) * up), the activation computed in float64 as
    x * sigmoid(2y) (= x (1 + tanh(y)) / 2, which cancels to 0 in float64 too below -6)."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    act = gate * torch.sigmoid(2 * 0.7978845608028654 * (gate + 0.044715 * gate ** 3))
    return (act.bfloat16().float() * up.float()).bfloat16()


# op -> (kernel, what its bits follow, torch's builder)
OPS = {"silu": (silu_and_mul_bf16, silu_and_mul_ref, silu_and_mul_ref),
       "gelu_tanh": (gelu_tanh_and_mul_bf16, gelu_tanh_and_mul_f64, gelu_tanh_and_mul_ref)}
both = pytest.mark.parametrize("op", list(OPS))


@both
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (3, 2 * 7), (5, 4, 2 * 48), (300, 2 * 1536)])
def test_matches_the_torch_builder(shape, op):
    kernel, reference, torch_op = OPS[op]
    g = torch.Generator().manual_seed(shape[-1] + shape[0])
    gate_up = (4 * torch.randn(shape, generator=g)).bfloat16()
    got, want = kernel(gate_up), reference(gate_up)
    # torch's op too, within its float32 cancellation (x / 2 times a float32 step of 1)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert ((got.float() - torch_op(gate_up).float()).abs()
            <= torch_op(gate_up).float().abs() * 2.0 ** -7 + (gate * up).abs() * 2.0 ** -24 + 1e-30).all()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2.0 ** -7 + 1e-30).all(), diff.max()
    assert (diff == 0).float().mean() > 0.99


@both
def test_extremes_saturate_like_torch(op):
    kernel, _, reference = OPS[op]
    gate = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, float("inf")]).bfloat16()
    gate_up = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)
    torch.testing.assert_close(kernel(gate_up), reference(gate_up), rtol=0, atol=0)


def test_gelu_is_not_silu():
    gate_up = torch.tensor([[-1.0, 0.5, 2.0, 1.0, 1.0, 1.0]]).bfloat16()
    assert not torch.equal(gelu_tanh_and_mul_bf16(gate_up), silu_and_mul_bf16(gate_up))


@both
def test_every_bf16_gate_value_like_torch(op):
    """All 65536 bf16 patterns as gates (denormals, the exp's clamps, infinities, NaNs), with
    unit and random up values: within one bf16 step of torch, nearly always its bits (denormal
    results may flush to zero), and the same non-finite results."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for up in (torch.ones_like(gate), (3 * torch.randn(gate.shape, generator=g)).bfloat16()):
        gate_up = torch.cat([gate, up]).view(1, -1)
        got, want = OPS[op][0](gate_up)[0].float(), OPS[op][1](gate_up)[0].float()
        finite = torch.isfinite(want)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got[torch.isinf(want)], want[torch.isinf(want)])
        diff = (got[finite] - want[finite]).abs()
        assert (diff <= want[finite].abs() * 2.0 ** -7 + 1e-30).all(), diff.max()
        # a denormal activation (~ gate / 2) or product: exact, or flushed to zero where the
        # CPU's own bf16 conversion runs (vcvtneps2bf16, AVX512-BF16, treats denormals as zero)
        smallest = torch.finfo(torch.float32).tiny
        tiny = finite & ((gate.float().abs() < 2 * smallest) | (want.abs() < smallest))
        assert ((got[tiny] == want[tiny]) | (got[tiny] == 0)).all()
        normal = finite & ~tiny
        assert (got[normal] == want[normal]).float().mean() > 0.999


def test_gelu_of_two_tensors_is_the_packed_kernel_s():
    """Gemma 4's per-layer input gate: gelu(gate) * up with the two as separate tensors (up a
    strided slice of every layer's inputs) is the packed kernel's result bit for bit; other
    shapes or dtypes go to torch."""
    g = torch.Generator().manual_seed(4)
    gate = (4 * torch.randn(5, 40, generator=g)).bfloat16()
    per_layer = (2 * torch.randn(5, 3, 40, generator=g)).bfloat16()
    up = per_layer[:, 1]  # rows 120 apart
    got = gelu_tanh_mul_bf16(gate, up)
    assert torch.equal(got, gelu_tanh_and_mul_bf16(torch.cat((gate, up), dim=-1)))
    assert torch.equal(got, gelu_tanh_and_mul_f64(torch.cat((gate, up), dim=-1)))
    torch.testing.assert_close(got, gelu_tanh_mul_ref(gate, up))
    assert torch.equal(gelu_tanh_mul_bf16(gate.float(), up.float()), gelu_tanh_mul_ref(gate.float(), up.float()))
    assert torch.equal(gelu_tanh_mul_bf16(gate[:, None], up[:, None]), gelu_tanh_mul_ref(gate[:, None], up[:, None]))
    assert select_op(OpSpec("gelu_tanh_mul", "cpu", torch.bfloat16)).builder.name == "cpu_gelu_tanh_mul_bf16"


def test_silu_of_two_tensors_is_the_packed_kernel_s():
    """A Mamba-2 mixer's ungated-norm output, y * silu(z) with z a slice of the projection's
    rows: the packed kernel's result bit for bit, torch's within its rounding."""
    g = torch.Generator().manual_seed(6)
    projection = (4 * torch.randn(3, 100, generator=g)).bfloat16()
    z, y = projection[:, 10:58], (2 * torch.randn(3, 48, generator=g)).bfloat16()
    got = silu_mul_bf16(z, y)
    assert torch.equal(got, silu_and_mul_bf16(torch.cat((z, y), dim=-1)))
    assert torch.equal(got, silu_mul_ref(z, y))
    assert not torch.equal(got, gelu_tanh_mul_bf16(z, y))
    assert select_op(OpSpec("silu_mul", "cpu", torch.bfloat16)).builder.name == "cpu_silu_mul_bf16"


def test_other_dtypes_go_to_torch_and_the_registry_prefers_the_kernel_for_bf16():
    x = torch.randn(2, 10)
    torch.testing.assert_close(silu_and_mul_bf16(x), silu_and_mul_ref(x))
    torch.testing.assert_close(gelu_tanh_and_mul_bf16(x), gelu_tanh_and_mul_ref(x))
    for kind in ("silu_and_mul", "gelu_tanh_and_mul"):
        assert select_op(OpSpec(kind, "cpu", torch.bfloat16)).builder.name == f"cpu_{kind}_bf16"
        assert select_op(OpSpec(kind, "cpu", torch.float32)).builder.name == f"torch_{kind}"
