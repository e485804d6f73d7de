"""The C kv_write against torch's: byte-identical caches for strided views of a packed
projection, float32 and bf16, with padded (-1) slots skipped; a slot past the cache is an
IndexError that writes nothing."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.attention.torch_paged import kv_write_ref
from tessera.ops.cpu.build import unavailable_reason
from tessera.ops.cpu.kv_write import kv_write_cpu
from tessera.ops.registry import OpSpec, select_op

UNAVAILABLE = unavailable_reason("kv_write.c")
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_matches_torch_kv_write(dtype, padded):
    g = torch.Generator().manual_seed(int(padded))
    tokens, heads, d, blocks, block_size = 7, 3, 16, 5, 4
    qkv = torch.randn(tokens, (4 + 2 * heads) * d, generator=g).to(dtype)
    k = qkv[:, 4 * d:(4 + heads) * d].view(tokens, heads, d)      # strided views
    v = qkv[:, (4 + heads) * d:].view(tokens, heads, d)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    if padded:
        slots[[1, 4]] = -1
    caches = [torch.zeros(blocks, block_size, heads, d, dtype=dtype) for _ in range(4)]
    kv_write_cpu(k, v, caches[0], caches[1], slots, padded)
    kv_write_ref(k, v, caches[2], caches[3], slots, padded)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].count_nonzero() == (tokens - 2 * padded) * heads * d


def test_registry_prefers_it_on_cpu():
    assert select_op(OpSpec("kv_write", "cpu", torch.bfloat16, head_size=64)).builder.name == "cpu_kv_write"
    assert select_op(OpSpec("kv_write", "cuda", torch.bfloat16, head_size=64)).builder.name != "cpu_kv_write"


def test_a_slot_past_the_cache_writes_nothing():
    k = torch.ones(2, 1, 4)
    caches = [torch.zeros(2, 2, 1, 4) for _ in range(2)]
    with pytest.raises(IndexError, match="4 slots"):
        kv_write_cpu(k, k, caches[0], caches[1], torch.tensor([1, 4]))
    assert caches[0].count_nonzero() == 0 and caches[1].count_nonzero() == 0
