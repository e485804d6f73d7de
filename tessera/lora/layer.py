"""A linear layer's LoRA slots, and the pass-wide record of which token rows use which slot.

Each layer holds `num_slots` adapters at once, as A [slots, R, in] and B transposed,
[slots, R, out] (this rank's share under tensor parallelism). A packed layer (QKV, gate-up) stacks its
shards' factors along R: A = [A_q; A_k; A_v] and B is block-structured, each shard's B in
its own output rows and rank columns, so one pair of GEMMs serves the packed output.

Each layer adds `x[r] @ A[slot].T @ B[slot].T` to its output for every row r of an
adapter, in one of two ways that `lora_context` chooses for the pass:

- segments (prefills, large steps): a step's rows are grouped so that rows of one adapter
  are contiguous (runner/inputs.py), and each segment costs two thin GEMMs through the
  registered `linear` builder, with each slot's factors prepared in its layout once, when
  the slot is loaded (on CPU in bf16 the packed GEMM kernel). No gathered weights;
- rows (decode-sized steps, at most ROWS_LIMIT): the registered `lora_rows` op reads each
  row's slot from a tensor, one call per layer, so that a captured decode graph replays it
  (the runner's static buffer holds the slots; base rows are -1).

A slot's capacity is max rank x shards padded to a multiple of 16 (the panel width of the
packed layout), zeros past the adapter's rank: the segment GEMMs run over all of it (their
packed copies are allocated up front, so the KV cache is sized around them), the rows op
stops at the rank rounded up to 16.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Hashable, Iterator

import torch

from tessera.lora.adapter import LoRAPair
from tessera.ops.linear import Linear, PackedLinear, RowParallelLinear
from tessera.ops.registry import OpTarget
from tessera.platform import to_device

RANK_ALIGN = 16  # slot ranks are padded to this (the packed GEMM's panel width)

ROWS_LIMIT = 32  # steps of at most this many rows use the per-row op (decode graphs' range)

Segment = tuple[int, int, int]  # slot, first token row, end token row


@dataclass
class LoRAPass:
    """What a forward pass's layers add: `row_slots` (int32 [rows], -1 for the base model)
    when set, else each segment's delta (none: the base model for every row)."""

    segments: list[Segment] = field(default_factory=list)
    row_slots: torch.Tensor | None = None


_current = LoRAPass()


@contextmanager
def lora_context(lora: LoRAPass) -> Iterator[None]:
    """Scope a pass's adapters."""
    global _current
    saved, _current = _current, lora
    try:
        yield
    finally:
        _current = saved


def row_slots_for(segments: list[Segment], rows: int, device: torch.device) -> torch.Tensor | None:
    """The per-row slots of a step with these segments, if it is small enough for them."""
    if not segments or rows > ROWS_LIMIT:
        return None
    slots = [-1] * rows
    for slot, start, end in segments:
        slots[start:end] = [slot] * (end - start)
    return to_device(torch.tensor(slots, dtype=torch.int32), device)


class LayerLoRA:
    def __init__(self, layer: Linear, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.layer = layer
        num_shards = len(layer.shard_sizes) if isinstance(layer, PackedLinear) else 1
        capacity = -(-max_rank * num_shards // RANK_ALIGN) * RANK_ALIGN
        self.a = torch.zeros(num_slots, capacity, layer.in_features, dtype=dtype, device=device)
        self.b_t = torch.zeros(num_slots, capacity, layer.out_features, dtype=dtype, device=device)
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)  # read by lora_rows
        target = OpTarget(device.type, dtype)
        self._linear = target.op("linear")
        self._prepare = target.prepare("linear")
        self._rows = target.op("lora_rows")
        # per slot, (A, B) in the linear builder's layout (packed panels on CPU, else views
        # of the slot): allocated now, so that the KV cache is sized around them, and
        # refilled at each load; `factors` names the loaded ones (None: nothing to add)
        self._prepared = [(self._prepare_copy(self.a[s]), self._prepare_copy(self.b_t[s].t()))
                          for s in range(num_slots)]
        self.factors: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots

    @property
    def num_bytes(self) -> int:
        slot_memory = {self.a.untyped_storage().data_ptr(), self.b_t.untyped_storage().data_ptr()}
        copies = sum(t.numel() for pair in self._prepared for t in pair
                     if t.untyped_storage().data_ptr() not in slot_memory)
        return (self.a.numel() + self.b_t.numel() + copies) * self.a.element_size()

    def load(self, slot: int, shards: dict[Hashable, LoRAPair] | None) -> None:
        """Put an adapter's factors for this layer into `slot` (None: it does not target
        this layer)."""
        layer = self.layer
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        rank = 0
        for shard, pair in (shards or {}).items():
            a, b, r = pair.a, pair.b, pair.rank
            if isinstance(layer, RowParallelLinear):  # this rank's input columns
                a = a[:, layer.in_span.start:layer.in_span.start + layer.in_span.size]
            if rank + r > self.a.shape[1]:
                raise ValueError(f"rank {rank + r} exceeds the slot's capacity {self.a.shape[1]}")
            self.a[slot, rank:rank + r].copy_(a)
            for out_start, rows in self._output_rows(shard, b):
                self.b_t[slot, rank:rank + r, out_start:out_start + rows.shape[0]].copy_(rows.t())
            rank += r
        self.ranks[slot] = -(-rank // RANK_ALIGN) * RANK_ALIGN  # the rows op stops there
        if self._prepare is not None:  # (views need nothing: they see the slot)
            for dst, src in zip(self._prepared[slot], (self.a[slot], self.b_t[slot].t())):
                dst.copy_(self._prepare(src.contiguous()))
        self.factors[slot] = self._prepared[slot] if rank else None

    def _prepare_copy(self, weight: torch.Tensor) -> torch.Tensor:
        """The builder's layout of `weight` (a slot's view itself where it has none)."""
        return weight if self._prepare is None else self._prepare(weight.contiguous())

    def _output_rows(self, shard: Hashable, b: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(where in this rank's output, which rows of B) for a target's B: all of it for an
        unpacked layer; this rank's span of the shard for a packed one; of each shard when
        the target is the whole packed layer (shard None: a checkpoint that packs too)."""
        layer = self.layer
        if not isinstance(layer, PackedLinear):
            return [(0, b)]
        full_starts, start = {}, 0
        for sid, size in layer.full_sizes.items():
            full_starts[sid] = start
            start += size
        pieces = []
        for sid in (layer.spans if shard is None else [shard]):
            span = layer.spans[sid]
            first = span.start + (full_starts[sid] if shard is None else 0)
            pieces.append((layer.shard_offsets[sid], b[first:first + span.size]))
        return pieces

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base layer's output for `x`) plus its rows' adapter deltas."""
        lora = _current
        if lora.row_slots is not None:
            self._rows(x, out, lora.row_slots, self.ranks, self.a, self.b_t)
            return out
        for slot, start, end in lora.segments:
            factors = self.factors[slot]
            if factors is not None:
                a, b = factors
                out[start:end] += self._linear(self._linear(x[start:end], a, None), b, None)
        return out
