"""Token embedding and the LM head (which may share the embedding's weight)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.ops.registry import OpTarget, register_op
from tessera.ops.weights import make_param


@register_op("embedding", name="torch_embedding", priority=0)
def embedding_ref(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(input_ids, weight)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, target: OpTarget):
        super().__init__()
        self.weight = make_param((vocab_size, hidden_size), target.dtype, target.device)
        self._embed = target.op("embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embed(input_ids, self.weight)


class LMHead(nn.Module):
    """Logits for selected rows only (`lm_head_indices`), computed in float32 for sampling."""

    def __init__(self, vocab_size: int, hidden_size: int, target: OpTarget,
                 tied_to: VocabEmbedding | None = None):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight  # same Parameter: loaded once, counted once
        else:
            self.weight = make_param((vocab_size, hidden_size), target.dtype, target.device)
        self._linear = target.op("linear")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden, self.weight, None).float()
