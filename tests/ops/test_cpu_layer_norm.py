"""The CPU LayerNorm kernel (layer_norm.h): Cohere's bias-free norm and the encoders' biased
one in one call, against the float64 value rounded once (what torch's float32 math gives
but for its summation order) and torch's builder to within one unit of the last place; rows
read in place from a strided view; other dtypes to torch; it replays from a kernel graph."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.cpu import build
from tessera.ops.cpu import norm as cpu_norm
from tessera.ops.cpu.graph import capture
from tessera.ops.norm import layer_norm_ref
from tessera.ops.registry import OpSpec, select_op

UNAVAILABLE = "; ".join(cpu_norm._LAYER_NORM.check(None)) or None
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def float64_norm(x, weight, bias, eps):
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    out = (xd - mean) * torch.rsqrt((xd - mean).pow(2).mean(-1, keepdim=True) + eps)
    out = out * (1 if weight is None else weight.double()) + (0 if bias is None else bias.double())
    return out.to(x.dtype)


def within_a_unit(got: torch.Tensor, want: torch.Tensor) -> bool:
    step = 2.0 ** -7 if got.dtype == torch.bfloat16 else 2.0 ** -18
    return bool(((got.double() - want.double()).abs() <= want.double().abs() * step + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias"])
@pytest.mark.parametrize("h", [7, 64, 1000, 4096])
def test_matches_the_torch_builder(dtype, affine, h):
    g = torch.Generator().manual_seed(h + len(affine))
    x = (3 + 2 * torch.randn(9, h, generator=g)).to(dtype)  # an offset mean, as hidden states have
    weight = (1 + 0.3 * torch.randn(h, generator=g)).to(dtype) if affine != "none" else None
    bias = (0.2 * torch.randn(h, generator=g)).to(dtype) if affine == "weight+bias" else None
    got = cpu_norm.layer_norm(x, weight, bias, 1e-5)
    want = layer_norm_ref(x, weight, bias, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    assert within_a_unit(got, want) and within_a_unit(got, float64_norm(x, weight, bias, 1e-5))
    if dtype == torch.bfloat16:  # (float32 results differ in their last bits as the sums' order does)
        assert (got == float64_norm(x, weight, bias, 1e-5)).float().mean() > 0.97


def test_rows_of_a_wider_matrix_and_more_dimensions():
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(5, 300, generator=g).bfloat16()
    x, weight = wide[:, 20:276], torch.randn(256, generator=g).bfloat16()
    assert torch.equal(cpu_norm.layer_norm(x, weight, None, 1e-6), cpu_norm.layer_norm(x.contiguous(), weight, None, 1e-6))
    cube = torch.randn(2, 3, 256, generator=g).bfloat16()
    assert torch.equal(cpu_norm.layer_norm(cube, weight, None, 1e-6),
                       cpu_norm.layer_norm(cube.view(6, 256), weight, None, 1e-6).view(2, 3, 256))


def test_other_dtypes_and_mixed_weights_go_to_torch():
    x = torch.randn(3, 32)
    for args in ((x.half(), None, None), (x.bfloat16(), torch.ones(32), None), (x, torch.ones(16), None)):
        if args[1] is not None and args[1].shape[0] != 32:
            with pytest.raises(RuntimeError):
                cpu_norm.layer_norm(*args, 1e-5)
            continue
        assert torch.equal(cpu_norm.layer_norm(*args, 1e-5), layer_norm_ref(*args, 1e-5))
    for dtype in (torch.bfloat16, torch.float32):
        assert select_op(OpSpec("layer_norm", "cpu", dtype)).builder.name == "cpu_layer_norm"


@torch.inference_mode()
def test_replays_from_a_kernel_graph():
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(4, 128, generator=g).bfloat16(), torch.randn(128, generator=g).bfloat16()
    with capture() as graph:
        out = cpu_norm.layer_norm(x, weight, None, 1e-5)
    assert graph.replayable, graph.refused
    x.copy_(torch.randn(4, 128, generator=g).bfloat16())
    graph.replay()
    assert torch.equal(out, cpu_norm.layer_norm(x, weight, None, 1e-5))


def test_the_isa_setting_picks_the_build():
    want = "layer_norm_avx2.c" if build.missing_cpu_flags() else "layer_norm.c"
    assert cpu_norm._LAYER_NORM.runnable_source() == want
