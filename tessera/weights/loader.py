"""Push-style weight loading: each checkpoint tensor goes to the parameter that owns it,
through that parameter's own loader. Missing and unexpected weights are errors."""
from __future__ import annotations

from typing import Hashable, Iterable

import torch
from torch import nn


class WeightLoadError(ValueError):
    pass


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 prepare: bool = False) -> set[str]:
    """Load `weights` into `model`; returns the names of the parameters loaded.

    `prepare`: a module with a `prepare_weights` hook (tessera/ops/weights.py) is prepared as
    soon as every parameter it holds is complete, and its loaded copy is let go: quantized or
    repacked layers then never all sit in the model dtype at once, so an int4 model peaks
    near its own size plus a layer, not at its full-precision size. A second tensor for a
    parameter of a prepared module is an error (its loaded copy is gone); other parameters
    take the last tensor given, as without `prepare`."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        param.tessera_name = name
    shard_ids = {name: param.shard_ids for name, param in params.items()}
    preparing = _Preparation(model, params if prepare else {})
    ignored: tuple[str, ...] = getattr(model, "ignored_weight_suffixes", ())
    loaded: dict[str, set] = {}
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if ckpt_name.endswith(ignored) or model_tensor_name(model, ckpt_name) is None:
            continue
        name, shard_id = checkpoint_target(model, ckpt_name)
        if name in preparing.done:
            raise WeightLoadError(f"{ckpt_name}: {name} is loaded already (the checkpoint holds it twice)")
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        if not getattr(param, "takes_int4_parts", False) and hasattr(tensor, "plain"):
            tensor = tensor.plain()  # (int4 parts as stored: only for layers that use them)
        try:
            param.weight_loader(param, tensor, shard_id)
        except (ValueError, KeyError) as exc:
            raise WeightLoadError(f"{ckpt_name}: {exc}") from exc
        shards = loaded.setdefault(name, set())
        shards.add(shard_id)
        if _complete(shards, shard_ids[name]):
            preparing.complete(name)
    if unexpected:
        shown = ", ".join(unexpected[:10]) + (" ..." if len(unexpected) > 10 else "")
        raise WeightLoadError(f"{len(unexpected)} checkpoint tensors match no model parameter: {shown}")
    missing = []
    for name, ids in shard_ids.items():
        shards = loaded.get(name)
        if not _complete(shards, ids):
            need = set(ids) - (shards or set())
            missing.append(name + (f" (shards {sorted(map(str, need))})" if ids else ""))
    if missing:
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise WeightLoadError(f"{len(missing)} model parameters were not in the checkpoint: {shown}")
    return set(loaded)


def takes_int4_parts(model: nn.Module) -> bool:
    """Whether some layer of `model` takes int4 parts as a checkpoint stored them (a Q4 GGUF's:
    `param.takes_int4_parts`, set by ops/linear.py under int4); only then are they read so."""
    return any(getattr(p, "takes_int4_parts", False) for p in model.parameters())


def _complete(shards: set | None, shard_ids: tuple) -> bool:
    return shards is not None and (None in shards or set(shard_ids) <= shards)


class _Preparation:
    """Which modules with a prepare_weights hook wait on which parameters (by identity: a
    tied LM head holds the embedding's), and which parameter names are done with."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter]):
        self.params = params
        name_of = {id(p): n for n, p in params.items()}
        self.waiting: dict[int, set[str]] = {}        # module id -> its parameters not yet complete
        self.modules: dict[int, nn.Module] = {}
        self.names: dict[int, frozenset[str]] = {}    # module id -> all the parameters it holds
        self.users: dict[str, list[int]] = {}         # parameter name -> modules that hold it
        for module in model.modules():
            if not callable(getattr(module, "prepare_weights", None)):
                continue
            names = {name_of[id(p)] for p in module.parameters(recurse=False) if id(p) in name_of}
            if names:
                self.waiting[id(module)], self.modules[id(module)] = set(names), module
                self.names[id(module)] = frozenset(names)
                for n in names:
                    self.users.setdefault(n, []).append(id(module))
        self.done: set[str] = set()

    def complete(self, name: str) -> None:
        for key in self.users.get(name, ()):
            waiting = self.waiting.get(key)
            if waiting is None:
                continue
            waiting.discard(name)
            if waiting:
                continue
            del self.waiting[key]
            module = self.modules.pop(key)
            module.prepare_weights()
            module.weights_prepared = True  # ops/weights.py's pass after loading skips it
            # every parameter of the module whose holders are all prepared (a weight that
            # was complete before its bias, too): drop our reference, so a replaced copy
            # is freed now, and refuse a second tensor for it
            for held in self.names[key]:
                if all(k not in self.waiting for k in self.users[held]):
                    self.done.add(held)
                    self.params.pop(held, None)


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
