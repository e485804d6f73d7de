"""Benchmark workloads: reproducible random-token prompts of fixed length."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    seed: int = 0

    def prompts(self, vocab_size: int, avoid: frozenset[int] = frozenset()) -> list[list[int]]:
        """Random token ids in [100, vocab), so special tokens (low ids, EOS) never appear."""
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(100, vocab_size, (self.num_prompts, self.input_len), generator=g).tolist()
        return [[t if t not in avoid else 100 for t in row] for row in ids]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
