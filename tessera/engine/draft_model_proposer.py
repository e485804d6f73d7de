"""Draft-model proposals for speculative decoding: a smaller model of the same vocabulary
writes the next k tokens greedily, and the target verifies them in one step.

Proposing happens in two phases, because the draft's KV must be written into slots of the
target's blocks and only the scheduler hands out slots:
1. after a step, `propose` asks for room: `k` placeholder drafts (DRAFT_PLACEHOLDER);
2. the scheduler gives each decoding sequence what its budget and free blocks allow (or
   nothing), allocating the slots of those drafts as it does for n-gram ones;
3. before the step runs, `fill` runs the draft model over the scheduled sequences and
   replaces the placeholders with its tokens.

The draft's KV cache mirrors the target's: as many blocks of the same size, addressed by
the same block tables, so no block bookkeeping of its own. A sequence's draft KV is valid
for a prefix of its positions, tracked here: `fill` first computes what the draft has not
seen (a whole prompt the first time; after a step, the token the target sampled, and the
last draft when all were accepted), sampling the first draft from its last position, then
runs one decode pass per further draft. Those passes write KV for every draft but the last;
a rejected draft's KV is simply computed again. A preempted sequence (its blocks freed)
and a new sequence whose prompt hit the prefix cache start from position 0: the draft's
KV in blocks another sequence computed is not known to be there.

Draft passes take at most the step's token budget each (a long prompt is computed in
chunks), and run on the driver alone with tensor parallelism, unsharded.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from tessera.config import SpeculativeConfig
from tessera.engine.scheduler import ScheduledSeq
from tessera.engine.sequence import Sequence
from tessera.runner.inputs import build_inputs
from tessera.runner.model_runner import ModelRunner
from tessera.sampling.sampler import greedy_ids

# what a draft is until `fill` writes it: never a token id (an embedding lookup of it fails)
DRAFT_PLACEHOLDER = -1


class _TokensThenDrafts:
    """A sequence's tokens followed by the drafts made so far, without copying the tokens:
    what build_inputs slices."""

    def __init__(self, tokens: list[int], drafts: list[int]):
        self.tokens, self.drafts = tokens, drafts

    def __len__(self) -> int:
        return len(self.tokens) + len(self.drafts)

    def __getitem__(self, span: slice) -> list[int]:
        n = len(self.tokens)
        start, stop = span.start or 0, len(self) if span.stop is None else span.stop
        if stop <= n:
            return self.tokens[start:stop]
        return self.tokens[start:n] + self.drafts[max(start - n, 0):stop - n]


@dataclass
class DraftRow:
    """A sequence as the draft model's pass sees it: its tokens (then the drafts so far),
    the positions whose draft KV is computed, and the target's block table. It has what
    build_inputs reads of a Sequence."""

    request_id: str
    token_ids: _TokensThenDrafts
    num_computed_tokens: int
    block_table: list[int]
    lora: None = None
    needs_prompt_logits: bool = False
    num_pending_tokens: int = 0
    pooling: None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class _Drafted:
    """What the last `fill` left for a sequence: its draft KV is valid for its first `base`
    positions, and for position base + i while its token is drafts[i] (for all but the
    last draft, whose KV no pass wrote)."""

    base: int
    drafts: list[int]
    preemptions: int


@dataclass
class _Pending:
    item: ScheduledSeq
    row: DraftRow
    drafts: list[int]  # the row's tokens end with these

    @property
    def backlog(self) -> int:
        """The sequence's own tokens the draft has still to compute."""
        return len(self.row.token_ids.tokens) - self.row.num_computed_tokens


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, vocab_size: int,
                 draft_vocab_size: int, max_model_len: int, max_tokens_per_pass: int):
        """`runner`: the draft model's, its cache as many blocks as the target's;
        `vocab_size`: the target's, `draft_vocab_size` the draft's (model families pad
        them differently: a draft never proposes past the target's, and reads a token
        past its own as token 0); `max_model_len`: the draft's (no drafts for a sequence
        beyond it)."""
        self.config = config
        self.runner = runner
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size
        self.max_model_len = max_model_len
        self.max_tokens_per_pass = max_tokens_per_pass
        self._drafted: weakref.WeakKeyDictionary[Sequence, _Drafted] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence) -> list[int]:
        """Room for `seq`'s drafts at its next step: placeholders that `fill` replaces,
        never more than its length limits (and the draft's) leave room for."""
        room = min(self.config.num_speculative_tokens,
                   seq.params.max_new_tokens - seq.num_output_tokens - 1,
                   seq.max_total_tokens - seq.num_tokens - 1,
                   # the passes write positions up to num_tokens + room - 2
                   self.max_model_len - seq.num_tokens + 1)
        return [DRAFT_PLACEHOLDER] * room if room > 0 else []

    @torch.inference_mode()
    def fill(self, scheduled: list[ScheduledSeq]) -> None:
        """Write the drafts of every scheduled sequence that was given room for some."""
        pending = [self._pending(item) for item in scheduled if item.draft_token_ids]
        if not pending:
            return
        self._catch_up(pending)
        for step in range(1, max(len(p.item.draft_token_ids) for p in pending)):
            # (a row's token list ends with its drafts so far: the last one is this pass's input)
            self._run_pass([(p, 1) for p in pending if len(p.item.draft_token_ids) > step])
        for p in pending:
            seq = p.item.seq
            p.item.draft_token_ids = p.drafts
            self._drafted[seq] = _Drafted(seq.num_tokens, list(p.drafts), seq.num_preemptions)

    def _pending(self, item: ScheduledSeq) -> _Pending:
        seq, drafts = item.seq, []
        row = DraftRow(seq.request_id, _TokensThenDrafts(seq.token_ids, drafts),
                       self._valid_positions(seq), seq.block_table)
        return _Pending(item, row, drafts)

    def _valid_positions(self, seq: Sequence) -> int:
        """How many of `seq`'s first positions hold the draft's KV for its tokens."""
        last = self._drafted.get(seq)
        if last is None or last.preemptions != seq.num_preemptions:
            return 0  # new, or preempted since (its blocks were freed)
        valid = last.base
        for position, draft in enumerate(last.drafts[:-1], start=last.base):
            if position >= seq.num_tokens - 1 or seq.token_ids[position] != draft:
                break
            valid += 1
        return valid

    def _catch_up(self, pending: list[_Pending]) -> None:
        """Compute each row up to its last token, at most max_tokens_per_pass tokens a
        pass; a row's first draft comes from its last position."""
        behind = list(pending)
        while behind:
            chunk, used = [], 0
            for p in behind:
                if used >= self.max_tokens_per_pass:
                    break
                n = min(p.backlog, self.max_tokens_per_pass - used)
                chunk.append((p, n))
                used += n
            self._run_pass(chunk)
            behind = [p for p in behind if p.backlog]

    def _run_pass(self, chunk: list[tuple[_Pending, int]]) -> None:
        """One draft forward pass over `chunk`'s rows (n tokens each from where each row's
        KV ends); a row that reaches its last token gets its next draft."""
        by_row = {id(p.row): p for p, _ in chunk}
        inputs = build_inputs([ScheduledSeq(p.row, n) for p, n in chunk],
                              self.runner.block_size, self.runner.device)
        if self.draft_vocab_size < self.vocab_size:  # a token only the target's vocabulary has
            ids = inputs.input_ids
            inputs.input_ids = torch.where(ids < self.draft_vocab_size, ids, torch.zeros_like(ids))
        if inputs.sampled_rows:
            logits = next(self.runner.forward(inputs))
            tokens = greedy_ids(logits[:, :self.vocab_size]).tolist()
            for item, token in zip(inputs.sampled_rows, tokens):
                by_row[id(item.seq)].drafts.append(token)
        else:
            self.runner.forward_no_logits(inputs)
        for p, n in chunk:
            p.row.num_computed_tokens += n
