"""Reading a PEFT LoRA adapter folder and checking it against the model it will run on.

A LoRA adapter adds `scale * B @ A` to some linear layers' weights, A [r, in] and B [out, r]
of a small rank r, scale = lora_alpha / r (or / sqrt(r) with rsLoRA). The folder holds
adapter_config.json and adapter_model.safetensors with tensors named like
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. Names map onto our layers
the way checkpoint weights do (q_proj -> shard "q" of qkv_proj), so an adapter trained on
the Hugging Face model runs on ours, whatever format the base weights came in.

Everything an adapter can hold that we would not apply is refused with the reason, never
skipped: DoRA, bias training, modules_to_save (whole replaced layers), adapters on
embeddings or the LM head, ranks over the configured maximum.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable

import torch
from safetensors.torch import load as load_bytes, load_file, save as save_bytes
from torch import nn

from tessera.ops.linear import Linear, PackedLinear, RegroupedLinear, RowParallelLinear
from tessera.weights.loader import checkpoint_target, model_tensor_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# adapter_config.json keys that, set (not null / false / empty / "none"), change what the
# adapter computes in ways we do not build
_UNSUPPORTED_SETTINGS = ("use_dora", "fan_in_fan_out", "bias", "modules_to_save", "layer_replication",
                         "lora_bias", "trainable_token_indices", "megatron_config", "target_parameters",
                         "alora_invocation_tokens", "use_qalora", "use_bdlora", "arrow_config",
                         "kasa_config", "monteclora_config")
_key_ids = itertools.count(1)


class LoRAAdapterError(ValueError):
    """The adapter cannot be served on this model; the message says why."""


@dataclass
class LoRAPair:
    """One target's factors, whole (not split for tensor parallelism): a [r, in], b [out, r],
    with the scale already folded into b."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """A loaded adapter: per layer of ours (module name), its factors per packed shard (None
    for an unpacked layer). `key` is unique per load: the prefix cache salts block hashes
    with it, so a reloaded adapter never reuses KV computed by the old one."""

    name: str
    path: str
    rank: int
    weights: dict[str, dict[Hashable, LoRAPair]]
    key: int = field(default_factory=lambda: next(_key_ids))
    wire: bytes | None = field(default=None, repr=False)  # adapter_to_bytes, once (TP)

    @property
    def num_bytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
                   for shards in self.weights.values() for p in shards.values())


def adapter_to_bytes(adapter: LoRAAdapter) -> bytes:
    """The adapter as it is loaded (safetensors bytes), for other tensor-parallel ranks:
    they take exactly the driver's factors instead of reading the folder again."""
    if adapter.wire is None:  # every slot load sends it again: serialise once
        tensors = {json.dumps([layer, shard, half]): getattr(pair, half)
                   for layer, shards in adapter.weights.items() for shard, pair in shards.items()
                   for half in ("a", "b")}
        adapter.wire = save_bytes(tensors, metadata={"name": adapter.name, "path": adapter.path,
                                                     "rank": str(adapter.rank), "key": str(adapter.key)})
    return adapter.wire


