"""CPU weights and KV cache in transparent huge pages.

A CPU decode step streams every weight once, so its speed is the host's read rate. With
4 KiB pages a 2-thread read loop over 270 MB reached 25-27 GB/s on the 2-core host; the same
loop over 2 MiB pages 29-31 GB/s (fewer TLB misses; docs/benchmarks.md). Torch asks for huge
pages only when THP_MEM_ALLOC_ENABLE=1 is set before it is imported, and then only for
single allocations of 2 MiB or more, which most matrices of a small model are not. So the
runner moves every weight into one arena it advises itself, and allocates the KV cache the
same way. Where the kernel offers no transparent huge pages the advice is a no-op and the
memory is ordinary anonymous memory.
"""
from __future__ import annotations

import ctypes
import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # every tensor starts on a cache line (the kernels' vector loads)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
TRIM_EVERY = 64 << 20  # bytes moved between returns of the freed heap to the system


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def empty_huge(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes`, starting on a 2 MiB boundary of an
    anonymous mapping advised for huge pages before anything touches it."""
    span = _round_up(max(nbytes, 1), HUGE_PAGE)
    # private: a shared anonymous mapping would be shmem, which THP serves only if told to
    area = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)  # keeps `area` alive
    start = (-whole.data_ptr()) % HUGE_PAGE
    if _MADV_HUGEPAGE is not None:
        try:
            area.madvise(_MADV_HUGEPAGE, start, span)
        except OSError:
            pass  # THP off in this kernel: plain pages
    return whole[start:start + nbytes]


def empty_huge_like(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor of `shape` and `dtype` in huge pages."""
    elem = torch.empty((), dtype=dtype).element_size()
    count = 1
    for size in shape:
        count *= size
    return empty_huge(count * elem).view(dtype).view(shape)


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Copy every CPU parameter and buffer of `model` into one huge-page arena and point the
    tensors at their copies (views sharing a storage keep sharing it). Returns the bytes
    moved. Call after the weights are loaded and prepared, before anything records their
    addresses (captured decode graphs). Each storage is let go as soon as its tensors point
    at the arena, so the move costs one storage's bytes beyond the arena, not a second copy
    of the model (an 8B bf16 model would otherwise peak at 32 GB)."""
    users: dict[int, list[torch.Tensor]] = {}
    sizes: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type == "cpu" and t.numel() > 0:
            ptr = t.untyped_storage().data_ptr()
            users.setdefault(ptr, []).append(t)
            sizes[ptr] = t.untyped_storage().nbytes()
    offsets, total = {}, 0
    for ptr, nbytes in sizes.items():
        offsets[ptr] = total
        total = _round_up(total + nbytes, _ALIGN)
    if total == 0:
        return 0
    arena = empty_huge(total)
    freed = 0
    with torch.no_grad():
        for ptr, tensors in users.items():
            begin, nbytes = offsets[ptr], sizes[ptr]
            arena[begin:begin + nbytes].copy_(_bytes_of(tensors[0].untyped_storage()))
            for t in tensors:
                moved = arena[begin:begin + nbytes].view(t.dtype)
                # as_strided's offset counts from the arena mapping's start, not from `moved`
                t.data = moved.as_strided(t.shape, t.stride(), moved.storage_offset() + t.storage_offset())
            freed += nbytes
            if freed >= TRIM_EVERY:  # freed storages in glibc's heap still count until trimmed
                _return_freed_heap()
                freed = 0
    _return_freed_heap()
    return total


def _return_freed_heap() -> None:
    """Hand the heap's free pages back to the system (glibc keeps what loading freed: the
    checkpoint-dtype copies of quantized layers, the storages just moved)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)
