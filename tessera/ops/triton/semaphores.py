"""Zeroed int32 counters for kernels whose programs share a finishing step, done by
whichever program arrives last (the split-K sum of the few-row linear, the merge of decode
attention's partitions), so the step needs no second kernel launch.

Each program stores its part, waits for all its threads (a CTA barrier), then adds 1 to
its counter with an acquire-release atomic at GPU scope: the one that reads count - 1 sees
every other program's part, does the finishing step and sets the counter back to 0. So
the buffer is all zeros between launches with no memset, and one buffer per device serves
every kernel: launches on a stream run one after another. A buffer is never freed once
handed out, because a captured CUDA graph keeps using the one it was captured with.
"""
from __future__ import annotations

import torch

MIN_COUNTERS = 1 << 16  # 256 KiB: every counter a batch of 1024 x 64 groups needs

_buffers: dict[torch.device, list[torch.Tensor]] = {}


def counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 counters on `device`, all zero between kernel launches."""
    device = torch.device(device)
    held = _buffers.setdefault(device, [])
    if not held or held[-1].numel() < count:
        # the older buffers stay referenced: graphs captured with them still replay
        held.append(torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device))
    return held[-1]
