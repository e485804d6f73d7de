"""Tensors of a Hugging Face folder, one at a time (memory-mapped, never all at once)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from tessera.weights.lazy import LazyTensor


INDEX = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files, as transformers picks them: model.safetensors when
    there is one, else those the index maps tensors to (Mistral's repositories also hold
    consolidated.safetensors, the same weights under Mistral's own names, which the index
    leaves out), else every *.safetensors."""
    single, index = folder / "model.safetensors", folder / INDEX
    if single.is_file():
        return [single]
    if index.is_file():
        mapped = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [name for name in mapped if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} maps tensors to {missing[0]}, which is not in {folder}")
        return [folder / name for name in mapped]
    return sorted(folder.glob("*.safetensors"))


def iter_hf_weights(folder: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """With `lazy`, safetensors tensors come as LazyTensor: a loader reads only the slice it
    keeps (tensor-parallel ranks), valid until the next tensor is requested."""
    files = safetensors_files(folder)
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
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names
