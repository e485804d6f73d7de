"""Per-request sampling parameters, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field


GREEDY_TEMPERATURE = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field and the range."""


@dataclass
class SamplingParams:
    """`temperature=0` means greedy; `top_k=0` and `top_p=1` disable those filters."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> SamplingParamsError:
            return SamplingParamsError(f"`{name}` {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be an integer >= 1")
        if not 0 <= self.temperature < float("inf"):  # also rejects NaN
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if self.top_k == -1:  # vLLM spelling of "disabled"
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        # Below this, logits / T overflows; the distribution is a point mass anyway.
        return self.temperature < GREEDY_TEMPERATURE
