"""Sampler: greedy, top-k, top-p and temperature behave as specified, row by row."""
from __future__ import annotations

import pytest
import torch

from tessera.sampling import Sampler, SamplingBatch, SamplingParams

from .helpers import assert_frequencies_match, sample_many


def test_all_greedy_batch_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    out = Sampler(0)(logits, SamplingBatch([SamplingParams(temperature=0.0)] * 16, [None] * 16))
    assert out.dtype == torch.int64 and out.shape == (16,)
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_rows_stay_argmax_inside_a_sampled_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0),
              SamplingParams(temperature=0.0, top_k=3), SamplingParams(temperature=1.5, top_p=0.5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)]
    gens = [None, None, None, None, None, torch.Generator().manual_seed(3)]
    for seed in range(5):
        out = Sampler(seed)(logits, SamplingBatch(params, gens))
        for row in (0, 2, 4):
            assert out[row] == logits[row].argmax()


def test_top_k_1_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(64, 300) * 3
    params = [SamplingParams(temperature=1.3, top_k=1)] * 64
    out = Sampler(7)(logits, SamplingBatch(params, [None] * 64))
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_draws_exactly_the_k_best_tokens(k):
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0, 1.8, 0.0, 1.2, -0.5])
    best = set(logits.topk(k).indices.tolist())
    draws = sample_many(logits, SamplingParams(temperature=1.0, top_k=k), 6000, seed=k)
    assert set(draws.unique().tolist()) == best
    # Inside the top k, frequencies follow the renormalised softmax.
    probs = torch.full_like(logits, float("-inf"))
    idx = torch.tensor(sorted(best))
    probs[idx] = logits[idx]
    assert_frequencies_match(draws, probs.softmax(-1))


def test_top_k_of_0_and_minus_1_mean_no_filter_next_to_a_filtered_row():
    logits = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    n = 3000
    rows = logits.unsqueeze(0).expand(2 * n, -1).contiguous()
    params = [SamplingParams(temperature=1.0, top_k=2)] * n + [SamplingParams(temperature=1.0, top_k=-1)] * n
    out = Sampler(5)(rows, SamplingBatch(params, [None] * (2 * n)))
    assert set(out[:n].unique().tolist()) == {4, 5}
    assert set(out[n:].unique().tolist()) == set(range(6))
    assert_frequencies_match(out[n:], logits.softmax(-1))


@pytest.mark.parametrize("top_p, kept", [
    (0.3, {0}),          # the best token alone already reaches 0.3 (it has 0.4)
    (0.65, {0, 1}),      # 0.4 < 0.65 <= 0.4 + 0.3
    (0.8, {0, 1, 2}),    # 0.7 < 0.8 <= 0.9
    (0.95, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # Shuffle the vocabulary so "best" is not "lowest index".
    perm = torch.tensor([2, 0, 3, 1])
    logits = torch.empty(4)
    logits[perm] = probs.log()
    draws = sample_many(logits, SamplingParams(temperature=1.0, top_p=top_p), 4000, seed=11)
    expected = {int(perm[i]) for i in kept}
    assert set(draws.unique().tolist()) == expected
    renorm = torch.zeros(4)
    for i in kept:
        renorm[perm[i]] = probs[i]
    assert_frequencies_match(draws, renorm / renorm.sum())


def test_top_p_is_applied_after_temperature():
    # At T=0.5 the best token's probability is 0.4^2 / (0.4^2 + 0.3^2 + 0.2^2 + 0.1^2) = 0.53,
    # so top_p=0.5 keeps it alone; at T=1 it would also keep the second.
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    draws = sample_many(logits, SamplingParams(temperature=0.5, top_p=0.5), 500)
    assert draws.unique().tolist() == [0]
    draws = sample_many(logits, SamplingParams(temperature=1.0, top_p=0.5), 500)
    assert set(draws.unique().tolist()) == {0, 1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_sampling_frequencies_match_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.3, 0.8, 0.0, -1.0])
    draws = sample_many(logits, SamplingParams(temperature=temperature), 20000, seed=3)
    assert_frequencies_match(draws, (logits / temperature).softmax(-1))


def test_frequency_check_detects_a_wrong_temperature():
    """The chi-square helper must be able to fail, or the tests above prove nothing."""
    logits = torch.tensor([1.0, 0.2, -0.3, 0.8, 0.0, -1.0])
    draws = sample_many(logits, SamplingParams(temperature=1.0), 20000, seed=3)
    with pytest.raises(AssertionError):
        assert_frequencies_match(draws, (logits / 1.3).softmax(-1))


def test_seeded_row_draws_do_not_depend_on_other_rows():
    torch.manual_seed(4)
    logits = torch.randn(5, 64)
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=42)

    def draws(batch_rows: list[int], other_params: SamplingParams, engine_seed: int) -> list[int]:
        """10 consecutive draws for row 0 (the seeded one) next to `batch_rows`."""
        gen = torch.Generator().manual_seed(42)
        other_gens = [torch.Generator().manual_seed(1000 + r) if other_params.seed is not None else None
                      for r in batch_rows]
        sampler = Sampler(engine_seed)
        out = []
        for _ in range(10):
            rows = [0] + batch_rows
            params = [target] + [other_params] * len(batch_rows)
            result = sampler(logits[rows], SamplingBatch(params, [gen] + other_gens))
            out.append(int(result[0]))
        return out

    alone = draws([], target, 0)
    assert len(set(alone)) > 1, "test setup: the seeded row should not be deterministic"
    assert draws([1, 2], SamplingParams(temperature=1.0), 0) == alone          # shared generator
    assert draws([3, 4, 1], SamplingParams(temperature=1.0), 99) == alone      # other engine seed
    assert draws([1, 2], SamplingParams(temperature=0.7, seed=5), 0) == alone  # other seeded rows
    assert draws([4], SamplingParams(temperature=0.0), 0) == alone             # greedy rows
    # and a different seed gives a different stream
    gen = torch.Generator().manual_seed(43)
    other = [int(Sampler(0)(logits[[0]], SamplingBatch([target], [gen]))[0]) for _ in range(10)]
    assert other != alone


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.zeros(50, 32)
    params = [SamplingParams(temperature=1.0)] * 50
    a = Sampler(1)(logits, SamplingBatch(params, [None] * 50))
    b = Sampler(1)(logits, SamplingBatch(params, [None] * 50))
    c = Sampler(2)(logits, SamplingBatch(params, [None] * 50))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_larger_than_vocab_means_no_filter():
    logits = torch.tensor([0.0, 1.0, 2.0])
    draws = sample_many(logits, SamplingParams(temperature=1.0, top_k=50), 3000)
    assert set(draws.unique().tolist()) == {0, 1, 2}


def test_tiny_positive_temperature_behaves_like_greedy():
    logits = torch.tensor([[1.0, 30.0, 2.0, -1.0]])
    out = Sampler(0)(logits, SamplingBatch([SamplingParams(temperature=1e-38)], [None]))
    assert int(out[0]) == 1


def test_greedy_ids_are_torchs_argmax():
    """Ties (the first maximum), NaN (the first NaN), inf and all -inf rows, as argmax."""
    from tessera.sampling.sampler import greedy_ids

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 4, (64, 500), generator=g).float()  # many ties
    x[1, 5] = x[1, 9] = float("nan")
    x[3, 7] = x[3, 8] = float("inf")
    x[4] = float("-inf")
    x[5, 3], x[5, 1] = float("nan"), float("inf")
    assert torch.equal(greedy_ids(x), x.argmax(dim=-1))
    assert greedy_ids(x)[[1, 3, 4, 5]].tolist() == [5, 7, 0, 3]
