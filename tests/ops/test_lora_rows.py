"""`lora_rows`: the CPU kernel against the torch reference (each row's own adapter slot,
base rows untouched, ranks shorter than the capacity), and a captured kernel graph that
replays it with the slots changed in place (how decode graphs serve adapter steps)."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.cpu.build import unavailable_reason
from tessera.ops.cpu.graph import capture
from tessera.ops.cpu.lora_rows import lora_rows_bf16
from tessera.ops.lora_rows import lora_rows_ref

UNAVAILABLE = unavailable_reason("lora_rows_avx2.c")
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def factors(slots: int, capacity: int, k: int, n: int, ranks: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(slots, capacity, k, generator=g) * 0.2).bfloat16()
    b_t = (torch.randn(slots, capacity, n, generator=g) * 0.2).bfloat16()
    for s, r in enumerate(ranks):  # past its rank a slot holds zeros (LayerLoRA.load)
        a[s, r:] = 0
        b_t[s, r:] = 0
    return a, b_t, torch.tensor(ranks, dtype=torch.int32)


@pytest.mark.parametrize("rows,k,n,capacity", [(1, 64, 96, 16), (7, 576, 960, 48), (32, 128, 1100, 32),
                                             (3, 5000, 40, 16)])  # a row wider than the stack buffer
def test_kernel_equals_the_reference(rows, k, n, capacity):
    a, b_t, ranks = factors(3, capacity, k, n, [capacity, capacity // 2, 16])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, k, generator=g).bfloat16()
    out = torch.randn(rows, n, generator=g).bfloat16()
    row_slots = torch.tensor([(r + 1) % 4 - 1 for r in range(rows)], dtype=torch.int32)  # 0, 1, 2, -1, ...
    want, got = out.clone(), out.clone()
    lora_rows_ref(x, want, row_slots, ranks, a, b_t)
    lora_rows_bf16(x, got, row_slots, ranks, a, b_t)
    # same rounding steps; sums in another order: a bf16 ulp here and there
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    base = row_slots < 0
    assert torch.equal(got[base], out[base])
    assert not torch.equal(got[~base], out[~base])


def test_a_graph_replays_it_with_new_slots():
    a, b_t, ranks = factors(2, 16, 64, 48, [16, 8])
    x = torch.randn(4, 64).bfloat16()
    start = torch.randn(4, 48).bfloat16()
    out = start.clone()
    row_slots = torch.tensor([0, 0, -1, 1], dtype=torch.int32)
    with capture() as graph:
        lora_rows_bf16(x, out, row_slots, ranks, a, b_t)
    assert graph.replayable and [k.symbol for k, _ in graph.calls] == ["tessera_lora_rows_bf16"]
    row_slots.copy_(torch.tensor([1, -1, 0, -1], dtype=torch.int32))
    out.copy_(start)
    graph.replay()
    want = start.clone()
    lora_rows_ref(x, want, row_slots, ranks, a, b_t)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(out[1], start[1]) and torch.equal(out[3], start[3])


def test_the_reference_keeps_each_slot_to_its_own_rows():
    """The reference runs every row through every slot's A: an overflow in one slot (inf,
    whose product with a zero mask would be NaN) must not reach other slots' rows or the
    base model's."""
    a, b_t, ranks = factors(3, 16, 32, 24, [16, 16, 16])
    a = a.float()
    a[2, 0, 0] = float("inf")
    x, out = torch.randn(4, 32), torch.zeros(4, 24)
    row_slots = torch.tensor([0, -1, 1, 2], dtype=torch.int32)
    lora_rows_ref(x, out, row_slots, ranks, a, b_t.float())
    assert torch.isfinite(out[:3]).all() and torch.equal(out[1], torch.zeros(24))
