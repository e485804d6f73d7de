"""The hybrid models' elementwise kernels (gating.h) against their torch builders: the Gated
DeltaNet's g and beta, the gated RMSNorms, the sigmoid output gate, relu squared and
Granite's scaled sums, in bf16 and float32,
read from strided views as the layers pass them. exp is a polynomial within 2e-7 of torch's,
so bf16 results may sit one unit off where the float32 value is on a rounding edge: the
tests allow that for a small share of values and nothing more. Other forms run the torch
builders; a step of the three is captured and replayed. The suite runs again in the AVX2
build where this CPU would pick the AVX512 one."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.activation import relu_squared_ref, sigmoid_gate_mul_ref, sum_and_scale_ref
from tessera.ops.cpu import build
from tessera.ops.cpu import gating
from tessera.ops.cpu.graph import capture
from tessera.ops.linear_attention.delta_rule import delta_rule_gates_ref
from tessera.ops.norm import gated_rms_norm_ref
from tessera.ops.registry import OpSpec, select_op

UNAVAILABLE = "; ".join(gating._GATES.check(None)) or None
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
DTYPES = [torch.float32, torch.bfloat16]


def assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: to a few ulps. bf16: equal but for one-unit steps on under 2% of values."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-7)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)  # one bf16 unit
    assert (got != want).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads", [(1, 16), (5, 32), (3, 3)])
def test_delta_gates_are_the_torch_builder_s(dtype, tokens, heads):
    """a, b as column slices of the packed [b | a] projection; a + dt_bias past softplus's
    threshold of 20 on some heads."""
    gen = torch.Generator().manual_seed(tokens * heads)
    ba = (4 * torch.randn(tokens, 2 * heads + 3, generator=gen)).to(dtype)
    b, a = ba[:, :heads], ba[:, heads:2 * heads]
    a_log = torch.randn(heads, generator=gen).to(dtype)
    dt_bias = torch.randn(heads, generator=gen).to(dtype)
    dt_bias[::3] = 21.0
    g, beta = gating.delta_rule_gates(a, b, a_log, dt_bias)
    want_g, want_beta = delta_rule_gates_ref(a, b, a_log, dt_bias)
    torch.testing.assert_close(g, want_g, rtol=3e-6, atol=1e-7)  # libm's exp / log1p against torch's
    if dtype == torch.bfloat16:  # sigmoid rounded to bf16: at most a unit off on an edge
        torch.testing.assert_close(beta, want_beta, rtol=2 ** -8, atol=0)
    else:
        torch.testing.assert_close(beta, want_beta, rtol=3e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,d", [(1, 16, 128), (4, 8, 64), (2, 3, 40), (33, 4, 128)])
def test_gated_rms_norm_is_the_torch_builder_s(dtype, tokens, heads, d):
    """x as the delta rule leaves it ([T, H, D]), the gate a view of the packed qkvz rows."""
    gen = torch.Generator().manual_seed(tokens + heads + d)
    x = (3 * torch.randn(tokens, heads, d, generator=gen)).to(dtype)
    packed = torch.randn(tokens, heads * d + 11, generator=gen).to(dtype)
    gate = packed[:, 5:5 + heads * d].view(tokens, heads, d)
    weight = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
    assert_near(gating.gated_rms_norm(x, gate, weight, 1e-6), gated_rms_norm_ref(x, gate, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_first,groups", [(True, 1), (True, 4), (False, 2), (False, 1)])
def test_mamba2_s_gated_rms_norm_forms_are_the_torch_builder_s(dtype, gate_first, groups):
    """Mamba-2's: y [T, inner] from the scan, z a column slice of the packed projection, a
    weight per channel; gate first (Granite 4.0-H, Bamba, Nemotron-H) or norm first per
    group (Falcon-H1), one group or several."""
    gen = torch.Generator().manual_seed(groups + 10 * gate_first)
    tokens, inner = 3, 256
    y = (2 * torch.randn(tokens, inner, generator=gen)).to(dtype)
    z = torch.randn(tokens, inner + 9, generator=gen).to(dtype)[:, 4:4 + inner]
    weight = (1 + 0.3 * torch.randn(inner, generator=gen)).to(dtype)
    group = inner // groups
    assert_near(gating.gated_rms_norm(y, z, weight, 1e-5, gate_first, group),
                gated_rms_norm_ref(y, z, weight, 1e-5, gate_first, group))


def test_gated_rms_norm_of_shapes_it_does_not_take_runs_the_torch_builder():
    """Groups past the kernel's buffers, or a gate whose token rows are not adjacent: the
    torch builder's results exactly."""
    gen = torch.Generator().manual_seed(0)
    x, gate = torch.randn(2, 2048, generator=gen).bfloat16(), torch.randn(2, 2048, generator=gen).bfloat16()
    weight = torch.randn(2048, generator=gen).bfloat16()
    assert torch.equal(gating.gated_rms_norm(x, gate, weight, 1e-5, True, 2048),
                       gated_rms_norm_ref(x, gate, weight, 1e-5, True, 2048))
    strided = torch.randn(2, 2, 64, generator=gen).bfloat16().transpose(1, 2)  # heads not adjacent
    x3 = torch.randn(2, 64, 2, generator=gen).bfloat16()
    assert torch.equal(gating.gated_rms_norm(x3, strided, torch.ones(2).bfloat16(), 1e-5),
                       gated_rms_norm_ref(x3, strided, torch.ones(2).bfloat16(), 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 2048), (6, 1100), (3, 7)])
