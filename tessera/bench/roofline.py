"""The memory-bandwidth roofline of a decode step: a step reads every weight once and every
cached K/V row of every sequence once, so it cannot finish faster than those bytes over the
memory's bandwidth. `tessera bench latency` prints each TPOT beside that floor.

A mixture of experts reads only the experts its tokens are routed to: one token top_k of
num_experts per layer; a batch of B tokens, routed independently and uniformly, the
expected share 1 - (1 - top_k / num_experts)^B of them. A sliding-window layer reads at most
its window of each sequence's cached tokens. A recurrent layer (linear attention) reads and
writes its fixed-size state of each sequence once a step, whatever the context.

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
    weight_bytes: int          # read once per decode step (routed experts not included)
    kv_bytes_per_token: int    # K and V of one cached token, the layers without a window
    expert_bytes: int = 0      # every routed expert's weights, all layers
    expert_share: float = 0.0  # of them one token reads (top_k / num_experts)
    # (window, K and V bytes of one cached token in the layers with that window)
    windowed_kv: tuple[tuple[int, int], ...] = ()
    state_bytes_per_seq: int = 0  # recurrent layers' state of one sequence (read and written)

    def step_ms(self, batch: int, mean_context: float) -> float:
        """The fastest a decode step of `batch` rows, each attending to `mean_context`
        cached tokens on average, can be: its bytes over the bandwidth."""
        experts = self.expert_bytes * (1 - (1 - self.expert_share) ** batch)
        kv = mean_context * self.kv_bytes_per_token + sum(min(mean_context, w) * b for w, b in self.windowed_kv)
        total = self.weight_bytes + experts + batch * (kv + 2 * self.state_bytes_per_seq)
        return total / (self.bandwidth_gbs * 1e9) * 1e3


def routed_experts(model: nn.Module) -> list[tuple[nn.Module, float]]:
    """Each mixture-of-experts block's experts (its `experts` module) and the share of them
    one token reads (its top_k / num_experts)."""
    return [(m.experts, m.top_k / m.num_experts) for m in model.modules()
            if isinstance(getattr(m, "experts", None), nn.Module) and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def decode_weight_bytes(model: nn.Module) -> tuple[int, int, float]:
    """(bytes of weights every decode step reads, bytes of all routed experts, the share of
    those one token reads). Every parameter counts once (shared ones once), but of an
    embedding table only the looked-up rows, i.e. nothing, unless the LM head shares it."""
    head = {id(m.weight) for m in model.modules() if isinstance(m, LMHead)}
    lookup_only = {id(m.weight) for m in model.modules() if isinstance(m, VocabEmbedding)} - head
    routed = routed_experts(model)
    expert_params = {id(p) for experts, _ in routed for p in experts.parameters()}
    seen: set[int] = set()
    total = experts = 0
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen or id(param) in lookup_only:
                continue
            seen.add(id(param))
            if id(param) in expert_params:
                experts += param.numel() * param.element_size()
            else:
                total += param.numel() * param.element_size()
    share = routed[0][1] if routed else 0.0
    return total, experts, share


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
    dense, experts, share = decode_weight_bytes(runner.model)
    full, windowed = 0, {}
    for layer in runner.attn_layers:
        per_token = layer.cache_tensors * layer.num_kv_heads * layer.head_size * runner.kv_cache_dtype.itemsize
        if layer.sliding_window is None:
            full += per_token
        else:
            windowed[layer.sliding_window] = windowed.get(layer.sliding_window, 0) + per_token
    state = runner.state_bytes_per_sequence()
    return Roofline(bandwidth_gbs=copy_bandwidth_gbs(runner.device), weight_bytes=dense, kv_bytes_per_token=full,
                    expert_bytes=experts, expert_share=share, windowed_kv=tuple(sorted(windowed.items())),
                    state_bytes_per_seq=state)
