"""A request's sequence: its tokens, how many of them the KV cache already holds, and its
blocks. The scheduler moves it between waiting and running; preemption resets
`num_computed_tokens` to 0 (the output so far is kept and recomputed as prompt)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tessera.sampling.params import SamplingParams


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
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # incremental detokenization state
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.read_offset = len(self.prompt_token_ids)
        self.prefix_offset = max(self.read_offset - 6, 0)

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
