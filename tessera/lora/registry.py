"""The engine's adapters by name: loaded at start-up, by a request naming a new one (the
offline API's LoRARequest), or through the server's load/unload routes.

Any thread may call it. Removing a name does not touch requests already holding the
adapter: a sequence keeps its adapter object (weights included) until it finishes, and
the device slot it occupied is reused once no step needs it.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import nn

from tessera.lora.adapter import LoRAAdapter, LoRAAdapterError, adapter_folder, load_adapter
from tessera.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, model: nn.Module, max_rank: int, dtype: torch.dtype):
        self.model = model
        self.max_rank = max_rank
        self.dtype = dtype
        self._adapters: dict[str, LoRAAdapter] = {}
        self._lock = threading.Lock()

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter named `request.lora_name`, loading it from `request.lora_path` unless
        it is loaded already (from the same folder; another folder is an error)."""
        existing = self.get(request.lora_name)
        if existing is None:
            adapter = load_adapter(request.lora_name, request.lora_path, self.model, self.max_rank, self.dtype)
            with self._lock:  # another thread may have loaded it meanwhile: first one wins
                existing = self._adapters.setdefault(request.lora_name, adapter)
        # the same folder however it is spelled (relative, absolute, through a link)
        if Path(existing.path).resolve() != adapter_folder(request.lora_path).resolve():
            raise LoRAAdapterError(f"a LoRA adapter named {request.lora_name!r} is already loaded "
                                   f"from {existing.path}")
        return existing

    def resolve(self, request: LoRARequest | str) -> LoRAAdapter:
        """A request's adapter: a LoRARequest is loaded unless it is already, a name must be."""
        if isinstance(request, LoRARequest):
            return self.add(request)
        adapter = self.get(request)
        if adapter is None:
            known = sorted(a.name for a in self.adapters())
            raise LoRAAdapterError(f"unknown LoRA adapter {request!r}; loaded: {known}")
        return adapter

    def get(self, name: str) -> LoRAAdapter | None:
        with self._lock:
            return self._adapters.get(name)

    def remove(self, name: str) -> bool:
        """Forget `name`; False if no adapter has it."""
        with self._lock:
            return self._adapters.pop(name, None) is not None

    def adapters(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._adapters.values())


def adapter_names(seqs) -> tuple[str, ...]:
    """The distinct adapters of `seqs`, by name (what /metrics reports)."""
    return tuple(sorted({seq.lora.name for seq in seqs if seq.lora is not None}))
