"""Push-style weight loading: each checkpoint tensor goes to the parameter that owns it,
through that parameter's own loader. Missing and unexpected weights are errors."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


class WeightLoadError(ValueError):
    pass


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load `weights` into `model`; returns the names of the parameters loaded."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        param.tessera_name = name
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules_mapping", {})
    ignored: tuple[str, ...] = getattr(model, "ignored_weight_suffixes", ())
    # optional model hook for names a fragment swap cannot express (e.g. one tensor per
    # expert into a stacked parameter): name -> (parameter name, shard id), or None
    map_name = getattr(model, "map_weight_name", None)
    loaded: dict[str, set] = {}
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if ckpt_name.endswith(ignored):
            continue
        mapped = map_name(ckpt_name) if map_name is not None else None
        if mapped is not None:
            name, shard_id = mapped
        else:
            name, shard_id = ckpt_name, None
            for fragment, (packed_fragment, shard) in packed.items():
                if f".{fragment}." in ckpt_name:
                    name, shard_id = ckpt_name.replace(f".{fragment}.", f".{packed_fragment}."), shard
                    break
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
