"""The Gated DeltaNet decode kernels (gated_delta.h) against their torch builders: the delta
rule to float32 rounding (its sums run in another order), the conv1d + SiLU bit-exact in
bf16; states updated in place at the given slots only; q, k, v and x read as strided views;
a step of both kernels captured and replayed. The suite runs again in the AVX2 build where
this CPU would pick the AVX512 one."""
from __future__ import annotations


import pytest
import torch

from tessera.ops.cpu import build
from tessera.ops.cpu import gated_delta as cpu_gd
from tessera.ops.cpu.graph import capture
from tessera.ops.linear_attention.conv import causal_conv1d_decode_ref, short_conv_decode_ref
from tessera.ops.linear_attention.delta_rule import gated_delta_decode_ref
from tessera.ops.registry import OpSpec, select_op
from tests.ops.state_slots import check_steps_on_scattered_slots

UNAVAILABLE = "; ".join(cpu_gd._RULE.check(None)) or None  # either build; else the registry keeps torch_*
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
DTYPES = [torch.float32, torch.bfloat16]


def _qkv(b, hk, hv, dk, dv, dtype, gen):
    """q, k, v as the layer passes them: [B, H, D] views of one packed row (with a gap)."""
    packed = torch.randn(b, 2 * hk * dk + hv * dv + 5, generator=gen).to(dtype)
    q = packed[:, :hk * dk].view(b, hk, dk)
    k = (3 * packed[:, hk * dk:2 * hk * dk]).view(b, hk, dk)  # unnormalised: the kernel's L2 norm counts
    v = packed[:, 2 * hk * dk:2 * hk * dk + hv * dv].view(b, hv, dv)
    return q, k, v


def _assert_close_out(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:  # one rounding of a float32 that differs in its last bits
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7 + 1e-6).all()
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 6), (1, 3)])
@pytest.mark.parametrize("b", [1, 3, 9])
@pytest.mark.parametrize("dk,dv", [(64, 64), (40, 203), (128, 24)])  # partial tiles, vectors, lanes
def test_delta_rule_matches_the_torch_builder(dtype, hk, hv, b, dk, dv):
    gen = torch.Generator().manual_seed(b * 1000 + hv * 100 + dv)
    state = 0.1 * torch.randn(2 * b + 3, hv, dk, dv, generator=gen)

    def step(state, want_state, slots):
        q, k, v = _qkv(b, hk, hv, dk, dv, dtype, gen)
        g = -torch.rand(b, hv, generator=gen) * 2
        beta = torch.rand(b, hv, generator=gen)
        got = cpu_gd.gated_delta_decode(q, k, v, g, beta, state, slots)
        _assert_close_out(got, gated_delta_decode_ref(q, k, v, g, beta, want_state, slots))

    check_steps_on_scattered_slots(state, b, gen, step, rtol=1e-5, atol=1e-6)


def test_delta_rule_copies_views_it_cannot_read_in_place():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 64, 4, generator=gen).transpose(1, 2)  # [B, H, D], head dim strided
    k = torch.randn(2, 64, 4, generator=gen).transpose(1, 2)
    v = torch.randn(4, 2, 32, generator=gen).transpose(0, 1)  # rows not heads-contiguous
    g, beta = -torch.rand(2, 4, generator=gen), torch.rand(2, 4, generator=gen)
    state = torch.randn(3, 4, 64, 32, generator=gen)
    want_state = state.clone()
    slots = torch.tensor([2, 0])
    got = cpu_gd.gated_delta_decode(q, k, v, g, beta, state, slots)
    _assert_close_out(got, gated_delta_decode_ref(q, k, v, g, beta, want_state, slots))
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)


def test_delta_rule_heads_past_the_kernel_s_buffers_run_the_torch_builder():
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(2, 1, 2, 1100, 16, torch.float32, gen)  # Dk > GD_MAX_DIM
    g, beta = -torch.rand(2, 2, generator=gen), torch.rand(2, 2, generator=gen)
    state = torch.randn(2, 2, 1100, 16, generator=gen)
    want_state = state.clone()
    slots = torch.tensor([1, 0])
    got = cpu_gd.gated_delta_decode(q, k, v, g, beta, state, slots)
    assert torch.equal(got, gated_delta_decode_ref(q, k, v, g, beta, want_state, slots))
    assert torch.equal(state, want_state)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("b,channels", [(1, 6144), (5, 700), (3, 9)])
