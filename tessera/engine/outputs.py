"""What the engine hands back: one RequestOutput per request per step it progressed.

Streaming contract (what the server relies on): while a request runs, `outputs` holds one
CompletionOutput for each of its sequences that got a token this step, carrying the text
and token ids that step added (`delta_text`, `delta_token_ids`, `delta_logprobs`). The
last RequestOutput of a request has `finished=True` and holds the final completions (the
`n` best by cumulative logprob when best_of > n, else all in index order); those that did
not progress in that step have empty deltas. So: emit a chunk for every CompletionOutput
with non-empty `delta_token_ids`, and its `finish_reason` (when set) ends that choice.

Logprobs follow vLLM: per position a dict {token_id: Logprob}, the chosen (or prompt)
token first, then the requested top alternatives best first (the chosen token appears
once even when it is among them). `rank` is 1 for the most likely token.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str                          # the text so far (final: trimmed at a stop string)
    token_ids: list[int]
    finish_reason: str | None = None   # "length" | "eos_token" | "stop_sequence" | "abort"
    delta_text: str = ""               # text added by this step (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None      # when logprobs were computed
    logprobs: list[PositionLogprobs] | None = None  # per token, when `logprobs` was asked for
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def delta_logprobs(self) -> list[PositionLogprobs] | None:
        if self.logprobs is None:
            return None
        return self.logprobs[len(self.logprobs) - len(self.delta_token_ids):]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # Per prompt token when `prompt_logprobs` was asked for; the first is None (nothing
    # predicts it). Complete from the first output on.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (vLLM's field)
