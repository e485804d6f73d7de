"""The fused bf16 RMSNorm kernel against the pure-torch builder: the residual sum is
bit-exact, the normalised output within one bf16 ulp (float32 summation order), for decode
and prefill row counts, odd widths, with and without the residual, with a bf16 weight and a
float32 one (Gemma's 1 + w: the row is not rounded before it)."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.cpu import norm as cpu_norm
from tessera.ops.norm import rms_norm_ref
from tessera.ops.registry import OpSpec, select_op

UNAVAILABLE = "; ".join(cpu_norm._KERNEL.check(None)) or None  # either build; else the registry keeps torch_*
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("h", [576, 64, 7])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_matches_the_torch_builder(rows, h, with_residual, weight_dtype):
    g = torch.Generator().manual_seed(rows * 100 + h)
    x = (3 * torch.randn(rows, h, generator=g)).bfloat16()
    residual = torch.randn(rows, h, generator=g).bfloat16() if with_residual else None
    weight = (1 + 0.2 * torch.randn(h, generator=g)).to(weight_dtype)
    got, got_res = cpu_norm.rms_norm_bf16(x, weight, 1e-6, residual)
    want, want_res = rms_norm_ref(x, weight, 1e-6, residual)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7 + 1e-6).all()
    # nearly all bit-exact: rounding the row before the weight would part from many
    assert (got == want).float().mean() >= 0.95
    if with_residual:
        assert torch.equal(got_res, want_res)
    else:
        assert got_res is None


@pytest.mark.parametrize("tokens", [1, 2, 5])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_per_head_norm_reads_heads_in_place(tokens, weight_dtype):
    """[tokens, heads, head_dim] viewed on the query columns of a packed QKV output (each
    token's heads contiguous, tokens a row of q + k + v apart): the same as the torch op on
    a copy, and no copy made (a decode graph could not replay one)."""
    g = torch.Generator().manual_seed(tokens)
    qkv = (3 * torch.randn(tokens, (4 + 2 + 2) * 16, generator=g)).bfloat16()
    q = qkv[:, :4 * 16].view(tokens, 4, 16)
    weight = (1 + 0.2 * torch.randn(16, generator=g)).to(weight_dtype)
    got, _ = cpu_norm.rms_norm_bf16(q, weight, 1e-6)
    want, _ = rms_norm_ref(q.contiguous(), weight, 1e-6)
    assert got.shape == (tokens, 4, 16) and got.is_contiguous()
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7 + 1e-6).all()
    assert (got == want).float().mean() >= 0.95
    k = qkv[:, 4 * 16:6 * 16].view(tokens, 2, 16)  # the key heads: another offset into the rows
    torch.testing.assert_close(cpu_norm.rms_norm_bf16(k, weight, 1e-6)[0].float(),
                               rms_norm_ref(k.contiguous(), weight, 1e-6)[0].float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("tokens", [2, 5])
def test_a_whole_projection_norm_reads_its_columns_in_place(tokens):
    """MiniMax-M2's norm over a whole query (or key) projection: [tokens, width] columns of
    the packed QKV rows, normed where they are, as the torch op on a copy; the capture of a
    pass that norms them records the kernel alone (a copy would keep it from replaying)."""
    from tessera.ops.cpu.graph import capture

    g = torch.Generator().manual_seed(tokens)
    qkv = (3 * torch.randn(tokens, 3 * 64, generator=g)).bfloat16()
    weight = (1 + 0.2 * torch.randn(64, generator=g)).bfloat16()
    for part in (qkv[:, :64], qkv[:, 64:128]):
        with capture() as graph:
            got, _ = cpu_norm.rms_norm_bf16(part, weight, 1e-6)
        assert graph.replayable, graph.refused
        want, _ = rms_norm_ref(part.contiguous(), weight, 1e-6)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def test_other_dtypes_and_shapes_go_to_torch():
    x = torch.randn(2, 3, 16)
    w = torch.ones(16)
    got, _ = cpu_norm.rms_norm_bf16(x, w, 1e-6)
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-6)[0])
    xb = torch.randn(2, 3, 16).bfloat16()  # 3-D bf16 runs in the kernel, shape kept
    assert cpu_norm.rms_norm_bf16(xb, w.bfloat16(), 1e-6)[0].shape == (2, 3, 16)


def test_registry_prefers_it_for_bf16_on_cpu():
    assert select_op(OpSpec("rms_norm", "cpu", torch.bfloat16)).builder.name == "cpu_rms_norm_bf16"
    assert select_op(OpSpec("rms_norm", "cpu", torch.float32)).builder.name == "torch_rms_norm"
