"""What captured decode graphs (CPU kernel graphs, CUDA graphs) share: the limits a graph
must cover and the static input buffers its steps are copied into.

A graph reads the same addresses every replay, so a decode step's inputs are copied into
buffers sized once (for the largest bucket and the longest sequence), padded up to the
step's bucket: padded rows read token 0 at position 0, write no KV (slot -1) and attend
over one cached token of block 0 (zeroed by the runner); their outputs are discarded.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from tessera.ops.attention import AttentionMetadata
from tessera.runner.inputs import ModelInputs


@dataclass(frozen=True)
class GraphLimits:
    max_rows: int       # the most rows a decode step can have (max_num_seqs, times 1 + k
                        # with k speculative tokens: each verified draft is a row)
    max_model_len: int  # the longest sequence: block tables are this wide


class StaticDecodeInputs:
    def __init__(self, buckets: tuple[int, ...], limits: GraphLimits, block_size: int,
                 device: torch.device, state_pad_slot: int | None = None):
        """`state_pad_slot`: for a model with recurrent layers, the state slot padded rows
        read and write (one no sequence holds), so a padded step leaves the others' states
        as they were."""
        self.buckets = buckets
        self.limits = limits
        size = buckets[-1]
        self.table_width = -(-limits.max_model_len // block_size)
        zeros = dict(dtype=torch.int64, device=device)
        self.ids = torch.zeros(size, **zeros)
        self.positions = torch.zeros(size, **zeros)
        self.slots = torch.full((size,), -1, **zeros)
        self.tables = torch.zeros((size, self.table_width), dtype=torch.int32, device=device)
        self.lens = torch.ones(size, dtype=torch.int32, device=device)
        self.starts = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.lora_slots = torch.full((size,), -1, dtype=torch.int32, device=device)  # -1: base model
        self.live = torch.zeros(1, dtype=torch.int64, device=device)  # the step's real rows (live_rows)
        self.state_pad_slot = state_pad_slot
        self.state_slots = None if state_pad_slot is None else torch.full((size,), state_pad_slot, **zeros)
        self._lora_slots_set = False  # whether rows may hold slots from an adapter step

    def bucket_for(self, inputs: ModelInputs) -> int | None:
        """The bucket a step runs in, or None when no graph can run it (prefill rows, more
        rows than the largest bucket, a block table wider than the buffers)."""
        meta = inputs.attn
        rows = inputs.input_ids.shape[0]
        if meta.num_decodes != rows or rows > self.buckets[-1] or meta.block_tables.shape[1] > self.table_width:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, rows)]

    def fill(self, inputs: ModelInputs, bucket: int) -> None:
        meta = inputs.attn
        rows = inputs.input_ids.shape[0]
        self.ids[:rows].copy_(inputs.input_ids)
        self.positions[:rows].copy_(inputs.positions)
        self.slots[:rows].copy_(meta.slot_mapping)
        self.tables[:rows, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.lens[:rows].copy_(meta.seq_lens)
        self.live.fill_(rows)
        if self.state_slots is not None:
            self.state_slots[:rows].copy_(meta.state_slots)
        if inputs.lora_row_slots is not None:
            self.lora_slots[:rows].copy_(inputs.lora_row_slots)
            self._lora_slots_set = True
        elif self._lora_slots_set:  # (without adapters, or after base steps, nothing to reset)
            self.lora_slots.fill_(-1)
            self._lora_slots_set = False
        if bucket > rows:  # rows left over from a larger step
            self.pad(rows, bucket)

    def pad(self, start: int, end: int) -> None:
        self.ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = -1
        self.tables[start:end, 0] = 0
        self.lens[start:end] = 1
        if self.state_slots is not None:
            self.state_slots[start:end] = self.state_pad_slot
        if self._lora_slots_set:
            self.lora_slots[start:end] = -1

    def metadata(self, bucket: int, seq_lens_list: list[int]) -> AttentionMetadata:
        """Metadata over the buffers' first `bucket` rows. `seq_lens_list` is what host-side
        code may read: a capture for many steps passes the longest any step can have."""
        return AttentionMetadata(
            slot_mapping=self.slots[:bucket], block_tables=self.tables[:bucket],
            seq_lens=self.lens[:bucket], query_start_loc=self.starts[:bucket + 1],
            num_decodes=bucket, num_decode_tokens=bucket,
            seq_lens_list=seq_lens_list, query_lens_list=[1] * bucket, has_padding=True,
            live_rows=self.live, state_slots=None if self.state_slots is None else self.state_slots[:bucket])
