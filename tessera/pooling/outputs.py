"""What the engine hands back for an embedding request: one output, when its prompt is done."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PoolingOutput:
    data: torch.Tensor  # [dimensions] float32, on the CPU

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        return self.data.shape[0]


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


# vLLM's name for what LLM.embed returns (`output.outputs.embedding`)
EmbeddingRequestOutput = PoolingRequestOutput


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax over the labels

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What LLM.classify returns per prompt (vLLM's shape: `output.outputs.probs`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True
