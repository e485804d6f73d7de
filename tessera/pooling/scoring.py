"""Scoring text pairs with an embedding model (vLLM's LLM.score, /score, /rerank): each text
is embedded once, a pair's score is the cosine similarity of its two vectors. (A cross-
encoder reads both texts together and scores better; tessera serves none yet.)"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class PairingError(ValueError):
    pass


def pair_indices(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """Which texts are scored together, as vLLM pairs them: one with one, one with each of
    many, or many with as many, position by position."""
    if num_first == 0 or num_second == 0:
        raise PairingError("both sides of a score need at least one text")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first != num_second:
        raise PairingError(f"{num_first} first texts and {num_second} second texts: give one first text, "
                           "or as many as second texts")
    return [(i, i) for i in range(num_first)]


def cosine_scores(first: list[torch.Tensor], second: list[torch.Tensor],
                  pairs: list[tuple[int, int]]) -> list[float]:
    a = torch.stack([first[i] for i, _ in pairs]).float()
    b = torch.stack([second[j] for _, j in pairs]).float()
    return F.cosine_similarity(a, b, dim=-1).tolist()


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (vLLM's shape: `output.outputs.score`)."""

    request_id: str
    prompt_token_ids: list[int]  # the two texts' tokens, one after the other
    outputs: ScoringOutput
    finished: bool = True
