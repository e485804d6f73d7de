"""A request's sequence: its tokens, how many of them the KV cache already holds, and its
blocks. The scheduler moves it between waiting and running; preemption resets
`num_computed_tokens` to 0 (the output so far is kept and recomputed as prompt).

A request with n / best_of > 1 is a SequenceGroup of independent sequences sharing the
prompt (each with its own seed); the engine hands them to the scheduler one by one. Under
beam search the group's sequences are its beams, which fork from each other."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from tessera.engine.outputs import PositionLogprobs
from tessera.sampling.params import SamplingParams
from tessera.sampling.structured import AlsoAllowing


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output never exceeds this (max_model_len)
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # under the "priority" policy: lower is scheduled sooner
    first_scheduled_time: float | None = None  # first admission to the running batch
    num_cached_tokens: int = 0  # prompt tokens its first admission took from the prefix cache
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # tokens sampled by launched steps whose results the host has not read yet (async
    # scheduling: at most 2, the step in flight and the one just launched); they follow
    # token_ids and count for scheduling, not for outputs
    num_pending_tokens: int = 0
    # speculative decoding: tokens proposed to follow token_ids, for the next step to
    # verify (the scheduler takes them; a step that cannot fit them drops them)
    draft_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # recurrent layers (linear attention): the slot holding its state while it runs
    state_slot: int | None = None
    # ... and with prefix caching, the block hash its latest decoding snapshot is kept under
    decode_snapshot: int | None = None
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    index: int = 0                        # position in its group (n / best_of)
    group: SequenceGroup | None = None
    # incremental detokenization state; `text` is everything decoded so far, of which the
    # first `num_emitted_chars` have been handed out (the rest may be the start of a stop
    # string); at the end it is trimmed to what the caller sees
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    num_emitted_chars: int = 0
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None          # when params.logprobs is set
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # the group's first sequence
    # structured outputs: this sequence's xgrammar matcher (what may come next); whether it
    # still waits for params.reasoning_end_token_id before it applies; and, until the first
    # output token, the reasoning's opening token allowed beside the constraint's tokens
    grammar: Any = None
    grammar_waits: bool = False
    grammar_may_open: int | None = None
    # params.thinking_token_budget's count (tessera.engine.thinking_budget.ThinkingBudget)
    thinking: Any = None
    # the LoRA adapter it runs with (tessera.lora.adapter.LoRAAdapter), None: the base model
    lora: Any = None
    # its prompt's images (tessera.multimodal.inputs.MultimodalInputs), shared by the group
    multimodal: Any = None
    # an embedding request (tessera.pooling.pooler.PoolingState): its prompt is pooled into
    # one vector and it ends there, sampling nothing
    pooling: Any = None
    # beam search: this beam's best next tokens from its last step (sampling.TokenLogprobs),
    # until every beam of its group has them and the group picks the next beams
    beam_candidates: Any = None

    @property
    def forced_token(self) -> int | None:
        """The token the next step must take (a thinking budget spent: the reasoning's end)."""
        return None if self.thinking is None else self.thinking.forced_token

    @property
    def active_grammar(self) -> Any:
        """What masks the next token: the matcher, None (none, or still waiting), or at the
        first token of an output that may open a reasoning, the matcher or that token."""
        if self.grammar_waits or self.grammar is None:
            return None
        if self.grammar_may_open is not None:
            return AlsoAllowing(self.grammar, self.grammar_may_open)
        return self.grammar

    @property
    def cache_salt(self) -> Hashable:
        """What the prefix cache mixes into the first block's hash: KV computed under one
        adapter (or none) is never reused under another."""
        return None if self.lora is None else ("lora", self.lora.key)

    def block_key(self, index: int, block_size: int) -> tuple:
        """What the prefix cache identifies block `index` by: its token ids, and the pixels of
        any image whose placeholder tokens it holds."""
        start = index * block_size
        tokens = tuple(self.token_ids[start:start + block_size])
        if self.multimodal is None:
            return tokens
        images = self.multimodal.hashes_between(start, start + block_size)
        return (tokens, images) if images else tokens

    def chunk_size(self, start: int, n: int) -> int:
        """How many of the `n` tokens from `start` a step may compute: an image whose tokens
        attend to each other is never split between steps (so a step may take fewer, or
        the rest of such an image where it starts in or at one), nor an encoder's prompt."""
        if self.pooling is not None and self.pooling.bidirectional:
            return self.num_tokens - start  # an encoder's prompt: all of it, in one step
        if self.multimodal is None or not self.multimodal.attention_spans:
            return n
        return self.multimodal.chunk_end(start, start + n) - start

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.read_offset = len(self.prompt_token_ids)
        self.prefix_offset = max(self.read_offset - 6, 0)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]  # nothing predicts the first prompt token

    @property
    def output_text(self) -> str:
        return self.text[:self.num_emitted_chars]

    @property
    def num_prompt_logprobs_done(self) -> int:
        """Prompt positions whose next-token logprobs are recorded (position p predicts
        token p + 1)."""
        return 0 if self.prompt_logprobs is None else len(self.prompt_logprobs) - 1

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether logits of prompt positions are still wanted: then the scheduler must not
        reuse cached prefix blocks (their positions would not be computed)."""
        return (self.prompt_logprobs is not None
                and self.num_prompt_logprobs_done < self.num_prompt_tokens - 1)

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt position must be computed here (prompt logprobs, or pooling
        that reads every position's hidden state): then no cached prefix is reused."""
        return self.needs_prompt_logits or (self.pooling is not None and self.pooling.every_row)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def at_length_limit(self, extra: int = 0) -> bool:
        """Whether the sequence is at max_tokens or max_model_len, counting `extra` tokens
        not yet appended."""
        return (self.num_output_tokens + extra >= self.params.max_new_tokens
                or self.num_tokens + extra >= self.max_total_tokens)


@dataclass(eq=False)
class SequenceGroup:
    """One request: its sequences (n or best_of of them) and those not yet scheduled. Under
    beam search, `seqs` are its live beams, and at the end the n best hypotheses."""

    request_id: str
    seqs: list[Sequence]
    pending: list[Sequence] = field(default_factory=list)
    beams: Any = None  # the search's state under beam search (engine/beam_search.py)

    @property
    def params(self) -> SamplingParams:
        return self.seqs[0].params

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
