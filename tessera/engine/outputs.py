"""What the engine hands back: one RequestOutput per request per step it progressed."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "length" | "eos_token" | "stop_sequence" | "abort"
    delta_text: str = ""               # text added by this step (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
