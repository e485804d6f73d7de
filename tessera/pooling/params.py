"""What an embedding request asks for beyond its prompt (vLLM's PoolingParams)."""
from __future__ import annotations

from dataclasses import dataclass


class PoolingParamsError(ValueError):
    pass


@dataclass
class PoolingParams:
    """`dimensions`: keep the first this many components (Matryoshka models only), then
    normalize. `normalize`: None takes the model's (its sentence-transformers Normalize
    module, or --pooler-config). `truncate_prompt_tokens`: keep only the prompt's last k
    tokens (vLLM's left truncation; -1: as many as max_model_len allows)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise PoolingParamsError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise PoolingParamsError(f"normalize must be true or false, got {self.normalize!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise PoolingParamsError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class TokenTypedPrompt:
    """Token ids with their segment ids (vLLM's TokensPrompt with token_type_ids): a text
    pair for a cross-encoder, its first text 0 and its second 1, as the tokenizer encodes a
    pair."""

    token_ids: list[int]
    token_type_ids: list[int]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.token_type_ids):
            raise PoolingParamsError(f"{len(self.token_type_ids)} token type ids for {len(self.token_ids)} tokens")

    def __len__(self) -> int:
        return len(self.token_ids)