def adapter_from_bytes(data: bytes) -> LoRAAdapter:
    """adapter_to_bytes, undone."""
    tensors = load_bytes(data)
    weights: dict[str, dict[Hashable, LoRAPair]] = {}
    halves: dict[tuple, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, shard, half = json.loads(key)
        halves.setdefault((layer, shard), {})[half] = tensor
    for (layer, shard), pair in halves.items():
        weights.setdefault(layer, {})[shard] = LoRAPair(pair["a"], pair["b"])
    meta = _metadata(data)
    return LoRAAdapter(meta["name"], meta["path"], int(meta["rank"]), weights, key=int(meta["key"]))


def _metadata(data: bytes) -> dict[str, str]:
    """A safetensors buffer's metadata: the JSON header after its 8-byte length."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]).get("__metadata__", {})


def load_adapter(name: str, path: str | Path, model: nn.Module, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check the adapter in folder `path` for `model` (a tessera model). The
    factors are kept in `dtype` (the model's: what the slots hold), scaled in float32."""
    folder = adapter_folder(path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {str(folder)!r} is not a directory")
    config = _read_config(name, folder)
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        other = "; it has adapter_model.bin: convert it to safetensors" if (folder / "adapter_model.bin").exists() else ""
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {folder} has no {WEIGHTS_FILE}{other}")
    tensors = load_file(str(weights_file))
    factors = _pair_factors(name, tensors)
    if not factors:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    weights: dict[str, dict[Hashable, LoRAPair]] = {}
    for module_name, (a, b) in sorted(factors.items()):
        ours = model_tensor_name(model, module_name)
        if ours is None:  # e.g. a vision tower not served
            continue
        refusal = getattr(model, "lora_refusal", lambda _: None)(ours)
        if refusal is not None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module_name}: {refusal}")
        layer_name, shard, layer = _target_layer(name, model, module_name)
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: rank {rank} of {module_name} exceeds "
                                   f"max_lora_rank {max_rank} (raise --max-lora-rank)")
        if b.shape[1] != rank:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module_name} lora_B has shape "
                                   f"{tuple(b.shape)}, expected [out, {rank}]")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module_name} holds NaN or infinite values")
        in_features, out_features = full_shape(layer, shard)
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {module_name} has factors of shapes {tuple(a.shape)} and "
                f"{tuple(b.shape)}, but the model's layer is {in_features} -> {out_features}; "
                "was it trained for another base model?")
        scale = _scale(config, module_name, rank)
        a, b = a.to(dtype).contiguous(), (b.float() * scale).to(dtype)
        # a checkpoint tensor whose parts interleave per head group: B's rows too
        parts = (layer.split_checkpoint_rows(shard, b) if isinstance(layer, RegroupedLinear) and shard in layer.layouts
                 else [(shard, b)])
        for i, (part, rows) in enumerate(parts):  # (A copied: shards are serialised apart for other ranks)
            weights.setdefault(layer_name, {})[part] = LoRAPair(a.clone() if i else a, rows.contiguous())
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: it adapts no layer of the model tessera serves "
                               f"(only modules such as {min(factors)}, which it does not run)")
    rank = max(p.rank for shards in weights.values() for p in shards.values())
    return LoRAAdapter(name, str(folder), rank, weights)


def adapter_folder(path: str | Path) -> Path:
    """How an adapter's folder is recorded (its `path`): absolute, since tensor-parallel
    ranks load it again later, whatever the working directory is by then."""
    return Path(path).expanduser().absolute()


def _read_config(name: str, folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {folder} has no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LoRA")
    for key in _UNSUPPORTED_SETTINGS:
        value = config.get(key)
        if value not in (None, False, "none") and value != [] and value != {}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key}={value!r} is not supported")
    if "lora_alpha" not in config or "r" not in config:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} needs r and lora_alpha")
    return config


def _pair_factors(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name without PEFT's prefix: (A, B)}; every tensor must be one of a pair."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if match is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A/lora_B "
                                   "weight (embedding adapters, biases and saved modules are not supported)")
        module = match.group(1).removeprefix(PEFT_PREFIX)
        if tensor.dim() != 2:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key} has {tensor.dim()} dimensions, expected 2")
        halves.setdefault(module, {})[match.group(2)] = tensor
    out = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} has no {missing} weight")
        out[module] = (pair["A"], pair["B"])
    return out


def _target_layer(name: str, model: nn.Module, module_name: str) -> tuple[str, Hashable, Linear]:
    """(our layer's name, shard id, layer) for the Hugging Face module an adapter targets."""
    param_name, shard = checkpoint_target(model, module_name + ".weight")
    layer_name = param_name.removesuffix(".weight")
    try:
        layer = model.get_submodule(layer_name)
    except AttributeError:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: targets {module_name}, which this model "
                               "does not have") from None
    if not isinstance(layer, Linear) or (shard is not None and not isinstance(layer, PackedLinear)):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {module_name} is a {type(layer).__name__}; "
                               "adapters can target the attention and MLP projections only")
    return layer_name, shard, layer


def full_shape(layer: Linear, shard: Hashable) -> tuple[int, int]:
    """(in, out) of the target as the Hugging Face model has it (whole: one shard of a packed
    layer, or all of them where the checkpoint packs them too, shard None, as Phi-3's qkv_proj)."""
    in_features = layer.full_in_features if isinstance(layer, RowParallelLinear) else layer.in_features
    if isinstance(layer, RegroupedLinear) and shard in layer.layouts:
        return in_features, layer.checkpoint_rows(shard)
    if isinstance(layer, PackedLinear):
        return in_features, layer.full_sizes[shard] if shard is not None else sum(layer.full_sizes.values())
    out_features = layer.out_features
    return in_features, out_features


def _scale(config: dict, module_name: str, rank: int) -> float:
    """lora_alpha / r (rsLoRA: / sqrt(r)), with PEFT's per-module alpha_pattern overrides
    (keys are patterns matched against the end of the module's name)."""
    alpha = config["lora_alpha"]
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
