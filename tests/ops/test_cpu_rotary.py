"""The bf16 rotary kernel against the pure-torch builder: bit-exact (same three roundings),
on q/k that are column slices of a packed QKV output, cos/sin contiguous or row-strided, for head sizes whose half is and is
not a multiple of 16, decode and prefill token counts; other inputs go to torch."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.cpu import rotary as cpu_rotary
from tessera.ops.cpu.rotary import rotary_bf16
from tessera.ops.registry import OpSpec, select_op
from tessera.ops.rotary import rotary_ref

UNAVAILABLE = "; ".join(cpu_rotary._KERNEL.check(None)) or None  # either build; else the registry keeps torch_*
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def rope_rows(tokens: int, d: int, g: torch.Generator,
              gathered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [tokens, 1, d]: contiguous, or (`gathered`) the two halves of one
    (cos, cos, sin, sin) row per token, as RotaryEmbedding hands them out."""
    angles = torch.rand(tokens, d // 2, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    if gathered:
        rows = torch.cat((cos, cos, sin, sin), -1).bfloat16()
        return rows[:, None, :d], rows[:, None, d:]
    return (torch.cat((cos, cos), -1).unsqueeze(1).bfloat16(), torch.cat((sin, sin), -1).unsqueeze(1).bfloat16())


@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("q_heads, k_heads, d", [(9, 3, 64), (4, 2, 128), (3, 1, 48), (2, 2, 6)])
@pytest.mark.parametrize("gathered", [False, True])
def test_bit_exact_to_the_torch_builder(tokens, q_heads, k_heads, d, gathered):
    g = torch.Generator().manual_seed(tokens * 7 + d)
    qkv = (3 * torch.randn(tokens, (q_heads + 2 * k_heads) * d, generator=g)).bfloat16()
    q, k, _ = qkv.split([q_heads * d, k_heads * d, k_heads * d], dim=-1)  # strided views
    cos, sin = rope_rows(tokens, d, g, gathered)
    got_q, got_k = rotary_bf16(q, k, cos, sin, d)
    want_q, want_k = rotary_ref(q, k, cos, sin, d)
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("d, r", [(256, 64), (128, 96), (64, 32), (10, 4)])  # Qwen3.5's quarter, Phi-4-mini's 3/4
def test_partial_rotary_turns_each_head_s_first_dimensions_only(tokens, d, r):
    """full_head: the heads are d wide, their first r dimensions turn (bit-exact to the
    torch builder), the other d - r are copied; the torch builder's partial rows are its
    whole-head rotary of those dimensions."""
    g = torch.Generator().manual_seed(tokens + d + r)
    qkv = (3 * torch.randn(tokens, 7 * d, generator=g)).bfloat16()
    q, k = qkv[:, :4 * d], qkv[:, 4 * d:6 * d]  # strided views, 4 and 2 heads
    cos, sin = rope_rows(tokens, r, g, gathered=True)
    got_q, got_k = rotary_bf16(q, k, cos, sin, r, full_head=d)
    want_q, want_k = rotary_ref(q, k, cos, sin, r, full_head=d)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    for x, got in ((q, got_q), (k, got_k)):
        heads, out = x.reshape(tokens, -1, d), got.view(tokens, -1, d)
        assert torch.equal(out[..., r:], heads[..., r:])
        turned = rotary_ref(heads[..., :r].reshape(tokens, -1), heads[..., :r].reshape(tokens, -1), cos, sin, r)[0]
        assert torch.equal(out[..., :r].reshape(tokens, -1), turned)


@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("d, r", [(128, 64), (64, 64), (10, 6)])  # GLM-4's half, ERNIE's / Cohere 2's whole
def test_interleaved_rotary_turns_neighbouring_pairs(tokens, d, r):
    """GLM-4's, ERNIE's and Cohere 2's form: bit-exact to the torch builder, whose pairs are
    its rotate-half of the evens-then-odds order, turned back."""
    g = torch.Generator().manual_seed(tokens * d + r)
    qkv = (3 * torch.randn(tokens, 7 * d, generator=g)).bfloat16()
    q, k = qkv[:, :4 * d], qkv[:, 4 * d:6 * d]
    cos, sin = rope_rows(tokens, r, g, gathered=True)
    got = rotary_bf16(q, k, cos, sin, r, full_head=d, interleaved=True)
    want = rotary_ref(q, k, cos, sin, r, full_head=d, interleaved=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    order = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))
    heads = q.reshape(tokens, -1, d)
    halves = heads[..., :r].index_select(-1, order).reshape(tokens, -1)
    turned = rotary_ref(halves, halves, cos, sin, r)[0].view(tokens, -1, r).index_select(-1, torch.argsort(order))
    assert torch.equal(got[0].view(tokens, -1, d)[..., :r], turned)
    assert torch.equal(got[0].view(tokens, -1, d)[..., r:], heads[..., r:])


@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_parts_of_wider_heads_are_read_in_place(tokens, interleaved):
    """MLA's queries: each head 24 wide, its last 8 the rotary part, given as a [tokens,
    heads, 8] view (heads 24 apart); its shared rotary key a column slice. The outputs are
    [tokens, heads * 8] rows, bit-exact to torch's."""
    g = torch.Generator().manual_seed(tokens + 40 * interleaved)
    q = (3 * torch.randn(tokens, 4 * 24, generator=g)).bfloat16().view(tokens, 4, 24)
    kv = (3 * torch.randn(tokens, 32 + 8, generator=g)).bfloat16()
    cos, sin = rope_rows(tokens, 8, g, gathered=True)
    got = rotary_bf16(q[..., 16:], kv[:, 32:], cos, sin, 8, interleaved=interleaved)
    want = rotary_ref(q[..., 16:], kv[:, 32:], cos, sin, 8, interleaved=interleaved)
    assert got[0].shape == (tokens, 32) and got[1].shape == (tokens, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_other_inputs_go_to_torch_and_the_registry_prefers_the_kernel_for_bf16():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 128, generator=g), torch.randn(3, 64, generator=g)
    cos, sin = (t.float() for t in rope_rows(3, 64, g))
    for got, want in zip(rotary_bf16(q, k, cos, sin, 64), rotary_ref(q, k, cos, sin, 64)):
        torch.testing.assert_close(got, want)
    assert select_op(OpSpec("rotary", "cpu", torch.bfloat16, head_size=64)).builder.name == "cpu_rotary_bf16"
    assert select_op(OpSpec("rotary", "cpu", torch.float32, head_size=64)).builder.name == "torch_rotary"
