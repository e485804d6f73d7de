"""Weights and KV cache in huge pages: moving keeps every value and every sharing between
tensors, lands on 2 MiB boundaries, and (where the kernel offers transparent huge pages)
is really backed by them."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tessera.runner.huge_pages import HUGE_PAGE, empty_huge, empty_huge_like, move_weights_to_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The selected THP mode ('always', 'madvise', 'never'), or None off Linux."""
    if not THP.exists():
        return None
    found = re.search(r"\[(\w+)\]", THP.read_text())
    return found.group(1) if found else None


def huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process holding `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_empty_huge_starts_on_a_huge_page_and_holds_what_is_written() -> None:
    buf = empty_huge(3 * HUGE_PAGE + 100)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 100
    assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(7)
    assert int(buf.sum()) == 7 * buf.numel()
    typed = empty_huge_like((4, 5, 6), torch.bfloat16)
    assert typed.shape == (4, 5, 6) and typed.dtype == torch.bfloat16 and typed.is_contiguous()


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="no transparent huge pages here")
def test_empty_huge_is_backed_by_huge_pages() -> None:
    buf = empty_huge(4 * HUGE_PAGE)
    buf.fill_(1)  # first touch: the kernel now chooses the page size
    assert huge_kib_at(buf.data_ptr()) >= HUGE_PAGE // 1024


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(24, 40, bias=True, dtype=torch.bfloat16)
        self.b = nn.Linear(40, 24, bias=False)
        self.shared = self.a  # the same module twice: its tensors are moved once
        base = torch.arange(64, dtype=torch.float32)
        self.register_buffer("table", base)
        self.register_buffer("odd_rows", base.view(8, 8)[1::2])  # a strided view of `table`
        self.register_buffer("empty", torch.empty(0))


def test_move_keeps_values_sharing_and_strides() -> None:
    model = Tiny().requires_grad_(False)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    y = model.b(model.a(x).float())
    moved = move_weights_to_huge_pages(model)
    # a.weight 1920 B, a.bias 80 (padded to 128), b.weight 3840, table 256 (odd_rows is in it)
    assert moved == 1920 + 128 + 3840 + 256
    after = model.state_dict()
    for name, value in before.items():
        assert after[name].dtype == value.dtype and after[name].shape == value.shape, name
        torch.testing.assert_close(after[name], value, rtol=0, atol=0)
    # the view still shares the table's storage, with its strides
    assert model.odd_rows.untyped_storage().data_ptr() == model.table.untyped_storage().data_ptr()
    assert model.odd_rows.stride() == (16, 1)
    model.table[8] = -1.0
    assert float(model.odd_rows[0, 0]) == -1.0
    # one arena, on a huge-page boundary, every tensor on a cache line
    ptrs = [t.data_ptr() for t in (model.a.weight, model.a.bias, model.b.weight, model.table)]
    assert min(ptrs) % HUGE_PAGE == 0 and max(ptrs) - min(ptrs) < moved
    assert all(p % 64 == 0 for p in ptrs)
    assert model.shared.weight is model.a.weight
    torch.testing.assert_close(model.b(model.a(x).float()), y, rtol=0, atol=0)


def test_each_old_storage_is_freed_as_soon_as_it_is_moved(monkeypatch) -> None:
    """The move never holds the model twice: when a storage is copied, every storage moved
    before it is gone (an 8B bf16 model would otherwise need 32 GB to move)."""
    import weakref

    from tessera.runner import huge_pages

    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    olds = [weakref.ref(p.untyped_storage()) for p in model.parameters()]
    alive_at_copy = []
    copy = huge_pages._bytes_of

    def recording(storage):
        alive_at_copy.append(sum(ref() is not None for ref in olds))
        return copy(storage)

    monkeypatch.setattr(huge_pages, "_bytes_of", recording)
    move_weights_to_huge_pages(model)
    assert alive_at_copy == list(range(len(olds), 0, -1))  # one fewer alive at each copy
    assert all(ref() is None for ref in olds)
