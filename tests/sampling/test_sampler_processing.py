"""The sampler with the full set of processors: distributions for min-p and typical-p (and
all warpers chained, against transformers' warpers), penalties, logit_bias and min_tokens
as the choice sees them, logprobs (raw and processed), and seeds in mixed batches."""
from __future__ import annotations

import pytest
import torch
from transformers.generation import logits_process as hf

from tessera.sampling import Sampler, SamplingBatch, SamplingParams

from .helpers import assert_frequencies_match, sample_many

EOS = 2


def batch_of(params: list[SamplingParams], token_ids: list[list[int]] | None = None,
             num_prompt: list[int] | None = None, generators=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params, generators or [None] * n, token_ids,
                         num_prompt if num_prompt is not None else ([0] * n if token_ids else None))


# --- distributions ------------------------------------------------------------------------------

def test_min_p_keeps_tokens_above_min_p_times_the_best():
    probs = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.03])
    logits = probs.log()
    draws = sample_many(logits, SamplingParams(min_p=0.3), 8000, seed=1)
    kept = torch.where(probs >= 0.3 * 0.35, probs, torch.zeros(()))  # 0.105: the first three
    assert set(draws.unique().tolist()) == {0, 1, 2}
    assert_frequencies_match(draws, kept / kept.sum())


def test_min_p_is_applied_after_temperature():
    probs = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.03])
    draws = sample_many(probs.log(), SamplingParams(min_p=0.3, temperature=3.0), 10000, seed=2)
    flat = (probs.log() / 3.0).softmax(-1)
    kept = torch.where(flat >= 0.3 * flat.max(), flat, torch.zeros(()))
    assert len(kept.nonzero()) > 3  # flatter: more tokens pass
    assert_frequencies_match(draws, kept / kept.sum())


def test_typical_p_can_drop_the_most_likely_token():
    # Entropy 1.33 nats; the 0.2 tokens (surprisal 1.61) are more typical than the 0.4
    # one (0.92), so mass 0.5 keeps the three 0.2 tokens and never the best one.
    logits = torch.tensor([0.4, 0.2, 0.2, 0.2]).log()
    draws = sample_many(logits, SamplingParams(typical_p=0.5), 6000, seed=3)
    assert 0 not in draws.tolist()
    assert_frequencies_match(draws, torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3]))


@pytest.mark.parametrize("mass", [0.3, 0.6, 0.9])
def test_typical_p_frequencies_match_hf_typical_warper(mass):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.9, 0.2, -0.5, -1.0, -2.0])
    draws = sample_many(logits, SamplingParams(typical_p=mass), 12000, seed=4)
    expected = hf.TypicalLogitsWarper(mass)(None, logits.unsqueeze(0).clone())[0].softmax(-1)
    assert_frequencies_match(draws, expected)


def test_all_warpers_chained_match_hf_order():
    logits = torch.tensor([3.0, 2.5, 2.2, 2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=7, top_p=0.97, min_p=0.02, typical_p=0.95)
    draws = sample_many(logits, params, 20000, seed=5)
    x = logits.unsqueeze(0).clone()
    for warper in (hf.TemperatureLogitsWarper(0.8), hf.TopKLogitsWarper(7), hf.TopPLogitsWarper(0.97),
                   hf.MinPLogitsWarper(0.02), hf.TypicalLogitsWarper(0.95)):
        x = warper(None, x)
    assert_frequencies_match(draws, x[0].softmax(-1))


def test_frequency_and_presence_penalties_shift_the_sampled_distribution():
    logits = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2])
    output = [0, 0, 0, 1]
    params = SamplingParams(frequency_penalty=0.3, presence_penalty=0.2)
    n = 12000
    rows = logits.unsqueeze(0).expand(n, -1).contiguous()
    draws = Sampler(6)(rows, batch_of([params] * n, [[9, 9] + output] * n, [2] * n))
    counts = torch.tensor([3.0, 1.0, 0.0, 0.0, 0.0])
    expected = (logits - 0.3 * counts - 0.2 * (counts > 0).float()).softmax(-1)
    assert_frequencies_match(draws, expected)


# --- penalties, bias and min_tokens as the greedy choice sees them --------------------------

