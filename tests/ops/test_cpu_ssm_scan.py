"""The Mamba-2 decode scan kernel (ssm_scan.h) against its torch builder: states to float32
rounding (bit-exact wherever libm's step and decay equal torch's) and updated in place at
the given slots only; outputs to float32 rounding (the dot over d_state runs in another
order), in bf16 within one rounding; x, B, C read as column slices of the conv's output; a
step captured and replayed. The suite runs again in the AVX2 build where this CPU would
pick the AVX512 one."""
from __future__ import annotations

import math

import pytest
import torch

from tessera.ops.cpu import build
from tessera.ops.cpu import ssm_scan as cpu_ssm
from tessera.ops.cpu.graph import capture
from tessera.ops.linear_attention.mamba2 import ssm_scan_decode_ref
from tessera.ops.registry import OpSpec, select_op
from tests.ops.state_slots import check_steps_on_scattered_slots

UNAVAILABLE = "; ".join(cpu_ssm._SCAN.check(None)) or None  # either build; else the registry keeps torch_*
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))
DTYPES = [torch.float32, torch.bfloat16]
NO_LIMIT = (0.0, math.inf)


def _inputs(b, h, p, n, g, dtype, gen):
    """The op's arguments but the state, as Mamba2Scan passes them: x, B, C column slices of
    one conv row (with a gap), dt a column slice of the projection's."""
    conv = torch.randn(b, h * p + 2 * g * n + 5, generator=gen).to(dtype)
    x = conv[:, :h * p].view(b, h, p)
    B = conv[:, h * p:h * p + g * n].view(b, g, n)
    C = conv[:, h * p + g * n:h * p + 2 * g * n].view(b, g, n)
    dt = (2 * torch.randn(b, h + 3, generator=gen)).to(dtype)[:, 2:2 + h]
    dt_bias = torch.randn(h, generator=gen).to(dtype)
    A = -torch.rand(h, generator=gen) * 4  # float32, as the mixer passes -exp(A_log)
    D = torch.randn(h, generator=gen).to(dtype)
    return x, dt, dt_bias, A, B, C, D


def _assert_close_out(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:  # one rounding of a float32 that differs in its last bits
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7 + 1e-6).all()
    else:  # sums of 128 products of O(1) terms, in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,g", [(4, 1), (6, 3), (8, 2)])
@pytest.mark.parametrize("b", [1, 3, 9])
@pytest.mark.parametrize("p,n", [(64, 128), (5, 37), (16, 8)])  # partial row groups, vectors, lanes
@pytest.mark.parametrize("limits", [NO_LIMIT, (0.05, 0.6)])  # the second clamps both ways
def test_scan_matches_the_torch_builder(dtype, h, g, b, p, n, limits):
    gen = torch.Generator().manual_seed(b * 1000 + h * 100 + n + p)
    state = 0.5 * torch.randn(2 * b + 3, h, p, n, generator=gen)

    def step(state, want_state, slots):
        args = _inputs(b, h, p, n, g, dtype, gen)
        got = cpu_ssm.ssm_scan_decode(*args, limits, state, slots)
        _assert_close_out(got, ssm_scan_decode_ref(*args, limits, want_state, slots))

    check_steps_on_scattered_slots(state, b, gen, step, rtol=1e-6, atol=1e-6)


def test_the_limits_clamp_the_time_step():
    """dt far below and above the limits: the step is lo or hi exactly (a write of lo x B and
    a decay of exp(hi A) on a zero or identity-free state)."""
    gen = torch.Generator().manual_seed(5)
    x, _, _, A, B, C, D = _inputs(2, 4, 8, 16, 1, torch.float32, gen)
    dt = torch.tensor([[-30.0, 30.0, -30.0, 30.0], [30.0, -30.0, 30.0, -30.0]])
    dt_bias = torch.zeros(4)
    lo, hi = 0.25, 2.0
    state = torch.zeros(2, 4, 8, 16)
    cpu_ssm.ssm_scan_decode(x, dt, dt_bias, A, B, C, D, (lo, hi), state, torch.tensor([0, 1]))
    step = torch.where(dt > 0, hi, lo)
    want = (step[..., None] * x)[..., None] * B[:, :, None, :]  # one group: every head's B is B[:, 0]
    assert torch.equal(state, want)


def test_mixed_parameter_dtypes_and_copied_views():
    """float32 dt_bias and D with bf16 activations; x with its head dim strided (copied)."""
    gen = torch.Generator().manual_seed(7)
    x, dt, dt_bias, A, B, C, D = _inputs(3, 4, 16, 32, 2, torch.bfloat16, gen)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)
    dt_bias, D = dt_bias.float(), D.float()
    state = torch.randn(4, 4, 16, 32, generator=gen)
    want_state = state.clone()
    slots = torch.tensor([3, 0, 2])
    got = cpu_ssm.ssm_scan_decode(x, dt, dt_bias, A, B, C, D, NO_LIMIT, state, slots)
    _assert_close_out(got, ssm_scan_decode_ref(x, dt, dt_bias, A, B, C, D, NO_LIMIT, want_state, slots))
    torch.testing.assert_close(state, want_state, rtol=1e-6, atol=1e-6)


def test_d_state_past_the_kernel_s_buffers_runs_the_torch_builder():
    gen = torch.Generator().manual_seed(3)
    args = _inputs(2, 2, 4, 1100, 1, torch.float32, gen)  # N > SSM_MAX_STATE
    state = torch.randn(2, 2, 4, 1100, generator=gen)
    want_state = state.clone()
    slots = torch.tensor([1, 0])
    got = cpu_ssm.ssm_scan_decode(*args, NO_LIMIT, state, slots)
    assert torch.equal(got, ssm_scan_decode_ref(*args, NO_LIMIT, want_state, slots))
    assert torch.equal(state, want_state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_registry_picks_the_kernel(dtype):
    assert select_op(OpSpec("ssm_scan", "cpu", dtype, phase="decode")).builder.name == "cpu_ssm_scan_decode"
    assert select_op(OpSpec("ssm_scan", "cpu", dtype, phase="prefill")).builder.name == "torch_ssm_scan_prefill"


@torch.inference_mode()
def test_a_decode_step_replays_from_a_kernel_graph():
    gen = torch.Generator().manual_seed(2)
    x, dt, dt_bias, A, B, C, D = _inputs(2, 8, 32, 64, 2, torch.bfloat16, gen)
    state = 0.5 * torch.randn(4, 8, 32, 64, generator=gen)
    want_state = state.clone()
    slots = torch.tensor([3, 1])
    with capture() as graph:
        out = cpu_ssm.ssm_scan_decode(x, dt, dt_bias, A, B, C, D, NO_LIMIT, state, slots)
    assert graph.replayable, graph.refused
    ssm_scan_decode_ref(x, dt, dt_bias, A, B, C, D, NO_LIMIT, want_state, slots)
    fresh = _inputs(2, 8, 32, 64, 2, torch.bfloat16, gen)
    for view, new in zip((x, dt, B, C), (fresh[0], fresh[1], fresh[4], fresh[5])):
        view.copy_(new)
    graph.replay()  # the second step, from the state the first left
    want = ssm_scan_decode_ref(x, dt, dt_bias, A, B, C, D, NO_LIMIT, want_state, slots)
    _assert_close_out(out, want)
    torch.testing.assert_close(state, want_state, rtol=1e-6, atol=1e-6)


def test_the_isa_setting_picks_the_build():
    want = "ssm_scan_avx2.c" if build.missing_cpu_flags() else "ssm_scan.c"
    assert cpu_ssm._SCAN.runnable_source() == want
