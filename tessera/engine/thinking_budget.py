"""A reasoning model's thinking budget (vLLM's `thinking_token_budget`): once the reasoning
has taken that many tokens, its end token (</think>) is the next token, whatever the model
would have sampled; the answer follows as the model writes it.

Where the reasoning starts is what structured outputs assume too (SamplingParams): with
no opening token the output starts inside it (the prompt opened it); with one, the output
opens it at its first token or does not reason at all."""
from __future__ import annotations

from dataclasses import dataclass

from tessera.sampling.params import SamplingParams


@dataclass
class ThinkingBudget:
    budget: int      # the most reasoning tokens before the end token is forced
    end_id: int      # the token that ends the reasoning
    start_id: int | None = None  # its opening token (None: the output starts inside it)
    inside: bool = False
    done: bool = False
    count: int = 0   # reasoning tokens so far (the opening and end tokens not counted)

    def __post_init__(self) -> None:
        self.inside = self.start_id is None

    @property
    def forced_token(self) -> int | None:
        """The token the next step must take, or None."""
        return self.end_id if self.inside and self.count >= self.budget else None

    def advance(self, token: int, first: bool) -> None:
        """The output's next token (`first`: its first)."""
        if self.done:
            return
        if not self.inside:  # only the first token may open it
            self.inside = first and token == self.start_id
            self.done = not self.inside
        elif token == self.end_id:
            self.inside, self.done = False, True
        else:
            self.count += 1


def thinking_budget(params: SamplingParams) -> ThinkingBudget | None:
    """A sequence's count of `params.thinking_token_budget` (None: no budget)."""
    if params.thinking_token_budget is None:
        return None
    return ThinkingBudget(params.thinking_token_budget, params.reasoning_end_token_id, params.reasoning_start_token_id)
