"""Batched next-token choice for rows with different parameters.

Per-row parameters become tensors once per step; filters run only when some row asks for
them. Sampling uses the exponential race (argmax p / E, E ~ Exp(1)), so a row's draw
depends only on its own generator: a seeded request samples the same tokens whatever else
shares the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.sampling.params import SamplingParams


@dataclass
class SamplingBatch:
    params: list[SamplingParams]
    generators: list[torch.Generator | None]  # per row; None: the engine's shared generator


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    k_max = min(int(top_k.max()), logits.shape[-1])  # k beyond the vocabulary filters nothing
    kth = logits.topk(k_max, dim=-1).values  # [B, k_max], descending
    k = torch.where(top_k > 0, top_k, k_max).clamp(max=k_max)
    threshold = kth.gather(1, (k - 1).unsqueeze(1))
    keep = (logits >= threshold) | (top_k <= 0).unsqueeze(1)
    return logits.masked_fill(~keep, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False  # always keep the best token
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits: [B, V] float32 -> chosen token ids [B] (int64, on the logits' device)."""
        params = batch.params
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy
        rows = [i for i, p in enumerate(params) if not p.greedy]
        x = logits[rows]
        device = x.device
        temps = torch.tensor([params[i].temperature for i in rows], dtype=x.dtype, device=device)
        x = x / temps.unsqueeze(1)
        if any(params[i].top_k > 0 for i in rows):
            x = _apply_top_k(x, torch.tensor([params[i].top_k for i in rows], device=device))
        if any(params[i].top_p < 1.0 for i in rows):
            x = _apply_top_p(x, torch.tensor([params[i].top_p for i in rows], dtype=x.dtype, device=device))
        probs = x.softmax(dim=-1)
        noise = torch.empty_like(probs, device="cpu")
        shared = [j for j, i in enumerate(rows) if batch.generators[i] is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1]).exponential_(generator=self.generator)
        for j, i in enumerate(rows):
            gen = batch.generators[i]
            if gen is not None:
                noise[j].exponential_(generator=gen)
        sampled = (probs / noise.to(device)).argmax(dim=-1)
        out = greedy.clone()
        out[rows] = sampled
        return out
