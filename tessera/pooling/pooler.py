"""Pooling a step's hidden states into each prompt's embedding.

A prompt may take several steps (chunked prefill), so each sequence keeps what its chunks
have contributed so far (PoolingState): the running float32 sum for MEAN, the first row for
CLS; LAST needs only the final chunk. A chunk starting at position 0 starts over (the
sequence was preempted and is being recomputed)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.pooling.config import PoolerConfig
from tessera.pooling.params import PoolingParams


@dataclass(eq=False)
class PoolingState:
    params: PoolingParams
    every_row: bool = False  # the pooling reads every prompt position (no cached prefix then)
    bidirectional: bool = False  # an encoder's prompt: computed in one step, attending to itself whole
    token_type_ids: list[int] | None = None  # a text pair's segments (TokenTypedPrompt)
    partial: torch.Tensor | None = None  # MEAN: sum of the rows so far; CLS: the first row


@dataclass
class PoolingRows:
    """A pooling sequence's rows in one step: token rows [first_row, first_row + count),
    prompt positions [start, start + count), and whether they end its prompt."""

    seq: object  # tessera.engine.sequence.Sequence (its `pooling` state is updated)
    first_row: int
    start: int
    count: int
    ends_prompt: bool = False


@dataclass
class Pooler:
    config: PoolerConfig

    def pool(self, hidden: torch.Tensor, rows: list[PoolingRows]) -> list[tuple[object, torch.Tensor]]:
        """Fold a step's rows into their sequences' states; returns (sequence, embedding on
        the step's device) for each whose prompt this step finished."""
        kind = self.config.pooling_type
        if kind == "MEAN":
            sums = self._segment_sums(hidden, rows)
        done = []
        for i, r in enumerate(rows):
            state = r.seq.pooling
            if r.start == 0:
                state.partial = None
            if kind == "MEAN":
                state.partial = sums[i] if state.partial is None else state.partial + sums[i]
            elif kind == "CLS" and r.start == 0:
                state.partial = hidden[r.first_row].float()
            if not r.ends_prompt:
                continue
            if kind == "LAST":
                vector = hidden[r.first_row + r.count - 1].float()
            elif kind == "MEAN":
                vector = state.partial / (r.start + r.count)
            else:
                vector = state.partial
            state.partial = None
            done.append((r.seq, self.finish(vector, state.params)))
        return done

    @staticmethod
    def _segment_sums(hidden: torch.Tensor, rows: list[PoolingRows]) -> torch.Tensor:
        """Per entry of `rows`, the float32 sum of its hidden rows: one index_add for the step."""
        index = torch.cat([torch.arange(r.first_row, r.first_row + r.count) for r in rows]).to(hidden.device)
        owner = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([r.count for r in rows]))
        sums = torch.zeros(len(rows), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        return sums.index_add_(0, owner.to(hidden.device), hidden.index_select(0, index).float())

    def finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """Matryoshka truncation first, then normalization: the shorter vector is unit
        length, as OpenAI's `dimensions` and vLLM return it."""
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return F.normalize(vector, dim=-1) if normalize else vector
