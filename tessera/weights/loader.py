"""Push-style weight loading: each checkpoint tensor goes to the parameter that owns it,
through that parameter's own loader. Missing and unexpected weights are errors."""
from __future__ import annotations

from typing import Hashable, Iterable

import torch
from torch import nn


class WeightLoadError(ValueError):
    pass


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load `weights` into `model`; returns the names of the parameters loaded."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        param.tessera_name = name
    ignored: tuple[str, ...] = getattr(model, "ignored_weight_suffixes", ())
    loaded: dict[str, set] = {}
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if ckpt_name.endswith(ignored) or model_tensor_name(model, ckpt_name) is None:
            continue
        name, shard_id = checkpoint_target(model, ckpt_name)
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        try:
            param.weight_loader(param, tensor, shard_id)
        except (ValueError, KeyError) as exc:
            raise WeightLoadError(f"{ckpt_name}: {exc}") from exc
        loaded.setdefault(name, set()).add(shard_id)
    if unexpected:
        shown = ", ".join(unexpected[:10]) + (" ..." if len(unexpected) > 10 else "")
        raise WeightLoadError(f"{len(unexpected)} checkpoint tensors match no model parameter: {shown}")
    missing = []
    for name, param in params.items():
        shards = loaded.get(name)
        complete = shards is not None and (None in shards or set(param.shard_ids) <= shards)
        if not complete:
            need = set(param.shard_ids) - (shards or set())
            missing.append(name + (f" (shards {sorted(map(str, need))})" if param.shard_ids else ""))
    if missing:
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise WeightLoadError(f"{len(missing)} model parameters were not in the checkpoint: {shown}")
    return set(loaded)


def model_tensor_name(model: nn.Module, ckpt_name: str) -> str | None:
    """A checkpoint name with the model's `checkpoint_prefixes` applied (the first that
    matches: a new prefix, or None for tensors the model does not use, e.g. a multimodal
    checkpoint's vision tower when only its language model is served)."""
    for prefix, replacement in getattr(model, "checkpoint_prefixes", {}).items():
        if ckpt_name.startswith(prefix):
            return None if replacement is None else replacement + ckpt_name[len(prefix):]
    return ckpt_name


def checkpoint_target(model: nn.Module, ckpt_name: str) -> tuple[str, Hashable]:
    """(our parameter's name, shard id) for a checkpoint tensor's name (after
    `checkpoint_prefixes`): the model's own `map_weight_name` hook first (names a fragment
    swap cannot express, e.g. one tensor per expert into a stacked parameter), then its
    packed_modules_mapping (q_proj -> qkv_proj, shard "q"), else the name itself (shard None)."""
    ckpt_name = model_tensor_name(model, ckpt_name) or ckpt_name
    map_name = getattr(model, "map_weight_name", None)
    mapped = map_name(ckpt_name) if map_name is not None else None
    if mapped is not None:
        return mapped
    packed: dict[str, tuple[str, Hashable]] = getattr(model, "packed_modules_mapping", {})
    for fragment, (packed_fragment, shard) in packed.items():
        if f".{fragment}." in ckpt_name:
            return ckpt_name.replace(f".{fragment}.", f".{packed_fragment}."), shard
    return ckpt_name, None
