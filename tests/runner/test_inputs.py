"""build_inputs against a per-token reference: decodes first, slots through each sequence's
block table (chunks that start and end mid-block), zero-padded tables, the logit rows of
sampling and prompt-logprob sequences."""
from __future__ import annotations

import random

import torch

from tessera.engine.scheduler import ScheduledSeq
from tessera.engine.sequence import Sequence
from tessera.runner.inputs import build_inputs
from tessera.sampling.params import SamplingParams

BLOCK = 4


def scheduled(rng: random.Random, prompt: int, computed: int, new: int, **params) -> ScheduledSeq:
    seq = Sequence("r", None, [rng.randrange(1000) for _ in range(prompt)], SamplingParams(**params), 10_000)
    seq.num_computed_tokens = computed
    seq.block_table = rng.sample(range(500), -(-(computed + new) // BLOCK))
    return ScheduledSeq(seq, new)


def test_inputs_match_a_per_token_reference():
    rng = random.Random(0)
    items = [scheduled(rng, 23, 5, 18),                       # a chunk starting mid-block
             scheduled(rng, 9, 8, 1),                         # a decode (sorted first)
             scheduled(rng, 30, 11, 6, prompt_logprobs=1),    # a middle chunk, prompt logprobs
             scheduled(rng, 17, 16, 1),
             scheduled(rng, 12, 0, 12, prompt_logprobs=0)]    # a whole prompt, prompt logprobs
    inputs = build_inputs(items, BLOCK, torch.device("cpu"))
    order = [items[1], items[3], items[0], items[2], items[4]]
    assert inputs.attn.num_decodes == 2
    ids, positions, slots, lens = [], [], [], []
    width = max(len(s.seq.block_table) for s in items)
    for r, item in enumerate(order):
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        ids += seq.token_ids[start:end]
        positions += list(range(start, end))
        slots += [seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
        lens.append(end)
        table = inputs.attn.block_tables[r].tolist()
        assert table == seq.block_table + [0] * (width - len(seq.block_table))
    assert inputs.input_ids.tolist() == ids
    assert inputs.positions.tolist() == positions
    assert inputs.attn.slot_mapping.tolist() == slots
    assert inputs.attn.seq_lens.tolist() == lens
    assert inputs.max_block_id == max(max(s.seq.block_table) for s in items)
    # sampled rows: the last token of each sequence that reaches its end (not the middle chunk)
    starts = inputs.attn.query_start_loc.tolist()
    assert [s.seq for s in inputs.sampled_rows] == [order[r].seq for r in (0, 1, 2, 4)]
    sampled = [starts[r + 1] - 1 for r in (0, 1, 2, 4)]
    # prompt logprob rows: positions 11..16 of the middle chunk, 0..10 of the whole prompt
    prompt = list(range(starts[3], starts[4])) + list(range(starts[4], starts[5] - 1))
    assert inputs.lm_head_indices.tolist() == sampled + prompt
    assert inputs.num_prompt_logit_rows == len(prompt)
    assert [(r.start, r.count) for r in inputs.prompt_rows] == [(11, 6), (0, 11)]