def test_conv_matches_the_torch_builder(dtype, width, with_bias, b, channels):
    gen = torch.Generator().manual_seed(b * 100 + width)
    num_slots = b + 4
    x = torch.randn(b, channels + 13, generator=gen).to(dtype)[:, 5:5 + channels]  # a strided view
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if with_bias else None
    state = torch.randn(num_slots, channels, width - 1, generator=gen).to(dtype)
    want_state = state.clone()
    slots = torch.randperm(num_slots, generator=gen)[:b]
    got = cpu_gd.causal_conv1d_decode(x, weight, bias, state, slots)
    want = causal_conv1d_decode_ref(x, weight, bias, want_state, slots)
    assert torch.equal(state, want_state)  # the shifted windows, and every other slot as it was
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # the sum is torch's; SiLU's exp is a polynomial, not torch's
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("b,channels", [(1, 1024), (4, 700), (3, 9)])
def test_gated_short_conv_is_the_torch_builder_s(dtype, width, with_bias, b, channels):
    """LFM2's operator (3 taps): C * conv(B x) bit for bit (to 4 taps: torch sums more in
    another order), the states shifted at the given slots only, B, C and x read from a
    strided view of the packed projection."""
    gen = torch.Generator().manual_seed(b * 10 + width)
    num_slots = b + 3
    bcx = torch.randn(b, 3 * channels + 7, generator=gen).to(dtype)[:, 2:2 + 3 * channels]
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    bias = torch.randn(channels, generator=gen).to(dtype) if with_bias else None
    state = torch.randn(num_slots, channels, width - 1, generator=gen).to(dtype)

    def step(state, want_state, slots):
        got = cpu_gd.gated_short_conv_decode(bcx, weight, bias, state, slots)
        assert torch.equal(got, short_conv_decode_ref(bcx, weight, bias, want_state, slots))
        bcx.copy_(torch.randn(bcx.shape, generator=gen).to(dtype))

    check_steps_on_scattered_slots(state, b, gen, step, rtol=0, atol=0)


def test_gated_short_conv_of_shapes_it_does_not_take_runs_the_torch_builder():
    """Rows that are not three times the channels, or a state of another dtype."""
    weight, state, slots = torch.randn(4, 3).bfloat16(), torch.zeros(2, 4, 2).bfloat16(), torch.tensor([1])
    with pytest.raises(RuntimeError):  # the reference's own error: 10 columns are not 3 x 4
        cpu_gd.gated_short_conv_decode(torch.randn(1, 10).bfloat16(), weight, None, state, slots)
    bcx = torch.randn(1, 12).bfloat16()
    want_state = state.float()
    got = cpu_gd.gated_short_conv_decode(bcx, weight, None, state.float(), slots)
    assert torch.equal(got, short_conv_decode_ref(bcx, weight, None, want_state, slots))


def test_conv_silu_is_torch_s_for_every_bf16_value():
    """Weights (0, 1) pass x through unchanged: SiLU of all 65536 bf16 patterns."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)[None]
    weight = torch.tensor([[0.0, 1.0]]).bfloat16().expand(65536, 2).contiguous()
    state = torch.zeros(1, 65536, 1, dtype=torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.int64)
    got = cpu_gd.causal_conv1d_decode(x, weight, None, state.clone(), slots)
    want = causal_conv1d_decode_ref(x, weight, None, state.clone(), slots)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_registry_picks_the_kernels(dtype):
    for kind, name in (("gated_delta_rule", "cpu_gated_delta_decode"), ("causal_conv1d", "cpu_causal_conv1d_decode"),
                       ("short_conv", "cpu_gated_short_conv_decode")):
        assert select_op(OpSpec(kind, "cpu", dtype, phase="decode")).builder.name == name
        assert select_op(OpSpec(kind, "cpu", dtype, phase="prefill")).builder.name.startswith("torch_")


@torch.inference_mode()
def test_a_decode_step_replays_from_a_kernel_graph():
    gen = torch.Generator().manual_seed(2)
    b, hk, hv, d, width = 2, 2, 4, 32, 4
    channels = 2 * hk * d + hv * d
    mixed = torch.randn(b, channels, generator=gen).bfloat16()
    weight = torch.randn(channels, width, generator=gen).bfloat16()
    conv_state = torch.randn(4, channels, width - 1, generator=gen).bfloat16()
    state = 0.1 * torch.randn(4, hv, d, d, generator=gen)
    g, beta = -torch.rand(b, hv, generator=gen), torch.rand(b, hv, generator=gen)
    slots = torch.tensor([3, 1])

    def step(conv_fn, rule_fn, cs, s):
        x = conv_fn(mixed, weight, None, cs, slots)
        q, k, v = (t.view(b, -1, d) for t in x.split([hk * d, hk * d, hv * d], dim=-1))
        return rule_fn(q, k, v, g, beta, s, slots)

    want_cs, want_state = conv_state.clone(), state.clone()
    with capture() as graph:
        out = step(cpu_gd.causal_conv1d_decode, cpu_gd.gated_delta_decode, conv_state, state)
    assert graph.replayable, graph.refused
    step(causal_conv1d_decode_ref, gated_delta_decode_ref, want_cs, want_state)
    mixed.copy_(torch.randn(b, channels, generator=gen).bfloat16())
    graph.replay()  # the second step, from the states the first left
    want = step(causal_conv1d_decode_ref, gated_delta_decode_ref, want_cs, want_state)
    _assert_close_out(out, want)
    assert torch.equal(conv_state, want_cs)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)


def test_the_isa_setting_picks_the_build():
    want = "gated_delta_avx2.c" if build.missing_cpu_flags() else "gated_delta.c"
    assert all(kernel.runnable_source() == want for kernel in (cpu_gd._RULE, cpu_gd._CONV, cpu_gd._SHORT_CONV))
