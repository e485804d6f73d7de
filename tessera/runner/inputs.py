"""Flat, unpadded model inputs for one scheduled step.

Rows are reordered so that single-token rows (decodes) come first, which lets attention
batch them; `sampled_rows` names the sequence of each logits row. Logits are computed for
the last token of each sequence that samples (and for each of its draft tokens, with
speculative decoding: such a sequence is one decode row per token), and, for a sequence
that asked for prompt logprobs, for every prompt position of this step whose logprobs are
not recorded yet (those rows come after the sampled ones).

With LoRA adapters, rows of one adapter are kept together (decodes first still), so that
each adapter's rows are a few contiguous segments of the step's tokens (`lora_segments`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tessera.engine.scheduler import ScheduledSeq
from tessera.engine.sequence import Sequence
from tessera.lora.layer import row_slots_for
from tessera.multimodal.inputs import MultimodalInputs
from tessera.ops.attention import AttentionMetadata
from tessera.pooling.pooler import PoolingRows
from tessera.platform import to_device


@dataclass
class ModelInputs:
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    attn: AttentionMetadata
    lm_head_indices: torch.Tensor  # [S + P] token rows whose logits are needed
    # the sequences the first S rows belong to, in order: one row each, or with drafts
    # (speculative decoding) 1 + len(item.draft_token_ids) consecutive rows
    sampled_rows: list[ScheduledSeq]
    max_block_id: int              # highest KV block this step touches
    # after the sampled rows: (sequence, first prompt position, number of positions)
    prompt_rows: list[PromptRows] = field(default_factory=list)
    num_prompt_logit_rows: int = 0  # the last rows of lm_head_indices (all ranks know this)
    # async scheduling: rows of input_ids whose token the previous step sampled and the
    # host has not read; the runner fills input_ids[rows] = previous tokens[indices] on
    # the device before the model runs
    deferred_rows: torch.Tensor | None = None
    deferred_indices: torch.Tensor | None = None
    # LoRA: (slot, first token row, end token row) of each run of one adapter's tokens,
    # and for a small step each row's slot (-1: the base model; tessera/lora/layer.py)
    lora_segments: list[tuple[int, int, int]] = field(default_factory=list)
    lora_row_slots: torch.Tensor | None = None
    # images: the token rows that are image placeholders, and for each sequence with some
    # in this step, its feature rows (ImageRows), in the same order; the runner turns them
    # into `image_embeds` before the model runs
    image_rows: torch.Tensor | None = None
    image_slices: list[ImageRows] = field(default_factory=list)
    image_embeds: torch.Tensor | None = None
    image_positions: torch.Tensor | None = None  # M-RoPE: the image rows' 3-D positions
    # embedding requests: each one's rows this step, pooled from the final hidden states,
    # and, where a step holds text pairs (cross-encoders), every row's segment id
    pooling_rows: list[PoolingRows] = field(default_factory=list)
    token_type_ids: torch.Tensor | None = None
    # recurrent layers with prefix caching: (from slot, to slot) state copies the runner
    # makes before the forward (snapshots restored) and after it (snapshots saved)
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # lm_head_indices on the host (empty where unknown, e.g. warm-up: every row then counts)
    lm_head_rows: list[int] = field(default_factory=list)

    def mark_output_rows(self, hidden_read: bool = True) -> None:
        """Tell the model which rows' final hidden states are read: the LM head's (none when
        `hidden_read` is False: partial prefill chunks), or all of them (pooling, adapter
        steps, whose rows must stay where the adapters' segments say)."""
        if self.lora_segments or (hidden_read and not self.lm_head_rows):
            return
        rows = self.lm_head_rows if hidden_read else []
        self.attn.output_rows = self.lm_head_indices if hidden_read else self.lm_head_indices[:0]
        self.attn.output_rows_list = rows

    @property
    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """What the model takes beyond token ids and positions this step."""
        if self.token_type_ids is not None:
            return {"token_type_ids": self.token_type_ids}
        if self.image_rows is None:
            return {}
        kwargs = {"image_rows": self.image_rows, "image_embeds": self.image_embeds}
        if self.image_positions is not None:
            kwargs["image_positions"] = self.image_positions
        return kwargs


@dataclass
class ImageRows:
    """A sequence's image feature rows [lo, hi) in this step; `keep`: its features stay
    after the step (siblings of its group still to come will read them too)."""

    images: MultimodalInputs
    lo: int
    hi: int
    keep: bool


@dataclass
class PromptRows:
    item: ScheduledSeq
    start: int  # position p predicts prompt token p + 1
    count: int

    @property
    def next_token_ids(self) -> list[int]:
        return self.item.seq.token_ids[self.start + 1:self.start + 1 + self.count]


def build_inputs(scheduled: list[ScheduledSeq], block_size: int, device: torch.device,
                 previous: dict[Sequence, int] | None = None,
                 lora_slots: dict[int, int] | None = None) -> ModelInputs:
    """`previous`: with async scheduling, where each sequence's token sits among the
    previous step's sampled tokens, for rows whose last token is still pending.
    `lora_slots`: the slot of each adapter (by key) the step's sequences use."""
    def slot_of(item: ScheduledSeq) -> int:
        return -1 if item.seq.lora is None else lora_slots[item.seq.lora.key]

    # stable: decodes first (a decode with drafts is one decode row per token), then by adapter
    rows = sorted(scheduled, key=(lambda s: (s.num_real_tokens != 1, slot_of(s))) if lora_slots
                  else (lambda s: s.num_real_tokens != 1))
    segments: list[tuple[int, int, int]] = []
    num_decodes = sum(s.num_new_tokens for s in rows if s.num_real_tokens == 1)
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
    deferred_rows: list[int] = []
    deferred_indices: list[int] = []
    image_rows: list[int] = []
    image_slices: list[ImageRows] = []
    image_positions: list[torch.Tensor] = []
    pooling_rows: list[PoolingRows] = []
    typed = False  # some pooling row has token types (a text pair)
    # per prefill sequence, its rows' key limits (tessera/ops/attention/metadata.py), or
    # its positions (causal); used when some row of an image attending to itself sees past
    # its own position
    key_limits: list[list[int] | range] = []
    limited = False
    # the block tables as one flat, zero-padded list: a single tensor conversion for the
    # step (one per row cost ~20 us each, 5 ms for a 256-row decode step)
    max_blocks = max(len(s.seq.block_table) for s in rows)
    flat_tables: list[int] = []
    for item in rows:
        seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
        end = start + n
        real_end = end - len(item.draft_token_ids)
        first_row = len(tokens)
        tokens.extend(seq.token_ids[start:real_end])
        images = getattr(seq, "multimodal", None)  # (a draft model's rows have none)
        if images is not None and start < seq.num_prompt_tokens:
            lo, hi = images.features_between(start, real_end)
            if hi > lo:
                image_rows.extend(first_row + p - start for p in images.feature_positions[lo:hi])
                group = getattr(seq, "group", None)
                image_slices.append(ImageRows(images, lo, hi, keep=group is not None and bool(group.pending)))
                if images.image_rope is not None:
                    image_positions.append(images.image_rope[:, lo:hi])
        if item.num_real_tokens != 1:  # a prefill row (decode rows are causal)
            limits = images.key_limits(start, end) if images is not None else None
            if seq.pooling is not None and seq.pooling.bidirectional:  # an encoder: every row sees the whole prompt
                limits = [end - 1] * (end - start)
            limited = limited or limits is not None
            key_limits.append(range(start, end) if limits is None else limits)
        if real_end > seq.num_tokens:  # the token at `end - 1` is being sampled by the previous step
            if previous is None or seq not in previous or real_end - 1 != seq.num_tokens:
                raise RuntimeError(f"request {seq.request_id}: position {real_end - 1} has no token "
                                   "and the previous step did not sample it")
            deferred_rows.append(len(tokens))
            deferred_indices.append(previous[seq])
            tokens.append(0)
        tokens.extend(item.draft_token_ids)
        if seq.lora is not None:
            _add_segment(segments, slot_of(item), first_row, len(tokens))
        if images is None or images.rope_positions is None:
            positions.extend(range(start, end))
        else:  # M-RoPE: positions of their own (text after an image is not at its index)
            positions.extend(images.rope_position(p) for p in range(start, end))
        table = seq.block_table
        _extend_slots(slots, table, start, end, block_size)
        padded_table = table + [0] * (max_blocks - len(table))
        # Drafts are verified as decode rows, one per token, all reading the sequence's
        # blocks: the whole step's K/V is written before attention reads it, so the row
        # of position p, seeing the first p + 1 cached tokens, is causal attention over
        # the chunk; and it is a decode step that captured graphs can replay.
        for row_end in (range(real_end, end + 1) if item.draft_token_ids else (end,)):
            row_len = n if not item.draft_token_ids else 1
            flat_tables.extend(padded_table)
            seq_lens.append(row_end)
            query_lens.append(row_len)
            query_start.append(query_start[-1] + row_len)
        if seq.pooling is not None:
            pooling_rows.append(PoolingRows(seq, first_row, start, n, ends_prompt=end == seq.num_prompt_tokens))
            if seq.pooling.token_type_ids is not None:
                typed = True
        if item.samples:  # after the last real token, and after each draft (to verify it)
            lm_head_indices.extend(range(query_start[-1] - 1 - len(item.draft_token_ids), query_start[-1]))
            sampled_rows.append(item)
        if seq.needs_prompt_logits:
            first = max(start, seq.num_prompt_logprobs_done)
            last = min(end, seq.num_prompt_tokens - 1)
            if last > first:
                base = query_start[-1] - end
                prompt_indices.extend(range(base + first, base + last))
                prompt_rows.append(PromptRows(item, first, last - first))
    tables = _tensor(flat_tables, torch.int32).view(len(seq_lens), max_blocks)
    max_block_id = max(flat_tables)  # padding is 0, and block ids are >= 0

    def to(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return to_device(_tensor(values, dtype), device)

    attn = AttentionMetadata(
        slot_mapping=to(slots), block_tables=to_device(tables, device),
        seq_lens=to(seq_lens, torch.int32), query_start_loc=to(query_start, torch.int32),
        num_decodes=num_decodes, num_decode_tokens=num_decodes,
        seq_lens_list=seq_lens, query_lens_list=query_lens)
    logit_rows = lm_head_indices + prompt_indices
    inputs = ModelInputs(to(tokens), to(positions), attn, to(logit_rows),
                         sampled_rows, max_block_id, prompt_rows, len(prompt_indices),
                         lora_segments=segments, lora_row_slots=row_slots_for(segments, len(tokens), device),
                         pooling_rows=pooling_rows, lm_head_rows=logit_rows)
    if limited:
        attn.key_limits = to([p for limits in key_limits for p in limits])
    if getattr(rows[0].seq, "state_slot", None) is not None:  # recurrent layers (a draft model's rows have none)
        _add_state_slots(attn, rows, to)
        inputs.state_restores = [(i.restore_from, i.seq.state_slot) for i in rows if i.restore_from is not None]
        inputs.state_saves = [(i.seq.state_slot, i.save_to) for i in rows if i.save_to is not None]
    if typed:
        inputs.token_type_ids = to([t for r in pooling_rows for t in _row_types(r)])
    if deferred_rows:
        inputs.deferred_rows, inputs.deferred_indices = to(deferred_rows), to(deferred_indices)
    if image_rows:
        inputs.image_rows, inputs.image_slices = to(image_rows), image_slices
        if image_positions:
            inputs.image_positions = to_device(torch.cat(image_positions, dim=1), device)
    return inputs


def _add_state_slots(attn: AttentionMetadata, rows: list[ScheduledSeq], to) -> None:
    """Each sequence's state slot, and whether its state starts from zero (its chunk
    starts at position 0). Drafts would need the state rolled back: the engine refuses
    speculative decoding for such models, so a sequence is one row."""
    slots = [item.seq.state_slot for item in rows]
    if None in slots or any(item.draft_token_ids for item in rows):
        raise RuntimeError("a step of a model with recurrent layers has a sequence without a state slot "
                           "or with draft tokens")
    attn.state_slots, attn.state_slots_list = to(slots), slots
    attn.state_fresh_list = [item.seq.num_computed_tokens == 0 for item in rows]


def _row_types(rows: PoolingRows) -> list[int]:
    types = rows.seq.pooling.token_type_ids
    return [0] * rows.count if types is None else types[rows.start:rows.start + rows.count]


def _add_segment(segments: list[tuple[int, int, int]], slot: int, start: int, end: int) -> None:
    if segments and segments[-1][0] == slot and segments[-1][2] == start:
        segments[-1] = (slot, segments[-1][1], end)
    else:
        segments.append((slot, start, end))


_NUMPY_INTS = {torch.int32: np.int32, torch.long: np.int64}


def _tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of Python ints, through numpy: 3-4x faster than torch.tensor on a list
    (1.1 ms for the 16k table entries of 256 sequences of 1000 tokens)."""
    return torch.from_numpy(np.fromiter(values, dtype=_NUMPY_INTS[dtype], count=len(values)))


def _extend_slots(slots: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """Append the cache slots of positions [start, end): one range per block touched, not
    one Python step per token (a 1000-token prompt touches 63 blocks of 16)."""
    pos = start
    while pos < end:
        index = pos // block_size
        stop = min(end, (index + 1) * block_size)
        shift = (table[index] - index) * block_size  # slot = table[index] * bs + pos % bs
        slots.extend(range(pos + shift, stop + shift))
        pos = stop
