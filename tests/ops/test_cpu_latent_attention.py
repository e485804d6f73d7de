"""Multi-head latent attention's CPU ops (latent_attention.h): the per-head products against
torch's einsum (float32 sums, one rounding: within a bf16 unit, nearly always its bits) for
queries read in place from a wider projection and both weight layouts; prefill-sized steps go
to torch; the column concat is torch.cat's bytes; both replay from a kernel graph."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.cpu import build
from tessera.ops.cpu import latent_attention as cpu_mla
from tessera.ops.cpu.graph import capture
from tessera.ops.latent_attention import concat_columns_ref, head_matmul_ref
from tessera.ops.registry import OpSpec, select_op

UNAVAILABLE = "; ".join(cpu_mla._HEAD_MATMUL.check(None)) or None
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def float64_product(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return head_matmul_ref(x.double(), w.double(), transposed).bfloat16()


@pytest.mark.parametrize("tokens", [1, 3, 32])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("heads, k, n", [(4, 16, 40), (16, 128, 512), (3, 37, 9)])
def test_head_products_match_torch(tokens, transposed, heads, k, n):
    g = torch.Generator().manual_seed(tokens + k + n + transposed)
    # the query's first k values of each head, heads k + 8 apart (MLA's nope part)
    x = torch.randn(tokens, heads, k + 8, generator=g).bfloat16()[..., :k]
    w = (0.2 * torch.randn(heads, *((n, k) if transposed else (k, n)), generator=g)).bfloat16()
    got = cpu_mla.head_matmul(x, w, transposed)
    want = float64_product(x, w, transposed)
    assert got.shape == (tokens, heads, n) and got.dtype == torch.bfloat16
    step = want.float().abs() * 2.0 ** -7 + 1e-3
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.97
    torch.testing.assert_close(got, head_matmul_ref(x, w, transposed), rtol=2 ** -7, atol=1e-2)


def test_long_steps_and_other_dtypes_go_to_torch():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 2, 8, generator=g).bfloat16(), torch.randn(2, 8, 5, generator=g).bfloat16()
    assert torch.equal(cpu_mla.head_matmul(x, w), head_matmul_ref(x, w))
    assert torch.equal(cpu_mla.head_matmul(x[:4].float(), w.float()), head_matmul_ref(x[:4].float(), w.float()))
    assert select_op(OpSpec("head_matmul", "cpu", torch.bfloat16)).builder.name == "cpu_head_matmul"
    assert select_op(OpSpec("head_matmul", "cpu", torch.float32)).builder.name == "torch_head_matmul"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_concat_is_torch_cat(dtype):
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(5, 20, generator=g).to(dtype)
    a, b = wide[:, 2:14], torch.randn(5, 6, generator=g).to(dtype)
    assert torch.equal(cpu_mla.concat_columns(a, b), concat_columns_ref(a, b))
    assert torch.equal(cpu_mla.concat_columns(a.t().contiguous().t(), b), concat_columns_ref(a, b))  # (to torch)
    assert select_op(OpSpec("concat_columns", "cpu", dtype)).builder.name == "cpu_concat_columns"


@torch.inference_mode()
def test_they_replay_from_a_kernel_graph():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 24, generator=g).bfloat16()
    w = torch.randn(4, 16, 32, generator=g).bfloat16()
    pe = torch.randn(8, 8, generator=g).bfloat16()

    def step():
        latent = cpu_mla.head_matmul(q[..., :16], w)
        return cpu_mla.concat_columns(latent.view(8, 32), pe)

    with capture() as graph:
        out = step()
    assert graph.replayable, graph.refused
    q.copy_(torch.randn(q.shape, generator=g).bfloat16())
    pe.copy_(torch.randn(pe.shape, generator=g).bfloat16())
    graph.replay()
    assert torch.equal(out, step())


def test_the_isa_setting_picks_the_build():
    want = "latent_attention_avx2.c" if build.missing_cpu_flags() else "latent_attention.c"
    assert cpu_mla._HEAD_MATMUL.runnable_source() == want and cpu_mla._CONCAT.runnable_source() == want
