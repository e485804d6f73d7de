"""Time GPU calls the way a replayed decode step sees them: weights not in L2, no host
launch time, no candidate favoured by the order it runs in.

- A decode step streams every weight from memory once, but a kernel timed in a loop finds
  a layer's weights (tens of MB) still in an H100's 50 MB L2. Each timed call follows a
  read of twice the L2's size (a read, not a write: dirty lines would cost the timed
  kernel their write-back, which a decode step does not pay).
- A graph replay launches back to back; a Python wrapper's launch time (tens of us, more
  than a small GEMV takes) must not land between the events. The stream sleeps after the
  flush while the host queues the call, so the GPU never waits for it.
- Candidates take turns rep by rep (clocks and temperature drift alike for all), after a
  warm-up of every candidate; each one's median is returned.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch

SLEEP_CYCLES = 200_000  # ~0.1 ms of GPU clock: a few times a wrapper's launch time


def _l2_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20


def time_cold(runs: dict[str, Callable[[], object]], device: torch.device, reps: int = 9,
              warmup: int = 3) -> dict[str, float]:
    """Median seconds of each `runs[name]()` with a cold L2, over `reps` interleaved calls."""
    with torch.cuda.device(device):
        # allocated per call: between tuning calls the caching allocator keeps the block
        # for whatever needs it next, instead of a buffer held for the process's life
        flush = torch.ones(2 * _l2_bytes(device) // 4, dtype=torch.float32, device=device)
        for _ in range(warmup):
            for run in runs.values():
                run()
        events = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                         for _ in range(reps)] for name in runs}
        for rep in range(reps):
            for name, run in runs.items():
                start, end = events[name][rep]
                flush.sum()
                torch.cuda._sleep(SLEEP_CYCLES)
                start.record()
                run()
                end.record()
        torch.cuda.synchronize(device)
        return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e-3
                for name, pairs in events.items()}
