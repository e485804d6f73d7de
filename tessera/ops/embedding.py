"""Token embedding and the LM head (which may share the embedding's weight).

Vocab-parallel under tensor parallelism: each rank holds an equal chunk of vocabulary rows
(the last one zero-padded). The embedding looks up the ids in its chunk and the ranks'
rows are summed; the LM head computes its chunk's logits and the chunks are gathered.
"""
from __future__ import annotations

from typing import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.distributed.parallel import all_gather_last, all_reduce, padded_span
from tessera.ops.linear_int4 import lm_head_quantization
from tessera.ops.module import OpModule
from tessera.ops.registry import OpTarget, register_op
from tessera.ops.weights import copy_checked, make_param, prepared_param
from tessera.weights.lazy import narrow


ROW_SLICE_ELEMENTS = 1 << 24  # a vocabulary table loads 64 MiB of float32 at a time


@register_op("embedding", name="torch_embedding", priority=0)
def embedding_ref(input_ids: torch.Tensor, weight: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """weight[input_ids], times `scale` if given (computed in float32 for a bf16 table, as
    torch multiplies a tensor by a Python float)."""
    rows = F.embedding(input_ids, weight)
    return rows if scale is None else rows * scale


def _vocab_rows_param(vocab_size: int, hidden_size: int, target: OpTarget) -> nn.Parameter:
    span = padded_span(vocab_size, target.tp_rank, target.tp_size)
    owned = max(0, min(span.end, vocab_size) - span.start)  # real rows; the rest is padding

    def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: Hashable = None) -> None:
        if tuple(tensor.shape) != (vocab_size, hidden_size):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model shape {(vocab_size, hidden_size)}")
        # in slices of rows: a lazy table (a GGUF's, read by rows) never lies whole in float32
        step = max(1, ROW_SLICE_ELEMENTS // hidden_size)
        with torch.no_grad():
            for lo in range(0, owned, step):
                n = min(step, owned - lo)
                copy_checked(param.data[lo:lo + n], narrow(tensor, 0, span.start + lo, n), "vocabulary rows")
            param.data[owned:].zero_()

    param = make_param((span.size, hidden_size), target.dtype, target.device, loader=load)
    param.vocab_start = span.start
    return param


class VocabEmbedding(OpModule):
    def __init__(self, vocab_size: int, hidden_size: int, target: OpTarget, scale: float | None = None):
        """`scale`: every row is multiplied by it (Gemma's sqrt(hidden_size)), in the same op."""
        super().__init__()
        self.weight = _vocab_rows_param(vocab_size, hidden_size, target)
        self.tp_size = target.tp_size
        self.scale = scale
        self._embed = target.op("embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._embed(input_ids, self.weight, self.scale)
        local = input_ids - self.weight.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = self._embed(local.masked_fill(outside, 0), self.weight, self.scale)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp_size)


class LMHead(OpModule):
    """Logits for selected rows only (`lm_head_indices`), computed in float32 for sampling;
    with several ranks every rank ends up with the full row (all-gathered)."""

    def __init__(self, vocab_size: int, hidden_size: int, target: OpTarget,
                 tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight  # same Parameter: loaded once, counted once
        else:
            self.weight = _vocab_rows_param(vocab_size, hidden_size, target)
        self.vocab_size, self.tp_size = vocab_size, target.tp_size
        self.hidden_size, self.input_dtype = hidden_size, target.dtype  # (what it takes, whatever its layout)
        quant = lm_head_quantization(target.quant)
        self._linear = target.op("linear", quant=quant)
        self._prepare = target.prepare("linear", quant=quant)

    def prepare_weights(self) -> None:
        """After loading: the linear builder's layout. A tied head gets its own prepared
        copy when the layout changes; the embedding keeps its rows."""
        self.weight = prepared_param(self.weight, self._prepare)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._linear(hidden, self.weight, None).float()
        if self.tp_size == 1:
            return logits
        return all_gather_last(logits, self.tp_size)[..., :self.vocab_size]
