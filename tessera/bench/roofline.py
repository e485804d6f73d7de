"""The memory-bandwidth roofline of a decode step: a step reads every weight once and every
cached K/V row of every sequence once, so it cannot finish faster than those bytes over the
memory's bandwidth. `tessera bench latency` prints each TPOT beside that floor.

Bandwidth is measured as NVIDIA's bandwidthTest does for device-to-device copies: a 1 GiB
copy, (read + written) bytes over the time. On a CPU the same copy also pays for
write-allocate traffic, so its figure is below what pure reads reach: the floor it gives
is too high there, and a decode step can beat it (over 100%).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from tessera.bench.workload import median
from tessera.ops.embedding import LMHead, VocabEmbedding


@dataclass(frozen=True)
class Roofline:
    bandwidth_gbs: float       # measured copy bandwidth, GB/s (1e9 bytes)
    weight_bytes: int          # read once per decode step
    kv_bytes_per_token: int    # K and V of one cached token, all layers

    def step_ms(self, batch: int, mean_context: float) -> float:
        """The fastest a decode step of `batch` rows, each attending to `mean_context`
        cached tokens on average, can be: its bytes over the bandwidth."""
        total = self.weight_bytes + batch * mean_context * self.kv_bytes_per_token
        return total / (self.bandwidth_gbs * 1e9) * 1e3


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter once (shared ones once), but of
    an embedding table only the looked-up rows, i.e. nothing, unless the LM head shares it."""
    head = {id(m.weight) for m in model.modules() if isinstance(m, LMHead)}
    lookup_only = {id(m.weight) for m in model.modules() if isinstance(m, VocabEmbedding)} - head
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen or id(param) in lookup_only:
                continue
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


def copy_bandwidth_gbs(device: torch.device, size_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Median over `repeats` copies of a `size_bytes` buffer: 2 * size / time, in GB/s."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    src.fill_(1)  # touch every page before timing
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size_bytes / median(times) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_roofline(engine) -> Roofline:
    """The roofline of `engine`'s model and KV cache on its device."""
    runner = engine.runner
    return Roofline(bandwidth_gbs=copy_bandwidth_gbs(runner.device),
                    weight_bytes=decode_weight_bytes(runner.model),
                    kv_bytes_per_token=runner.kv_bytes_per_block() // runner.block_size)
