"""Per-step attention metadata, installed for the duration of one forward pass.

Rows are ordered decodes first: the first `num_decodes` sequences contribute exactly one
query token each (batched together); the rest are prefill chunks of any length, which may
follow already-cached context (chunked prefill, prefix caching).
"""
from __future__ import annotations

from bisect import bisect_right
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [num_tokens] cache slot per token; -1 = do not write
    block_tables: torch.Tensor       # [num_seqs, max_blocks] block ids (padded with 0)
    seq_lens: torch.Tensor           # [num_seqs] context length including this step's tokens
    query_start_loc: torch.Tensor    # [num_seqs + 1] offsets of each sequence's tokens
    num_decodes: int                 # leading sequences with exactly one query token
    num_decode_tokens: int           # == num_decodes (kept separate for padded graphs)
    seq_lens_list: list[int]         # host copies: no device syncs inside layers
    query_lens_list: list[int]
    has_padding: bool = False        # some slot is -1 (padded graph rows)
    # [prefill tokens] the last key position each prefill row sees, when some row sees past
    # its own (the tokens of one image attend to each other: Gemma 3); None: causal
    key_limits: torch.Tensor | None = None
    # recurrent layers (linear attention, tessera/ops/linear_attention/): each sequence's
    # state slot, and whether its state starts from zero this step (its first computed
    # token is position 0: a new or preempted sequence); None in models without them
    state_slots: torch.Tensor | None = None   # [num_seqs] int64
    state_slots_list: list[int] | None = None
    state_fresh_list: list[bool] | None = None
    # the rows whose final hidden states are read (the LM head's), on the device and the
    # host; None: all of them. A model may skip what only the other rows need (Gemma 4's
    # KV-shared layers, which write no cache, run for these rows alone)
    output_rows: torch.Tensor | None = None
    output_rows_list: list[int] | None = None
    # a step padded to a captured graph's rows (StaticDecodeInputs): int64 [1], how many
    # leading rows are real, filled before each replay; None: all. Mixture layers skip the
    # padded rows' experts (weights each of them would fetch for nothing)
    live_rows: torch.Tensor | None = None
    # (block_size, sliding_window) -> (tables, mask); a dict because layers may differ in
    # window (gemma2 alternates), and each variant is built once per step
    _decode_views: dict = field(default_factory=dict, repr=False)
    _decode_int32: tuple | None = field(default=None, repr=False)
    _prefill_int32: tuple | None = field(default=None, repr=False)
    _causal: "AttentionMetadata | None" = field(default=None, repr=False)
    _ahead: dict = field(default_factory=dict, repr=False)  # lookahead -> metadata (within_lookahead)

    def causal(self) -> "AttentionMetadata":
        """This step's metadata without key limits (layers that keep images causal: Gemma 4's
        full layers), built once per step; the per-step caches are shared."""
        if self.key_limits is None:
            return self
        if self._causal is None:
            self._causal = replace(self, key_limits=None, _causal=None, _ahead={})
        return self._causal

    def within_lookahead(self, lookahead: int) -> "AttentionMetadata":
        """This step's metadata with each prefill row's key limit at most `lookahead` past
        its own position: with a window behind, a window on both sides (ModernBERT's local
        layers in an encoder's prompt). Without key limits rows are causal, which already
        stays within; built once per step and lookahead, sharing the per-step caches."""
        if self.key_limits is None:
            return self
        if lookahead not in self._ahead:
            own = torch.cat([torch.arange(n - q, n) for n, q in
                             zip(self.seq_lens_list[self.num_decodes:], self.query_lens_list[self.num_decodes:])])
            limits = torch.minimum(self.key_limits, own.to(self.key_limits) + lookahead)
            self._ahead[lookahead] = replace(self, key_limits=limits, _causal=None, _ahead={})
        return self._ahead[lookahead]

    def decode_view(self, block_size: int,
                    sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables cut to the longest decode, key mask [B, 1, 1, L]); computed once
        per step and shared by every layer. With `sliding_window` w, the query at position
        p = seq_len - 1 sees only keys in (p - w, p] (transformers' sliding-window mask)."""
        key = (block_size, sliding_window)
        if key not in self._decode_views:
            b = self.num_decodes
            max_len = max(self.seq_lens_list[:b])
            max_blocks = (max_len + block_size - 1) // block_size
            tables = self.block_tables[:b, :max_blocks]
            positions = torch.arange(max_blocks * block_size, device=tables.device).unsqueeze(0)
            lens = self.seq_lens[:b].unsqueeze(1)
            mask = positions < lens
            if sliding_window is not None:
                mask &= positions >= lens - sliding_window
            self._decode_views[key] = (tables, mask.view(b, 1, 1, -1))
        return self._decode_views[key]

    def decode_int32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables, seq lens) of the decode rows as contiguous int32, what the C decode
        kernel reads; converted once per step, not once per layer."""
        if self._decode_int32 is None:
            b = self.num_decodes
            self._decode_int32 = (self.block_tables[:b].to(torch.int32).contiguous(),
                                  self.seq_lens[:b].to(torch.int32).contiguous())
        return self._decode_int32

    def prefill_int32(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block tables, seq lens, query starts from 0) of the prefill rows as contiguous
        int32, what the C prefill kernel reads; converted once per step, not once per layer."""
        if self._prefill_int32 is None:
            b = self.num_decodes
            starts = self.query_start_loc[b:self.num_seqs + 1]
            self._prefill_int32 = (self.block_tables[b:].to(torch.int32).contiguous(),
                                   self.seq_lens[b:].to(torch.int32).contiguous(),
                                   (starts - starts[0]).to(torch.int32).contiguous())
        return self._prefill_int32

    def rows_as_decodes(self) -> "AttentionMetadata":
        """Metadata for the output rows alone, each a decode: one query over its sequence's
        cache up to its own position (every key of this step is written already). For
        layers that read the cache and write none; without key limits (rows that see past
        themselves are not decodes)."""
        if self.output_rows is None or self.key_limits is not None:
            raise ValueError("rows_as_decodes needs output rows and no key limits")
        starts = [0]
        for n in self.query_lens_list:
            starts.append(starts[-1] + n)
        seqs, lens = [], []
        for row in self.output_rows_list:
            s = bisect_right(starts, row) - 1
            seqs.append(s)
            lens.append(self.seq_lens_list[s] - (starts[s + 1] - 1 - row))
        device, n = self.seq_lens.device, len(seqs)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.index_select(0, self.output_rows),
            block_tables=self.block_tables.index_select(0, torch.tensor(seqs, device=device)),
            seq_lens=torch.tensor(lens, dtype=self.seq_lens.dtype, device=device),
            query_start_loc=torch.arange(n + 1, dtype=self.query_start_loc.dtype, device=device),
            num_decodes=n, num_decode_tokens=n, seq_lens_list=lens, query_lens_list=[1] * n,
            has_padding=self.has_padding)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


_current: list[AttentionMetadata] = []


@contextmanager
def attention_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Scope `metadata` to one forward pass; nested or leaked contexts are impossible."""
    _current.append(metadata)
    try:
        yield
    finally:
        _current.pop()


def live_rows_buffer(rows: int) -> torch.Tensor | None:
    """The current step's live_rows where a step of `rows` rows is padded to a graph's (no
    context, or a pass over other rows: None)."""
    if not _current or _current[-1].live_rows is None or _current[-1].slot_mapping.shape[0] != rows:
        return None
    return _current[-1].live_rows


def one_token_per_sequence() -> bool:
    """Whether the current step computes one token for each of its sequences (a decode step:
    no prompt's rows, no draft tokens to verify); True outside a step (an op called alone).
    The step is the outermost context, the runner's: a model's narrower view inside it (Gemma
    4's output rows as decodes) does not change what the step is. The CPU int8 / int4 GEMMs
    round x to 8 bits only in such steps (ops/cpu/linear_int4.py)."""
    return not _current or _current[0].num_decodes == _current[0].num_seqs


def current_metadata() -> AttentionMetadata:
    if not _current:
        raise RuntimeError("attention called outside attention_context(); the runner installs it")
    return _current[-1]
