"""Each logits processor against transformers' processor of the same name (row by row, one
parameter value per row), or a reference formula where transformers has none; rows whose
parameter is neutral must come back bit for bit unchanged."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers.generation import logits_process as hf

from tessera.sampling import processors as P

V = 64


def rows_like_hf(x: torch.Tensor, make_hf, values: list) -> torch.Tensor:
    """Apply a fresh HF processor built from values[r] to row r alone."""
    out = torch.empty_like(x)
    for r, value in enumerate(values):
        out[r] = make_hf(value)(None, x[r:r + 1].clone())[0]
    return out


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(actual.isinf(), expected.isinf()), "different tokens filtered"
    finite = ~expected.isinf()
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-6, atol=1e-6)


@pytest.fixture
def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(6, V) * 3


def test_temperature_matches_hf(logits):
    temps = [0.3, 1.0, 1.7, 0.05, 2.5, 1.0]
    out = P.apply_temperature(logits, torch.tensor(temps))
    assert_same(out, rows_like_hf(logits, hf.TemperatureLogitsWarper, temps))


def test_top_k_matches_hf_and_0_is_off(logits):
    ks = [1, 5, 0, V, V + 10, 17]
    out = P.apply_top_k(logits, torch.tensor(ks))
    expected = rows_like_hf(logits, lambda k: hf.TopKLogitsWarper(k) if k else (lambda _, s: s), ks)
    assert_same(out, expected)
    assert torch.equal(out[2], logits[2]) and torch.equal(out[3], logits[3])


def test_top_k_keeps_ties_with_the_kth_like_hf():
    x = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    assert P.apply_top_k(x, torch.tensor([2])).isfinite().tolist() == [[False, True, True, True, False]]
    assert_same(P.apply_top_k(x, torch.tensor([2])), hf.TopKLogitsWarper(2)(None, x.clone()))


def test_top_p_matches_hf(logits):
    ps = [0.1, 0.5, 0.9, 1.0, 0.99, 0.3]
    out = P.apply_top_p(logits, torch.tensor(ps))
    assert_same(out, rows_like_hf(logits, hf.TopPLogitsWarper, ps))
    assert torch.equal(out[3], logits[3])


@pytest.mark.parametrize("prefix", [1, 3, 8, 20])
def test_top_p_sorting_only_a_growing_prefix_gives_the_full_sort_result(logits, prefix):
    near_flat = torch.randn(2, V, generator=torch.Generator().manual_seed(1)) * 0.05  # wide nuclei
    flat = torch.cat([logits, near_flat])
    ps = [0.1, 0.5, 0.9, 1.0, 0.99, 0.3, 0.95, 0.8]
    out = P.apply_top_p(flat, torch.tensor(ps), prefix=prefix)
    assert_same(out, rows_like_hf(flat, hf.TopPLogitsWarper, ps))
    assert torch.equal(out, P.apply_top_p(flat, torch.tensor(ps), prefix=V))
    assert torch.equal(out, P.apply_top_p(flat, torch.tensor(ps), prefix=None))  # the GPU's


def test_top_p_of_1_keeps_the_whole_tail_despite_rounding():
    # Float32 cumulative sums of many tiny probabilities reach 1.0 before the last token;
    # a row with top_p=1 must still keep every token.
    x = torch.cat([torch.tensor([[20.0]]), torch.full((1, 5000), -2.0)], dim=1)
    out = P.apply_top_p(x.repeat(2, 1), torch.tensor([1.0, 0.999999]))
    assert torch.equal(out[0], x[0])


def test_min_p_matches_hf(logits):
    ps = [0.0, 0.05, 0.2, 0.5, 1.0, 0.01]
    out = P.apply_min_p(logits, torch.tensor(ps))
    assert_same(out, rows_like_hf(logits, hf.MinPLogitsWarper, ps))
    assert torch.equal(out[0], logits[0])
    assert out[4].isfinite().sum() == 1  # min_p=1 keeps only the best


def test_typical_p_matches_hf(logits):
    masses = [0.2, 0.5, 0.9, 1.0, 0.95, 0.7]
    out = P.apply_typical_p(logits, torch.tensor(masses))
    expected = rows_like_hf(logits, lambda m: hf.TypicalLogitsWarper(m) if m < 1 else (lambda _, s: s), masses)
    assert_same(out, expected)
    assert torch.equal(out[3], logits[3])


def test_typical_p_after_other_filters_handles_minus_inf(logits):
    x = P.apply_top_k(logits, torch.tensor([10] * 6))
    masses = [0.3] * 6
    out = P.apply_typical_p(x, torch.tensor(masses))
    assert_same(out, rows_like_hf(x, hf.TypicalLogitsWarper, masses))
    assert (out.isfinite().sum(dim=1) >= 1).all()


def test_repetition_penalty_matches_hf(logits):
    torch.manual_seed(1)
    seen_ids = [torch.randint(0, V, (n,)) for n in (5, 0, 12, 30, 1, 8)]
    penalties = [1.3, 1.5, 0.7, 2.0, 1.0, 1.15]
    seen = P.token_counts([ids.tolist() for ids in seen_ids], V, torch.device("cpu")) > 0
    out = P.apply_repetition_penalty(logits, seen, torch.tensor(penalties))
    for r, (ids, penalty) in enumerate(zip(seen_ids, penalties)):
        if len(ids) == 0:
            assert torch.equal(out[r], logits[r])
            continue
        expected = hf.RepetitionPenaltyLogitsProcessor(penalty)(ids.unsqueeze(0), logits[r:r + 1].clone())[0]
        assert_same(out[r], expected)
    assert torch.equal(out[4], logits[4])


def test_token_counts_count_repeats_and_ignore_ids_past_the_vocab():
    counts = P.token_counts([[3, 3, 5], [], [V - 1, V + 7, 0]], V, torch.device("cpu"))
    assert counts.shape == (3, V)
    assert counts[0, 3] == 2 and counts[0, 5] == 1 and counts[0].sum() == 3
    assert counts[1].sum() == 0
    assert counts[2, V - 1] == 1 and counts[2, 0] == 1 and counts[2].sum() == 2


def test_frequency_and_presence_penalties_follow_the_openai_formula(logits):
    torch.manual_seed(2)
    outputs = [torch.randint(0, 8, (n,)).tolist() for n in (6, 0, 10, 3, 9, 1)]
    freq = [0.5, 1.0, -0.3, 0.0, 2.0, 0.1]
    pres = [0.0, 0.7, 0.4, -1.2, 2.0, 0.0]
    counts = P.token_counts(outputs, V, torch.device("cpu"))
    out = P.apply_frequency_presence_penalties(logits, counts, torch.tensor(freq), torch.tensor(pres))
    expected = logits.clone()
    for r, ids in enumerate(outputs):  # OpenAI's documented formula, token by token
        for token in set(ids):
            expected[r, token] -= ids.count(token) * freq[r] + pres[r]
    assert_same(out, expected)


def test_logit_bias_matches_hf_sequence_bias(logits):
    rows, ids, bias = [0, 0, 2, 5, 5], [3, 7, 3, 0, V + 3], [5.0, -100.0, 0.5, -2.0, 9.0]
    out = P.apply_logit_bias(logits, rows, ids, bias)
    for r in range(6):
        mine = {(t,): b for rr, t, b in zip(rows, ids, bias) if rr == r and t < V}
        expected = (hf.SequenceBiasLogitsProcessor([[list(k), v] for k, v in mine.items()])(
            torch.zeros(1, 1, dtype=torch.long), logits[r:r + 1].clone())[0] if mine else logits[r])
        assert_same(out[r], expected)


def test_suppress_tokens_matches_hf_min_new_tokens(logits):
    eos = [2, 9]
    out = P.suppress_tokens(logits, [1, 1, 4], [2, 9, 2])
    processor = hf.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=3, min_new_tokens=5,
                                                     eos_token_id=eos)
    expected = processor(torch.zeros(1, 4, dtype=torch.long), logits[1:2].clone())[0]
    assert_same(out[1], expected)
    assert out[4, 2] == float("-inf") and out[4].isinf().sum() == 1
    assert torch.equal(out[[0, 2, 3, 5]], logits[[0, 2, 3, 5]])


# --- properties over random rows ----------------------------------------------------------------

finite_rows = st.lists(st.floats(-20, 20, width=32), min_size=2, max_size=40)


@settings(max_examples=200, deadline=None)
@given(row=finite_rows, top_p=st.floats(0.01, 1.0), min_p=st.floats(0.0, 1.0),
       typical=st.floats(0.01, 1.0), k=st.integers(0, 50))
def test_every_filter_keeps_the_best_token_and_only_removes(row, top_p, min_p, typical, k):
    x = torch.tensor([row])
    for out in (P.apply_top_p(x, torch.tensor([top_p])), P.apply_min_p(x, torch.tensor([min_p])),
                P.apply_typical_p(x, torch.tensor([typical])), P.apply_top_k(x, torch.tensor([k]))):
        kept = out.isfinite()
        assert kept.any()
        assert torch.equal(out[kept], x[kept])  # kept logits are untouched
    for out in (P.apply_top_p(x, torch.tensor([top_p])), P.apply_min_p(x, torch.tensor([min_p])),
                P.apply_top_k(x, torch.tensor([k]))):
        kept = out[0].isfinite()
        # what a top-k / top-p / min-p filter keeps is a prefix of the ranking
        assert x[0][kept].max() == x[0].max()
        assert x[0][kept].min() >= x[0][~kept].max() if (~kept).any() else True


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(finite_rows.filter(lambda r: len(r) == 8), min_size=1, max_size=6),
       data=st.data())
def test_a_batch_gives_each_row_what_it_gets_alone(rows, data):
    x = torch.tensor(rows)
    n = len(rows)
    top_p = torch.tensor(data.draw(st.lists(st.sampled_from([0.2, 0.6, 0.95, 1.0]), min_size=n, max_size=n)))
    typical = torch.tensor(data.draw(st.lists(st.sampled_from([0.3, 0.8, 1.0]), min_size=n, max_size=n)))
    min_p = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.1, 0.5]), min_size=n, max_size=n)))
    batched = P.apply_typical_p(P.apply_min_p(P.apply_top_p(x, top_p), min_p), typical)
    for r in range(n):
        alone = P.apply_typical_p(P.apply_min_p(P.apply_top_p(x[r:r + 1], top_p[r:r + 1]),
                                                min_p[r:r + 1]), typical[r:r + 1])
        assert torch.equal(batched[r], alone[0])
