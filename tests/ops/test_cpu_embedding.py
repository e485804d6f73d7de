"""The C row gather against F.embedding: byte-identical rows for any dtype and id shape,
an IndexError (nothing written) for an id outside the table, torch for other inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.ops.cpu.build import unavailable_reason
from tessera.ops.cpu.embedding import embedding_cpu
from tessera.ops.registry import OpSpec, select_op

UNAVAILABLE = unavailable_reason("embedding.c")
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5)])
def test_matches_f_embedding(dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    table = (10 * torch.randn(50, 24, generator=g)).to(dtype)
    ids = torch.randint(0, 50, shape, generator=g)
    got = embedding_cpu(ids, table)
    assert got.shape == (*shape, 24) and got.dtype == dtype
    assert torch.equal(got, F.embedding(ids, table))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scaled_embedding_rounds_as_torch(dtype):
    """Gemma's rows times sqrt(hidden) (a bf16-representable scale), in one call: the bits of
    torch's `rows * scale` (float32 product, rounded to the table's dtype)."""
    g = torch.Generator().manual_seed(3)
    table = (10 * torch.randn(50, 24, generator=g)).to(dtype)
    ids = torch.randint(0, 50, (2, 9), generator=g)
    scale = torch.tensor(2304 ** 0.5, dtype=dtype).item()
    got = embedding_cpu(ids, table, scale)
    assert got.dtype == dtype and torch.equal(got, F.embedding(ids, table) * scale)
    assert not torch.equal(got, F.embedding(ids, table))
    with pytest.raises(IndexError):
        embedding_cpu(torch.tensor([3, 50]), table, scale)


@pytest.mark.parametrize("bad", [50, -1])
def test_an_id_outside_the_table_is_an_index_error(bad):
    table = torch.randn(50, 8)
    with pytest.raises(IndexError, match=f"\\[{bad}\\]"):
        embedding_cpu(torch.tensor([3, bad, 4]), table)


def test_other_inputs_go_to_torch_and_the_registry_prefers_the_kernel_on_cpu():
    table = torch.randn(10, 4)
    ids32 = torch.tensor([1, 2], dtype=torch.int32)
    assert torch.equal(embedding_cpu(ids32, table), table[[1, 2]])
    assert select_op(OpSpec("embedding", "cpu", torch.bfloat16)).builder.name == "cpu_embedding"
    assert select_op(OpSpec("embedding", "cuda", torch.bfloat16)).builder.name == "torch_embedding"