def test_repetition_penalty_turns_the_greedy_choice_over_prompt_and_output_tokens():
    logits = torch.tensor([[2.0, 1.9, 1.0, -0.5], [2.0, 1.9, 1.0, -0.5], [2.0, 1.9, 1.0, -0.5]])
    params = [SamplingParams(temperature=0, repetition_penalty=1.2)] * 3
    token_ids = [[0], [3, 0], [1, 3]]  # row 0: 0 in the prompt; row 1: 0 in the output
    out = Sampler(0)(logits, batch_of(params, token_ids, [1, 1, 1]))
    assert out.tolist() == [1, 1, 0]  # 2.0 / 1.2 = 1.67 < 1.9; row 2 penalises 1 instead


def test_penalties_only_touch_rows_that_ask_for_them():
    torch.manual_seed(7)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=2.0),
              SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=3.0)]
    best = logits.argmax(-1).tolist()
    token_ids = [[best[r]] * 3 for r in range(4)]
    out = Sampler(0)(logits, batch_of(params, token_ids, [0] * 4)).tolist()
    assert out[0] == best[0] and out[2] == best[2]
    x = logits.clone()
    x[1, best[1]] -= 2.0
    assert out[1] == int(x[1].argmax())
    v = logits[3, best[3]]
    x[3, best[3]] = v / 3.0 if v > 0 else v * 3.0
    assert out[3] == int(x[3].argmax())


def test_logit_bias_forces_and_bans_tokens():
    torch.manual_seed(8)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0, logit_bias={17: 100}),
              SamplingParams(temperature=0, logit_bias={"5": 100.0, 6: 50}),  # JSON-style key
              SamplingParams(temperature=0)]
    out = Sampler(0)(logits, batch_of(params)).tolist()
    assert out == [17, 5, int(logits[2].argmax())]
    n = 3000
    banned = int(logits[0].argmax())
    rows = logits[0].unsqueeze(0).expand(n, -1).contiguous()
    draws = Sampler(1)(rows, batch_of([SamplingParams(logit_bias={banned: -100})] * n))
    assert banned not in draws.tolist()


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 1.0]] * 4)  # EOS=2 best, then 3
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])] * 2 + \
             [SamplingParams(temperature=0, min_tokens=2)] + [SamplingParams(temperature=0)]
    token_ids = [[7, 4], [7, 4, 4], [7, 4], [7]]  # output lengths 1, 2, 1, 0 (prompt [7])
    out = Sampler(0, eos_token_ids=[EOS])(logits, batch_of(params, token_ids, [1] * 4)).tolist()
    assert out == [4, EOS, 3, EOS]


# --- logprobs -----------------------------------------------------------------------------------

def test_raw_logprobs_of_the_chosen_token_and_top_alternatives():
    torch.manual_seed(9)
    logits = torch.randn(3, 40) * 2
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.7, top_k=5, logprobs=0),
              SamplingParams(temperature=0)]
    out = Sampler(0).sample(logits, batch_of(params))
    raw = logits.log_softmax(-1)
    first, second, third = out.logprobs
    assert third is None
    assert first.token_id == int(logits[0].argmax()) and first.rank == 1
    assert first.logprob == pytest.approx(float(raw[0].max()))
    values, ids = raw[0].topk(3)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(values.tolist())
    token = second.token_id
    assert second.top == []
    assert second.logprob == pytest.approx(float(raw[1, token]))  # raw: before temperature / top-k
    assert second.rank == int((raw[1] > raw[1, token]).sum()) + 1


def test_processed_logprobs_come_from_the_distribution_sampled_from():
    torch.manual_seed(10)
    logits = torch.randn(2, 40) * 2
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=5, seed=1),
              SamplingParams(temperature=0, presence_penalty=1.0, logprobs=2)]
    out = Sampler(0, logprobs_mode="processed").sample(logits, batch_of(params, [[], [0, 1]], [0, 0]))
    warped = hf.TopKLogitsWarper(3)(None, (logits[0:1] / 0.5))[0].log_softmax(-1)
    first, second = out.logprobs
    assert first.logprob == pytest.approx(float(warped[first.token_id]))
    assert [lp for _, lp in first.top][3:] == [float("-inf")] * 2  # filtered out by top-k
    penalised = logits[1].clone()
    penalised[[0, 1]] -= 1.0
    assert second.logprob == pytest.approx(float(penalised.log_softmax(-1).max()))


