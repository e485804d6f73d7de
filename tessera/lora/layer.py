"""A linear layer's LoRA slots, and the pass-wide record of which token rows use which slot.

Each layer holds `num_slots` adapters at once, as A [slots, R, in] and B [slots, out, R]
(this rank's share under tensor parallelism). A packed layer (QKV, gate-up) stacks its
shards' factors along R: A = [A_q; A_k; A_v] and B is block-structured, each shard's B in
its own output rows and rank columns, so one pair of GEMMs serves the packed output.

A step's rows are grouped so that rows of one adapter are contiguous (runner/inputs.py);
`lora_context` names those segments for the pass, and each layer adds
`x[rows] @ A[slot].T @ B[slot].T` to its output for each segment: two thin GEMMs per
adapter in the batch, no gathered weights. Rows of the base model are in no segment.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Hashable, Iterator

import torch

from tessera.lora.adapter import LoRAPair
from tessera.ops.linear import Linear, PackedLinear, RowParallelLinear

Segment = tuple[int, int, int]  # slot, first token row, end token row

_segments: list[Segment] = []  # the current forward pass's


@contextmanager
def lora_context(segments: list[Segment]) -> Iterator[None]:
    """Scope a pass's adapter segments (none: the base model for every row)."""
    global _segments
    saved, _segments = _segments, segments
    try:
        yield
    finally:
        _segments = saved


class LayerLoRA:
    def __init__(self, layer: Linear, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.layer = layer
        num_shards = len(layer.shard_sizes) if isinstance(layer, PackedLinear) else 1
        capacity = max_rank * num_shards
        self.a = torch.zeros(num_slots, capacity, layer.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, layer.out_features, capacity, dtype=dtype, device=device)
        self.ranks = [0] * num_slots  # columns of R in use per slot (0: nothing to add)

    @property
    def num_bytes(self) -> int:
        return (self.a.numel() + self.b.numel()) * self.a.element_size()

    def load(self, slot: int, shards: dict[Hashable, LoRAPair] | None) -> None:
        """Put an adapter's factors for this layer into `slot` (None: it does not target
        this layer)."""
        layer = self.layer
        self.a[slot].zero_()
        self.b[slot].zero_()
        rank = 0
        for shard, pair in (shards or {}).items():
            a, b, r = pair.a, pair.b, pair.rank
            if isinstance(layer, RowParallelLinear):  # this rank's input columns
                a = a[:, layer.in_span.start:layer.in_span.start + layer.in_span.size]
            out_start = 0
            if isinstance(layer, PackedLinear):  # this rank's rows of the shard
                span = layer.spans[shard]
                b = b[span.start:span.start + span.size]
                out_start = layer.shard_offsets[shard]
            if rank + r > self.a.shape[1]:
                raise ValueError(f"rank {rank + r} exceeds the slot's capacity {self.a.shape[1]}")
            self.a[slot, rank:rank + r].copy_(a)
            self.b[slot, out_start:out_start + b.shape[0], rank:rank + r].copy_(b)
            rank += r
        self.ranks[slot] = rank

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output for `x`) plus each segment's adapter delta."""
        for slot, start, end in _segments:
            rank = self.ranks[slot]
            if rank:
                out[start:end].addmm_(x[start:end] @ self.a[slot, :rank].t(), self.b[slot, :, :rank].t())
        return out
