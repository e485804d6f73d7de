"""Tensors of a Hugging Face folder, one at a time (memory-mapped, never all at once)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open


def iter_hf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"{folder} holds no *.safetensors (or pytorch_model*.bin) weights")
    for file in bins:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()
