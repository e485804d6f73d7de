"""Tensors of a Hugging Face folder, one at a time (memory-mapped, never all at once)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from tessera.weights.lazy import LazyTensor


def iter_hf_weights(folder: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """With `lazy`, safetensors tensors come as LazyTensor: a loader reads only the slice it
    keeps (tensor-parallel ranks), valid until the next tensor is requested."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, (LazyTensor(f, name) if lazy else f.get_tensor(name))
        return
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"{folder} holds no *.safetensors (or pytorch_model*.bin) weights")
    for file in bins:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()


def hf_tensor_names(folder: Path) -> set[str]:
    """Every tensor name of a folder's safetensors files (their headers only)."""
    names: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names
