"""Shared helpers of the sampler tests: many draws from one row, and a chi-square check."""
from __future__ import annotations

import torch

from tessera.sampling import Sampler, SamplingBatch, SamplingParams

try:
    from scipy.stats import chisquare
except ImportError:  # pragma: no cover - scipy is optional
    chisquare = None

# Critical values of the chi-square distribution at p = 0.001, by degrees of freedom.
_CHI2_CRIT_0001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 9: 27.88}


def sample_many(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws for one row of logits (the shared generator, seeded)."""
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    return Sampler(seed)(logits, SamplingBatch([params] * n, [None] * n))


def assert_frequencies_match(draws: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit over the tokens with non-zero probability."""
    n = draws.numel()
    support = (probs > 0).nonzero().flatten()
    assert set(draws.unique().tolist()) <= set(support.tolist()), "drew a token with probability 0"
    observed = torch.bincount(draws, minlength=probs.numel())[support].double()
    expected = probs[support].double()
    expected = expected / expected.sum() * n
    assert expected.min() >= 20, "test setup: too few expected draws per bin"
    if len(support) == 1:
        assert observed.item() == n
        return
    if chisquare is not None:
        stat, p_value = chisquare(observed.numpy(), expected.numpy())
        assert p_value > 1e-3, f"frequencies {observed.tolist()} vs expected {expected.tolist()}"
    else:
        stat = float(((observed - expected) ** 2 / expected).sum())
        assert stat < _CHI2_CRIT_0001[len(support) - 1], f"chi-square {stat}"
