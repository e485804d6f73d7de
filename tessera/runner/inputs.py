"""Flat, unpadded model inputs for one scheduled step.

Rows are reordered so that single-token rows (decodes) come first, which lets attention
batch them; `order` maps rows back to the scheduler's sequences. Logits are computed for
the last token of each sequence that samples, and, for a sequence that asked for prompt
logprobs, for every prompt position of this step whose logprobs are not recorded yet
(those rows come after the sampled ones).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.engine.scheduler import ScheduledSeq
from tessera.ops.attention import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    attn: AttentionMetadata
    lm_head_indices: torch.Tensor  # [S + P] token rows whose logits are needed
    sampled_rows: list[ScheduledSeq]  # the sequences the first S rows belong to, in order
    max_block_id: int              # highest KV block this step touches
    # after the sampled rows: (sequence, first prompt position, number of positions)
    prompt_rows: list[PromptRows] = field(default_factory=list)


@dataclass
class PromptRows:
    item: ScheduledSeq
    start: int  # position p predicts prompt token p + 1
    count: int

    @property
    def next_token_ids(self) -> list[int]:
        return self.item.seq.token_ids[self.start + 1:self.start + 1 + self.count]


def build_inputs(scheduled: list[ScheduledSeq], block_size: int, device: torch.device) -> ModelInputs:
    rows = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
    num_decodes = sum(1 for s in rows if s.num_new_tokens == 1)
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_lens: list[int] = []
    query_start = [0]
    lm_head_indices: list[int] = []
    sampled_rows: list[ScheduledSeq] = []
    prompt_indices: list[int] = []
    prompt_rows: list[PromptRows] = []
    max_blocks = max(len(s.seq.block_table) for s in rows)
    max_block_id = max(max(s.seq.block_table) for s in rows)
    tables = torch.zeros((len(rows), max_blocks), dtype=torch.int32)
    for r, item in enumerate(rows):
        seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
        end = start + n
        tokens.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        tables[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
        seq_lens.append(end)
        query_lens.append(n)
        query_start.append(query_start[-1] + n)
        if item.samples:
            lm_head_indices.append(query_start[-1] - 1)
            sampled_rows.append(item)
        if seq.needs_prompt_logits:
            first = max(start, seq.num_prompt_logprobs_done)
            last = min(end, seq.num_prompt_tokens - 1)
            if last > first:
                base = query_start[-2] - start
                prompt_indices.extend(range(base + first, base + last))
                prompt_rows.append(PromptRows(item, first, last - first))

    def to(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    attn = AttentionMetadata(
        slot_mapping=to(slots), block_tables=tables.to(device, non_blocking=True),
        seq_lens=to(seq_lens, torch.int32), query_start_loc=to(query_start, torch.int32),
        num_decodes=num_decodes, num_decode_tokens=num_decodes,
        seq_lens_list=seq_lens, query_lens_list=query_lens)
    return ModelInputs(to(tokens), to(positions), attn, to(lm_head_indices + prompt_indices),
                       sampled_rows, max_block_id, prompt_rows)
