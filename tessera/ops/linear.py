"""Linear layers. Packed layers (QKV, gate-up) load several checkpoint tensors into one
weight, each into its own row range, so one GEMM replaces several."""
from __future__ import annotations

from typing import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.ops.registry import OpTarget, register_op
from tessera.ops.weights import copy_checked, make_param


@register_op("linear", name="torch_linear", priority=0)
def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, target: OpTarget, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = make_param((out_features, in_features), target.dtype, target.device)
        self.bias = make_param((out_features,), target.dtype, target.device) if bias else None
        self._linear = target.op("linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Output rows are the concatenation of named shards, e.g. {"q": 576, "k": 192, "v": 192}.
    A checkpoint may hold each shard separately (shard_id given) or already packed (None)."""

    def __init__(self, in_features: int, shard_sizes: dict[Hashable, int], target: OpTarget,
                 bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), target, bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[Hashable, int] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = offset
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load_shard
                param.shard_ids = tuple(shard_sizes)

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        with torch.no_grad():
            if shard_id is None:  # the checkpoint already stores the packed tensor
                copy_checked(param.data, tensor, "packed weight")
                return
            if shard_id not in self.shard_offsets:
                raise KeyError(f"unknown shard {shard_id!r}; this layer packs {list(self.shard_sizes)}")
            start, size = self.shard_offsets[shard_id], self.shard_sizes[shard_id]
            copy_checked(param.data.narrow(0, start, size), tensor, f"shard {shard_id!r}")

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.shard_sizes.values()), dim=-1)