@pytest.mark.parametrize("per_row,with_add", [(False, False), (True, True), (True, False)])
def test_sigmoid_gate_mul_is_the_torch_builder_s(dtype, rows, cols, per_row, with_add):
    """The attention output gate (a gate per column, from a strided slice of the q / gate
    projection) and the shared expert's (one per row, plus the routed experts' sum)."""
    gen = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=gen).to(dtype)
    packed = (4 * torch.randn(rows, 2 * cols + 1, generator=gen)).to(dtype)
    gate = packed[:, -1:] if per_row else packed[:, cols:2 * cols]
    add = torch.randn(rows, cols, generator=gen).to(dtype) if with_add else None
    assert_near(gating.sigmoid_gate_mul(x, gate, add), sigmoid_gate_mul_ref(x, gate, add))


def test_sigmoid_of_every_bf16_gate_is_torch_s_but_on_rounding_edges():
    """x = 1: the rounded sigmoid itself, over all 65536 bf16 patterns."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)[None]
    x = torch.ones_like(gate)
    got, want = gating.sigmoid_gate_mul(x, gate), sigmoid_gate_mul_ref(x, gate)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    torch.testing.assert_close(got[~nan].float(), want[~nan].float(), rtol=2 ** -8, atol=0)
    assert (got[~nan] != want[~nan]).float().mean().item() < 0.002


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_squared_is_the_torch_builder_s(dtype):
    """Every bf16 pattern (NaN stays NaN), and a float32 row, bit for bit."""
    x = (torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)[None] if dtype == torch.bfloat16
         else 10 * torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)))
    got, want = gating.relu_squared(x), relu_squared_ref(x)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_other,scale", [(False, 0.22), (True, 0.22), (True, 1.0), (False, 1.0)])
def test_sum_and_scale_is_the_torch_builder_s(dtype, with_other, scale):
    """Granite's residual multiplier on a sublayer's output, its experts' and shared MLP's
    sum first: bit for bit, x read from a strided view."""
    gen = torch.Generator().manual_seed(int(with_other) + int(100 * scale))
    x = (5 * torch.randn(7, 1030, generator=gen)).to(dtype)[:, 3:1027]
    other = (5 * torch.randn(7, 1024, generator=gen)).to(dtype) if with_other else None
    assert torch.equal(gating.sum_and_scale(x, other, scale), sum_and_scale_ref(x, other, scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_other", [False, True])
def test_row_and_column_scales_are_the_torch_builder_s(dtype, with_other):
    """A [T, 1] scale (Llama 4's query temperature, one a position) or an [N] one: each row
    or column times its own, bit for bit; a scale tensor of another dtype goes to torch,
    still right."""
    gen = torch.Generator().manual_seed(9 + int(with_other))
    x = (5 * torch.randn(6, 520, generator=gen)).to(dtype)[:, 4:516]
    other = (5 * torch.randn(6, 512, generator=gen)).to(dtype) if with_other else None
    scales = (1 + 0.1 * torch.log1p(torch.arange(6.0) * 3)).to(dtype)[:, None]
    assert torch.equal(gating.sum_and_scale(x, other, scales), sum_and_scale_ref(x, other, scales))
    assert not torch.equal(gating.sum_and_scale(x, other, scales), sum_and_scale_ref(x, other, 1.0))
    columns = (0.5 + torch.rand(512, generator=gen)).to(dtype)  # one a column (Falcon-H1's muP vectors)
    assert torch.equal(gating.sum_and_scale(x, other, columns), sum_and_scale_ref(x, other, columns))
    assert not torch.equal(gating.sum_and_scale(x, other, columns), sum_and_scale_ref(x, other, 1.0))
    wide = scales.double()
    assert torch.equal(gating.sum_and_scale(x, other, wide), sum_and_scale_ref(x, other, wide))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_registry_picks_the_kernels(dtype):
    for kind in ("delta_rule_gates", "gated_rms_norm", "sigmoid_gate_mul", "relu_squared", "sum_and_scale"):
        assert select_op(OpSpec(kind, "cpu", dtype)).builder.name == f"cpu_{kind}"


@torch.inference_mode()
def test_the_gates_replay_from_a_kernel_graph():
    gen = torch.Generator().manual_seed(3)
    ba, x = torch.randn(2, 8, generator=gen).bfloat16(), torch.randn(2, 4, 16, generator=gen).bfloat16()
    z, a_log, dt = torch.randn(2, 64, generator=gen).bfloat16(), torch.randn(4).bfloat16(), torch.randn(4).bfloat16()
    weight = torch.randn(16, generator=gen).bfloat16()

    def step(gates, norm, gate_mul):
        g, beta = gates(ba[:, 4:], ba[:, :4], a_log, dt)
        normed = norm(x, z.view(2, 4, 16), weight, 1e-6)
        return g, beta, gate_mul(normed.view(2, 64), z)

    with capture() as graph:
        outs = step(gating.delta_rule_gates, gating.gated_rms_norm, gating.sigmoid_gate_mul)
    assert graph.replayable, graph.refused
    for t in (ba, x, z):
        t.copy_(torch.randn(t.shape, generator=gen).bfloat16())
    graph.replay()
    for got, want in zip(outs, step(gating.delta_rule_gates, gating.gated_rms_norm, gating.sigmoid_gate_mul)):
        assert torch.equal(got, want)


def test_the_isa_setting_picks_the_build():
    want = "gating_avx2.c" if build.missing_cpu_flags() else "gating.c"
    assert all(k.runnable_source() == want for k in (gating._GATES, gating._NORM, gating._SIGMOID,
                                                     gating._RELU_SQUARED, gating._SUM_AND_SCALE))
