"""Layers that keep a recurrent state per sequence between steps (linear attention), and
the Gated DeltaNet core built from the registered conv and delta-rule ops.

The runner finds every `RecurrentLayer`, allocates `state_shapes()` for as many slots as
sequences may run at once and binds them to `state`; the scheduler gives each running
sequence a slot, and the step's metadata says which (AttentionMetadata.state_slots).
Rows come decodes first, as for attention: the decode ops take those one token each, the
prefill ops each remaining sequence's chunk."""
from __future__ import annotations

import math
from abc import ABCMeta, abstractmethod
from typing import Callable

import torch

from tessera.ops.attention.metadata import AttentionMetadata, current_metadata
from tessera.ops.module import OpModule
from tessera.ops.registry import OpTarget

StateShape = tuple[tuple[int, ...], torch.dtype]  # one state tensor's shape per slot, and dtype


class RecurrentLayer(OpModule, metaclass=ABCMeta):
    """Bound by the runner before the first step: one tensor per `state_shapes()` entry,
    each [num_slots, *shape]."""

    state: tuple[torch.Tensor, ...] | None = None

    @abstractmethod
    def state_shapes(self) -> list[StateShape]:
        """Each state tensor's shape for one sequence, and its dtype."""

    def state_bytes_per_slot(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.state_shapes())

    def bound_state(self) -> tuple[AttentionMetadata, tuple[torch.Tensor, ...]]:
        if self.state is None:
            raise RuntimeError(f"{type(self).__name__}: state not bound; the model runner binds it before "
                               "the first step")
        meta = current_metadata()
        if meta.state_slots is None:
            raise RuntimeError("a recurrent layer ran in a step without state slots")
        return meta, self.state

    def by_phase(self, num_rows: int, decode: Callable[[slice, torch.Tensor], torch.Tensor],
                 prefill: Callable[[slice, list[int], list[int], list[bool]], torch.Tensor]) -> torch.Tensor:
        """`decode(rows, slots)` over the decode rows (one token each, their slots as a
        tensor) and `prefill(rows, slots, query lens, fresh)` over the prefill chunks, in
        row order."""
        meta, _ = self.bound_state()
        nd, b = meta.num_decode_tokens, meta.num_decodes
        parts = []
        if nd:
            parts.append(decode(slice(0, nd), meta.state_slots[:nd]))
        if nd < num_rows:
            parts.append(prefill(slice(nd, num_rows), meta.state_slots_list[b:], meta.query_lens_list[b:],
                                 meta.state_fresh_list[b:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class GatedDeltaRule(RecurrentLayer):
    """Causal conv1d + SiLU over the packed [q | k | v] rows, then the gated delta rule
    (ops/linear_attention/delta_rule.py). State: the conv's last K - 1 inputs (model
    dtype) and the [Hv, Dk, Dv] matrix (float32)."""

    def __init__(self, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, target: OpTarget):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear attention: value heads ({num_v_heads}) must be a multiple of key heads "
                             f"({num_k_heads})")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.dtype = target.dtype
        self._conv_decode = target.op("causal_conv1d", phase="decode")
        self._conv_prefill = target.op("causal_conv1d", phase="prefill")
        self._rule_decode = target.op("gated_delta_rule", phase="decode")
        self._rule_prefill = target.op("gated_delta_rule", phase="prefill")

    def state_shapes(self) -> list[StateShape]:
        return [((self.conv_dim, self.conv_kernel - 1), self.dtype),
                ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)]

    def forward(self, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """mixed_qkv: [T, conv_dim]; conv_weight: [conv_dim, K]; g (log decay), beta:
        [T, Hv] float32 -> [T, Hv, Dv] in the model dtype."""
        _, (conv_state, recurrent) = self.bound_state()

        def decode(rows: slice, slots: torch.Tensor) -> torch.Tensor:
            x = self._conv_decode(mixed_qkv[rows], conv_weight, conv_bias, conv_state, slots)
            return self._rule_decode(*self._split(x), g[rows], beta[rows], recurrent, slots)

        def prefill(rows: slice, slots: list[int], lens: list[int], fresh: list[bool]) -> torch.Tensor:
            x = self._conv_prefill(mixed_qkv[rows], conv_weight, conv_bias, conv_state, slots, lens, fresh)
            return self._rule_prefill(*self._split(x), g[rows], beta[rows], recurrent, slots, lens, fresh)

        return self.by_phase(mixed_qkv.shape[0], decode, prefill)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(-1, self.num_k_heads, self.head_k_dim), k.reshape(-1, self.num_k_heads, self.head_k_dim),
                v.reshape(-1, self.num_v_heads, self.head_v_dim))


class GatedShortConv(RecurrentLayer):
    """LFM2's operator: B x through a short causal convolution without activation, gated by
    C (B, C and x: the packed projection's thirds). State: the convolution's last K - 1
    inputs (model dtype)."""

    def __init__(self, channels: int, conv_kernel: int, target: OpTarget):
        super().__init__()
        self.channels, self.conv_kernel, self.dtype = channels, conv_kernel, target.dtype
        self._decode = target.op("short_conv", phase="decode")
        self._prefill = target.op("short_conv", phase="prefill")

    def state_shapes(self) -> list[StateShape]:
        return [((self.channels, self.conv_kernel - 1), self.dtype)]

    def forward(self, bcx: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None) -> torch.Tensor:
        """bcx: [T, 3 * channels] -> [T, channels]."""
        _, (conv_state,) = self.bound_state()

        def decode(rows: slice, slots: torch.Tensor) -> torch.Tensor:
            return self._decode(bcx[rows], conv_weight, conv_bias, conv_state, slots)

        def prefill(rows: slice, slots: list[int], lens: list[int], fresh: list[bool]) -> torch.Tensor:
            return self._prefill(bcx[rows], conv_weight, conv_bias, conv_state, slots, lens, fresh)

        return self.by_phase(bcx.shape[0], decode, prefill)
