"""Linear layers, replicated or tensor-parallel.

Packed layers (QKV, gate-up) load several checkpoint tensors into one weight, each into its
own row range, so one GEMM replaces several. Under tensor parallelism they are column-
parallel (each rank owns a span of every shard's rows) and the layers after them are
row-parallel (each rank owns the matching input columns; partial outputs are summed over
the ranks). Checkpoint tensors are narrowed to the rank's span before they are read.
"""
from __future__ import annotations

from typing import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.distributed.parallel import HeadSplit, Span, all_reduce, even_span, split_heads
from tessera.ops.linear_int4 import StoredInt4
from tessera.ops.module import OpModule
from tessera.ops.pending_norm import PendingNorm
from tessera.ops.registry import OpTarget, register_op
from tessera.ops.weights import copy_checked, make_param, prepared_param
from tessera.weights.lazy import materialize, narrow


@register_op("linear", name="torch_linear", priority=0)
def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class Linear(OpModule):
    """Replicated: every rank holds the whole weight (routers, small projections).

    `lora` (set by tessera/lora/slots.py when adapters are enabled) adds the adapters' deltas
    of the pass's rows to the output."""

    lora = None  # tessera.lora.layer.LayerLoRA | None

    def __init__(self, in_features: int, out_features: int, target: OpTarget, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = make_param((out_features, in_features), target.dtype, target.device, loader=self._load_whole)
        self.bias = make_param((out_features,), target.dtype, target.device) if bias else None
        self._target = target
        self._select_ops(target.quant)
        # int4: where the loaded rows came from, so parts a checkpoint stored in the format
        # (a Q4 GGUF's) are prepared as they are, not quantized again from the dequantized copy
        self._stored = StoredInt4(out_features) if target.quant == "int4" and self._prepare else None
        self.weight.takes_int4_parts = self._stored is not None  # (weights/loader.py)

    def _select_ops(self, quant: str | None) -> None:
        """The builders for weights in `quant` (the target's, or int8 for a matrix a 4-bit
        GGUF keeps wider; chosen before the weight is prepared)."""
        self._linear = self._target.op("linear", quant=quant)
        self._prepare = self._target.prepare("linear", quant=quant)
        # a layer's input norm computed while this linear loads its input (PendingNorm), on
        # the weight as loaded (not a layout prepared for another builder)
        self._norm_linear = (self._target.optional_op("rms_norm_linear", quant=quant)
                             if self._prepare is None else None)

    def _load_whole(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        with torch.no_grad():
            copy_checked(param.data, tensor, getattr(param, "tessera_name", "linear weight"))
        self._note_rows(0, tensor, (0, self.out_features), (0, self.in_features))

    def _note_rows(self, start: int, tensor: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """Rows [start, start + rows[1]) of the weight were loaded from `tensor`'s rows and
        cols (each (first, length))."""
        if self._stored is not None:
            self._stored.note(start, tensor, rows, cols)

    def prepare_weights(self) -> None:
        """After loading: hand the weight to the builder's preferred layout (once)."""
        stored = self._stored.parts() if self._stored is not None else None
        if self._stored is not None and self._stored.wider:
            # the file keeps (part of) this matrix at 5.5-8 bits where most are 4-bit (llama.cpp's
            # K-quant mixes keep attn_v and ffn_down so): int8 holds that, int4 would lose it
            self._select_ops("int8")
        self._stored = None
        self.weight = prepared_param(self.weight, self._prepare if stored is None
                                     else lambda weight: self._prepare(weight, stored=stored))

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if isinstance(x, PendingNorm):  # fused where a builder does both (not with LoRA: it reads the rows)
            if self._norm_linear is not None and self.lora is None and x.fusable:
                return x.through(self._norm_linear, self.weight, self.bias)
            x = x.rows()
        out = self._linear(x, self.weight, self.bias)
        return out if self.lora is None else self.lora(x, out)

    @property
    def fuses_input_norm(self) -> bool:
        """Whether a PendingNorm given to this layer is computed by one op with it."""
        return self._norm_linear is not None


class RowParallelLinear(Linear):
    """Input columns split over the ranks (`in_span`, default a near-even split); each rank's
    partial product is summed by all-reduce. The bias is added once, on rank 0."""

    def __init__(self, in_features: int, out_features: int, target: OpTarget, bias: bool = False,
                 in_span: Span | None = None):
        span = in_span or even_span(in_features, target.tp_rank, target.tp_size)
        super().__init__(span.size, out_features, target, bias)
        self.in_span, self.tp_size, self.full_in_features = span, target.tp_size, in_features
        self.add_bias = target.tp_rank == 0
        self.weight.weight_loader = self._load_weight

    def _select_ops(self, quant: str | None) -> None:
        super()._select_ops(quant)
        # a gated MLP's activation applied while this layer loads its input (gated())
        self._gated = self._target.optional_op("gated_linear", quant=quant)

    def _load_weight(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        expected = (self.out_features, self.full_in_features)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model shape {expected}")
        with torch.no_grad():
            copy_checked(param.data, narrow(tensor, 1, self.in_span.start, self.in_span.size),
                         "row-parallel weight")
        self._note_rows(0, tensor, (0, self.out_features), (self.in_span.start, self.in_span.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(x, self.weight, self.bias if self.add_bias else None)
        if self.lora is not None:  # each rank's partial delta (its input columns of A) is
            out = self.lora(x, out)  # summed by the all-reduce with the partial product
        return all_reduce(out, self.tp_size)

    def gated(self, act: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """self(act(gate_up)) for a gated MLP's activation module (`act.kind`: SiluAndMul,
        GeluTanhAndMul): in one op where a builder applies the activation while loading its
        input (CUDA, unquantized; not with LoRA on this layer, whose delta reads the
        activation), else the activation's op, then this layer."""
        kind = getattr(act, "kind", None)
        if self._gated is None or self.lora is not None or kind is None:
            return self(act(gate_up))
        return all_reduce(self._gated(gate_up, self.weight, self.bias if self.add_bias else None, kind),
                          self.tp_size)


class PackedLinear(Linear):
    """Output rows are the concatenation of named shards, e.g. {"q": 576, "k": 192, "v": 192}
    (full sizes). Column-parallel: this rank holds rows `shard_spans[id]` of each shard
    (default a near-even split of each). A checkpoint may hold each shard separately
    (shard_id given) or already packed in the same order (None)."""

    def __init__(self, in_features: int, shard_sizes: dict[Hashable, int], target: OpTarget,
                 bias: bool = False, shard_spans: dict[Hashable, Span] | None = None):
        spans = shard_spans or {k: even_span(n, target.tp_rank, target.tp_size)
                                for k, n in shard_sizes.items()}
        super().__init__(in_features, sum(s.size for s in spans.values()), target, bias)
        self.full_sizes = dict(shard_sizes)
        self.spans = spans
        self.shard_sizes = {k: s.size for k, s in spans.items()}  # this rank's rows per shard
        self.shard_offsets: dict[Hashable, int] = {}
        offset = 0
        for shard_id, size in self.shard_sizes.items():
            self.shard_offsets[shard_id] = offset
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load_shard
                param.shard_ids = tuple(shard_sizes)

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        with torch.no_grad():
            if shard_id is None:  # the checkpoint already stores the packed tensor
                expected = (sum(self.full_sizes.values()), *param.shape[1:])
                if tuple(tensor.shape) != expected:
                    raise ValueError(f"packed weight: checkpoint shape {tuple(tensor.shape)} != model "
                                     f"shape {expected} (shards {self.full_sizes})")
                start = 0
                for sid, full in self.full_sizes.items():
                    self._copy_rows(param, tensor, sid, first=start)
                    start += full
                return
            if shard_id not in self.shard_offsets:
                raise KeyError(f"unknown shard {shard_id!r}; this layer packs {list(self.shard_sizes)}")
            self._copy_rows(param, tensor, shard_id)

    def _copy_rows(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable,
                   first: int | None = None) -> None:
        """Shard `shard_id`'s rows of this rank from `tensor`, which holds that shard alone, or
        (`first` given) the packed shards, that one's rows from row `first` on."""
        span = self.spans[shard_id]
        expected = (self.full_sizes[shard_id], *param.shape[1:])
        if first is None and tuple(tensor.shape) != expected:
            raise ValueError(f"shard {shard_id!r}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {expected}")
        copy_checked(param.data.narrow(0, self.shard_offsets[shard_id], span.size),
                     narrow(tensor, 0, (first or 0) + span.start, span.size), f"shard {shard_id!r}")
        if param is self.weight:
            self._note_rows(self.shard_offsets[shard_id], tensor, ((first or 0) + span.start, span.size),
                            (0, self.in_features))

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.shard_sizes.values()), dim=-1)


# a checkpoint tensor's layout: (groups, ((our shard, rows per group), ...)); the tensor is
# groups x (the parts' rows, in order)
Layout = tuple[int, tuple[tuple[Hashable, int], ...]]


class RegroupedLinear(PackedLinear):
    """A PackedLinear that also takes checkpoint tensors of `layouts` (by the checkpoint's
    shard id; None: a tensor holding every part), whose parts interleave per group (of
    heads): loaded, each part goes to its own shard. LoRA adapters' B factors of such a
    tensor are regrouped the same way (lora/adapter.py)."""

    def __init__(self, in_features: int, shard_sizes: dict[Hashable, int], target: OpTarget,
                 layouts: dict[Hashable, Layout], checkpoint_shards: tuple[Hashable, ...],
                 shard_spans: dict[Hashable, Span] | None = None, bias: bool = False):
        """`checkpoint_shards`: the shard ids that together complete the weight (None, a
        whole tensor, completes it too)."""
        super().__init__(in_features, shard_sizes, target, bias=bias, shard_spans=shard_spans)
        self.layouts = layouts
        for param in (self.weight, self.bias):
            if param is not None:
                param.shard_ids = checkpoint_shards

    def checkpoint_rows(self, shard_id: Hashable) -> int:
        """The rows of a checkpoint tensor of a regrouped shard."""
        groups, parts = self.layouts[shard_id]
        return groups * sum(size for _, size in parts)

    def split_checkpoint_rows(self, shard_id: Hashable, tensor: torch.Tensor) -> list[tuple[Hashable, torch.Tensor]]:
        """A regrouped shard's checkpoint rows as (our shard, its rows), in order."""
        groups, parts = self.layouts[shard_id]
        tensor = materialize(tensor)
        if tensor.shape[0] != self.checkpoint_rows(shard_id):
            raise ValueError(f"{shard_id!r}: checkpoint rows {tensor.shape[0]} != {self.checkpoint_rows(shard_id)}")
        grouped = tensor.reshape(groups, -1, *tensor.shape[1:])
        out, start = [], 0
        for part, size in parts:
            out.append((part, grouped[:, start:start + size].reshape(groups * size, *tensor.shape[1:])))
            start += size
        return out

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        if shard_id not in self.layouts:
            super()._load_shard(param, tensor, shard_id)
            return
        with torch.no_grad():
            for part, rows in self.split_checkpoint_rows(shard_id, tensor):
                rows.stored_wider = getattr(tensor, "stored_wider", False)  # (how the file kept it)
                self._copy_rows(param, rows, part)


class QKVLinear(PackedLinear):
    """The packed Q/K/V projection. Under tensor parallelism a rank owns whole KV-head groups
    (or one replicated KV head and part of its query heads); `heads` says which, and
    `o_proj_span` is the matching input span of the output projection."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 target: OpTarget, bias: bool = False, values: bool = True):
        """`values` False: Q and K only; split() returns the keys as the values too (Gemma 4's
        attention_k_eq_v layers have no v_proj)."""
        heads: HeadSplit = split_heads(num_heads, num_kv_heads, target.tp_rank, target.tp_size)
        q, kv = heads.q, heads.kv
        kv_span = Span(kv.start * head_dim, kv.size * head_dim)
        parts = ("k", "v") if values else ("k",)
        super().__init__(hidden_size, {"q": num_heads * head_dim, **{p: num_kv_heads * head_dim for p in parts}},
                         target, bias, shard_spans={"q": Span(q.start * head_dim, q.size * head_dim),
                                                    **{p: kv_span for p in parts}})
        self.values = values
        self.heads = heads
        self.num_heads, self.num_kv_heads = q.size, kv.size  # this rank's
        self.o_proj_span = Span(q.start * head_dim, q.size * head_dim)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v); v is k where the layer has no values of its own."""
        parts = super().split(out)
        return parts if self.values else (*parts, parts[1])
