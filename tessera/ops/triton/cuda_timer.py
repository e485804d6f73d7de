"""Time one GPU call the way a decode step sees it: weights not in L2.

A decode step streams every weight from memory once, but a kernel timed in a loop finds a
layer's weights (a few tens of MB) still in the L2 cache of an H100 (50 MB) and looks
faster than it will be. Each timed call here runs after a write over more than the L2's
size, timed alone with CUDA events on the current stream; the median is returned.
"""
from __future__ import annotations

import statistics

import torch


def _l2_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20


def time_cold(fn, device: torch.device, reps: int = 9, warmup: int = 2) -> float:
    """Median seconds of `fn()` with a cold L2, over `reps` calls."""
    # allocated per call: between tuning calls the caching allocator keeps the block for
    # whatever needs it next, instead of a buffer held for the process's life
    flush = torch.empty(2 * _l2_bytes(device), dtype=torch.int8, device=device)
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    ends[-1].synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e-3
