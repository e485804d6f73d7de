"""What a request must satisfy before the engine queues it: a free id, a usable priority,
a prompt that fits the vocabulary and leaves room to generate, and sampling parameters
whose token ids lie in the vocabulary. Each refusal is a RequestError naming the field."""
from __future__ import annotations

from typing import Any

from tessera.sampling.params import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot take (empty, too long, duplicate id ...); nothing queued.
    `param`: the request field at fault, when one is (the OpenAI error's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_priority(priority: Any, by_priority: bool) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestError(f"priority must be an integer, got {priority!r}", param="priority")
    if priority != 0 and not by_priority:
        raise RequestError(f"priority {priority} needs the priority scheduling policy "
                           "(--scheduling-policy priority); this engine schedules first come, first served",
                           param="priority")


def check_prompt(token_ids: list[int], vocab: int, max_model_len: int, generates: bool = True) -> None:
    """`generates`: the prompt must leave room for a token (an embedding's need not)."""
    if not token_ids:
        raise RequestError("prompt is empty")
    if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
    if not generates and len(token_ids) > max_model_len:
        raise RequestError(f"prompt has {len(token_ids)} tokens; max_model_len is {max_model_len} "
                           "(truncate_prompt_tokens keeps the last ones)")
    if generates and len(token_ids) >= max_model_len:
        raise RequestError(f"prompt has {len(token_ids)} tokens; max_model_len is "
                           f"{max_model_len}, leaving no room to generate")


def check_against_vocab(params: SamplingParams, vocab: int) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > vocab:
            raise RequestError(f"`{name}` must be <= the vocabulary size {vocab}, got {value}")
    for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise RequestError(f"`{name}` token ids must be in [0, {vocab}), got {bad[0]}")
    for name in ("reasoning_end_token_id", "reasoning_start_token_id"):
        value = getattr(params, name)
        if value is not None and value >= vocab:
            raise RequestError(f"`{name}` must be in [0, {vocab}), got {value}")