def test_unknown_logprobs_mode_is_rejected():
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(0, logprobs_mode="softmax")


def test_best_of_rows_get_their_logprob_without_alternatives():
    logits = torch.randn(1, 20)
    out = Sampler(0).sample(logits, batch_of([SamplingParams(n=1, best_of=3)]))
    assert out.logprobs[0] is not None and out.logprobs[0].top == []


# --- greedy or sampled, and seeds ---------------------------------------------------------------

def test_do_sample_false_is_greedy_unless_a_warper_is_set():
    logits = torch.linspace(0.0, -0.1, 10).expand(200, -1).contiguous()  # nearly flat, no ties
    greedy = Sampler(0)(logits, batch_of([SamplingParams(do_sample=False)] * 200))
    assert greedy.unique().tolist() == [0]
    warped = Sampler(0)(logits, batch_of([SamplingParams(do_sample=False, top_k=5)] * 200))
    assert set(warped.unique().tolist()) == set(range(5))
    sampled = Sampler(0)(logits, batch_of([SamplingParams(do_sample=True)] * 200))
    assert len(sampled.unique()) == 10


def test_seeded_row_is_independent_of_other_rows_processors():
    torch.manual_seed(12)
    logits = torch.randn(6, 80)
    target = SamplingParams(temperature=0.9, top_p=0.9, min_p=0.01, typical_p=0.98,
                            repetition_penalty=1.1, seed=3)
    others = [SamplingParams(temperature=0), SamplingParams(presence_penalty=1.0, top_k=4),
              SamplingParams(typical_p=0.4, seed=9), SamplingParams(min_p=0.2, logit_bias={1: 5}),
              SamplingParams(temperature=1.3, frequency_penalty=-1.0, min_tokens=3)]

    def run(rows: list[int]) -> list[int]:
        gens = {0: torch.Generator().manual_seed(3), 3: torch.Generator().manual_seed(9)}
        sampler = Sampler(42)
        history = {r: [r] for r in range(6)}
        out = []
        for _ in range(15):
            batch_rows = [0] + rows
            params = [target] + [others[r - 1] for r in rows]
            batch = SamplingBatch(params, [gens.get(r) for r in batch_rows],
                                  [history[r] for r in batch_rows], [1] * len(batch_rows))
            chosen = sampler(logits[batch_rows], batch).tolist()
            for r, token in zip(batch_rows, chosen):
                history[r].append(token)
            out.append(chosen[0])
        return out

    alone = run([])
    assert len(set(alone)) > 1
    assert run([1, 2, 3, 4, 5]) == alone
    assert run([5, 3]) == alone


def test_prompt_logprobs_in_chunks_equal_one_pass():
    from tessera.sampling.sampler import prompt_logprobs

    torch.manual_seed(13)
    logits = torch.randn(10, 30)
    targets = torch.randint(0, 30, (10,))
    num_top = [0, 1, 2, 3, 0, 5, 1, 1, 2, 4]
    whole = prompt_logprobs(logits, targets, num_top, chunk=100)
    assert prompt_logprobs(logits, targets, num_top, chunk=3) == whole
    lp = logits.log_softmax(-1)
    assert [w.logprob for w in whole] == pytest.approx(lp.gather(1, targets[:, None]).squeeze(1).tolist())
    assert [len(w.top) for w in whole] == num_top


def test_inverse_cdf_never_picks_a_token_of_probability_zero():
    from tessera.sampling.sampler import inverse_cdf

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]] * 5)
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 0.5, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(probs, uniforms).tolist() == [1, 1, 3, 3, 3]
    # the product rounding up to the total (forced here with u = 1) lands on the last possible token
    assert inverse_cdf(probs[:1], torch.tensor([1.0], dtype=torch.float64)).tolist() == [3]
    unnormalised = torch.tensor([[2.0, 0.0, 2.0, 0.0]] * 2)
    assert inverse_cdf(unnormalised, torch.tensor([0.49, 0.51], dtype=torch.float64)).tolist() == [0, 2]
