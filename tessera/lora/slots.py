"""Which adapter each LoRA slot holds, on the device (the model runner owns this).

An adapter is copied into a slot of every layer when a step needs it and no slot holds
it, taking a free slot or the least recently used one no adapter of the step needs. The
scheduler never runs more distinct adapters in one step than there are slots.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Iterable

import torch
from torch import nn

from tessera.lora.adapter import LoRAAdapter
from tessera.lora.layer import LayerLoRA
from tessera.ops.linear import Linear

logger = logging.getLogger(__name__)


class LoRASlots:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_slots = num_slots
        self.layers: dict[str, LayerLoRA] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                module.lora = self.layers[name] = LayerLoRA(module, num_slots, max_rank, dtype, device)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no linear layers an adapter could target")
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter key -> slot, LRU first
        logger.info("LoRA: %d slots of rank %d over %d layers (%.1f MiB)", num_slots, max_rank,
                    len(self.layers), sum(layer.num_bytes for layer in self.layers.values()) / 2**20)

    def activate(self, adapters: Iterable[LoRAAdapter]) -> tuple[dict[int, int], list[tuple[int, LoRAAdapter]]]:
        """Make every adapter resident: ({adapter key: slot}, the (slot, adapter) loads
        this made, for other ranks to repeat)."""
        wanted = {adapter.key: adapter for adapter in adapters}
        if len(wanted) > self.num_slots:
            raise RuntimeError(f"a step uses {len(wanted)} adapters; there are {self.num_slots} slots")
        loads = []
        for key in wanted:
            if key in self.resident:
                self.resident.move_to_end(key)
        for key, adapter in wanted.items():
            if key in self.resident:
                continue
            taken = set(self.resident.values())
            free = [s for s in range(self.num_slots) if s not in taken]
            if free:
                slot = free[0]
            else:
                evicted = next(k for k in self.resident if k not in wanted)
                slot = self.resident.pop(evicted)
            self.load(slot, adapter)
            self.resident[key] = slot
            loads.append((slot, adapter))
        return {key: self.resident[key] for key in wanted}, loads

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        unknown = set(adapter.weights) - set(self.layers)
        if unknown:
            raise ValueError(f"adapter {adapter.name!r} targets layers without slots: {sorted(unknown)[:3]}")
        for name, layer in self.layers.items():
            layer.load(slot, adapter.weights.get(name))
