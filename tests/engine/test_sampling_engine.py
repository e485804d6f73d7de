"""Sampling parameters end to end on a tiny llama, against transformers where it has the
same feature (greedy generate with repetition_penalty, sequence_bias, min_new_tokens;
logits for logprobs) and a step-by-step reference loop over transformers' logits where
it has not (frequency / presence penalties). Then n / best_of, prompt logprobs under
chunked prefill, preemption and prefix caching, and seeds in mixed batches."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.engine.engine import RequestError

from tests.engine.llms import idle_checked_llms

VOCAB = 512
EOS = 2
ATOL = 1e-4  # float32 on both sides; see tests/models/test_llama_parity.py


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


@pytest.fixture(scope="module")
def checkpoint(make_tiny_llama):
    # Bolder weights than transformers' default init: logits spread over a few units, so
    # greedy choices have margins far above float32 noise.
    return make_tiny_llama(seed=3, initializer_range=0.1)


@pytest.fixture
def make_llm(checkpoint):
    with idle_checked_llms(checkpoint[0], num_kv_blocks=128) as make:
        yield make


@pytest.fixture
def hf_model(checkpoint):
    return checkpoint[1]


def prompt_ids(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_generate(model, prompt: list[int], n: int, **kwargs) -> list[int]:
    kwargs.setdefault("eos_token_id", None)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def reference_greedy(model, prompt: list[int], n: int, process) -> list[int]:
    """Greedy decoding over transformers' logits, with `process(logits, output_ids)`."""
    ids = list(prompt)
    for _ in range(n):
        logits = process(hf_logits(model, ids)[-1], ids[len(prompt):])
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def tokens(out) -> list[int]:
    return out.outputs[0].token_ids


# --- penalties and bias against transformers ------------------------------------------------

@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_matches_hf_generate(make_llm, hf_model, penalty):
    llm = make_llm()
    prompts = [prompt_ids(9, 1), prompt_ids(20, 2)]
    params = SamplingParams(temperature=0, repetition_penalty=penalty, max_new_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert tokens(out) == hf_generate(hf_model, prompt, 16, repetition_penalty=penalty)
    plain = llm.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
    assert tokens(plain[0]) != tokens(outs[0]), "test setup: the penalty should change the output"


def test_logit_bias_and_min_tokens_match_hf_sequence_bias_and_min_new_tokens(make_llm, hf_model):
    llm = make_llm()
    prompt = prompt_ids(11, 3)
    params = SamplingParams(temperature=0, min_tokens=5, logit_bias={EOS: 6.0, 7: 3.0}, max_new_tokens=20)
    out = llm.generate([prompt], params)[0]
    expected = hf_generate(hf_model, prompt, 20, eos_token_id=EOS, min_new_tokens=5,
                           sequence_bias=[[[EOS], 6.0], [[7], 3.0]])
    assert tokens(out) == expected
    assert expected[-1] == EOS and len(expected) == 6, "test setup: EOS right after min_tokens"
    assert out.outputs[0].finish_reason == "eos_token" and out.outputs[0].stop_reason is None


def test_frequency_and_presence_penalties_match_the_openai_formula(make_llm, hf_model):
    llm = make_llm()
    prompt = prompt_ids(7, 4)
    freq, pres = 0.9, 0.6
    out = llm.generate([prompt], SamplingParams(temperature=0, frequency_penalty=freq, presence_penalty=pres,
                                                max_new_tokens=14, ignore_eos=True))[0]

    def openai(logits, output):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
        return logits - freq * counts - pres * (counts > 0).float()

    assert tokens(out) == reference_greedy(hf_model, prompt, 14, openai)


# --- logprobs -----------------------------------------------------------------------------------

def test_logprobs_match_hf_log_softmax(make_llm, hf_model):
    llm = make_llm()
    prompt = prompt_ids(13, 5)
    out = llm.generate([prompt], SamplingParams(temperature=0, logprobs=3, max_new_tokens=6,
                                                ignore_eos=True))[0].outputs[0]
    reference = hf_logits(hf_model, prompt + out.token_ids).log_softmax(-1)
    assert len(out.logprobs) == 6
    total = 0.0
    for k, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[len(prompt) - 1 + k]
        assert list(position)[0] == token  # the chosen token first
        assert position[token].rank == 1   # greedy
        assert position[token].logprob == pytest.approx(float(row[token]), abs=ATOL)
        top = row.topk(3)
        assert list(position) == top.indices.tolist()  # chosen = best, then the others
        assert [p.logprob for p in position.values()] == pytest.approx(top.values.tolist(), abs=ATOL)
        assert [p.rank for p in position.values()] == [1, 2, 3]
        assert position[token].decoded_token == llm.tokenizer.decode([token])
        total += position[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)
    assert out.delta_logprobs == out.logprobs[-1:]  # the last step's token


def test_sampled_token_logprob_and_rank_are_raw(make_llm, hf_model):
    llm = make_llm()
    prompt = prompt_ids(6, 6)
    out = llm.generate([prompt], SamplingParams(temperature=1.5, top_k=20, seed=3, logprobs=0,
                                                max_new_tokens=8, ignore_eos=True))[0].outputs[0]
    reference = hf_logits(hf_model, prompt + out.token_ids).log_softmax(-1)
    for k, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[len(prompt) - 1 + k]
        assert list(position) == [token]
        assert position[token].logprob == pytest.approx(float(row[token]), abs=ATOL)
        assert position[token].rank == int((row > row[token]).sum()) + 1
    assert any(p[t].rank > 1 for t, p in zip(out.token_ids, out.logprobs)), "test setup: sampled"


def test_streamed_logprobs_arrive_with_their_tokens(make_llm):
    llm = make_llm()
    streamed = []
    for _, out in llm.generate_stream([prompt_ids(5, 7)], SamplingParams(temperature=0, logprobs=2,
                                                                         max_new_tokens=5, ignore_eos=True)):
        c = out.outputs[0]
        assert len(c.delta_logprobs) == len(c.delta_token_ids) == 1
        assert list(c.delta_logprobs[0])[0] == c.delta_token_ids[0]
        streamed += c.delta_logprobs
    assert streamed == c.logprobs


@pytest.mark.parametrize("engine", [
    dict(),                                                   # one prefill
    dict(max_num_batched_tokens=8, max_num_seqs=4),           # prompt in chunks
    dict(num_kv_blocks=14, max_num_batched_tokens=16, max_num_seqs=4),  # preemption
])
def test_prompt_logprobs_match_hf(make_llm, hf_model, engine):
    llm = make_llm(**engine)
    check_prompt_logprobs(llm, hf_model)
    if "num_kv_blocks" in engine:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prompt_logprobs_in_lm_head_passes_of_bounded_rows(make_llm, hf_model, monkeypatch):
    """The LM head takes prompt-logprob rows a few at a time (a long prompt's
    [positions, vocab] logits never exist whole): passes of at most 4 rows here, still
    every logprob right, and the sampled rows of the same step in a pass of their own."""
    import tessera.runner.model_runner as model_runner

    monkeypatch.setattr(model_runner, "PROMPT_LOGIT_ROWS", 4)
    llm = make_llm(max_num_batched_tokens=64)
    rows_per_pass: list[int] = []
    model = llm.engine.runner.model
    original = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: rows_per_pass.append(h.shape[0]) or original(h))
    check_prompt_logprobs(llm, hf_model)
    assert max(rows_per_pass) == 4 and rows_per_pass.count(4) >= (24 + 16 + 29) // 4


def check_prompt_logprobs(llm: LLM, hf_model) -> None:
    prompts = [prompt_ids(n, 8 + n) for n in (25, 3, 17, 30)]
    params = SamplingParams(temperature=0, prompt_logprobs=2, max_new_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        reference = hf_logits(hf_model, prompt).log_softmax(-1)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for p in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[p], reference[p - 1]
            assert list(entry)[0] == prompt[p]
            assert entry[prompt[p]].logprob == pytest.approx(float(row[prompt[p]]), abs=ATOL)
            assert entry[prompt[p]].rank == int((row > row[prompt[p]]).sum()) + 1
            top = sorted((t for t in entry if entry[t].rank <= 2), key=lambda t: entry[t].rank)
            assert top == row.topk(2).indices.tolist()
            assert len(entry) == 2 + (entry[prompt[p]].rank > 2)
    # the same greedy tokens as without prompt logprobs
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    assert [tokens(o) for o in outs] == [tokens(o) for o in plain]


def test_prompt_logprobs_are_complete_even_when_the_prefix_is_cached(make_llm):
    llm = make_llm()
    prompt = prompt_ids(26, 9)
    llm.generate([prompt], SamplingParams(temperature=0, max_new_tokens=2))  # caches the prompt
    hits = llm.engine.block_manager.prefix_hits
    out = llm.generate([prompt], SamplingParams(temperature=0, prompt_logprobs=0, max_new_tokens=2))[0]
    assert llm.engine.block_manager.prefix_hits == hits  # no cached prefix was used
    assert len(out.prompt_logprobs) == 26 and all(len(e) == 1 for e in out.prompt_logprobs[1:])
    again = llm.generate([prompt], SamplingParams(temperature=0, max_new_tokens=2))[0]
    assert llm.engine.block_manager.prefix_hits > hits  # and without them, reuse goes on
    assert again.prompt_logprobs is None


# --- n and best_of ------------------------------------------------------------------------------

def test_n_sequences_use_seed_plus_index(make_llm):
    llm = make_llm()
    prompt = prompt_ids(10, 10)
    base = dict(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    out = llm.generate([prompt], SamplingParams(n=3, seed=100, **base))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [tokens(llm.generate([prompt], SamplingParams(seed=100 + i, **base))[0]) for i in range(3)]
    assert [c.token_ids for c in out.outputs] == singles
    assert len({tuple(s) for s in singles}) == 3, "test setup: different seeds, different outputs"
    assert all(c.cumulative_logprob is None for c in out.outputs)  # not asked for


def test_n_sequences_share_the_cached_prompt(make_llm):
    llm = make_llm()
    prompt = prompt_ids(40, 11)
    llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_new_tokens=3, ignore_eos=True))
    bm = llm.engine.block_manager
    assert bm.prefix_hits >= 3 * (39 // 4) * 4  # the 3 later sequences found the prompt's blocks


def test_best_of_returns_the_n_best_by_cumulative_logprob(make_llm):
    llm = make_llm()
    prompt = prompt_ids(8, 12)
    base = dict(temperature=1.2, max_new_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], SamplingParams(n=2, best_of=5, seed=7, **base))[0]
    singles = [llm.generate([prompt], SamplingParams(seed=7 + i, logprobs=0, **base))[0].outputs[0]
               for i in range(5)]
    ranked = sorted(range(5), key=lambda i: -singles[i].cumulative_logprob)
    assert [c.index for c in out.outputs] == ranked[:2]
    for c in out.outputs:
        assert c.token_ids == singles[c.index].token_ids
        assert c.cumulative_logprob == pytest.approx(singles[c.index].cumulative_logprob, abs=1e-4)
        assert c.logprobs is None


def test_n_streams_every_sequence_and_finishes_once(make_llm):
    llm = make_llm()
    per_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
    ends = []
    outputs = list(llm.generate_stream([prompt_ids(9, 13)], SamplingParams(
        n=3, seed=1, temperature=1.0, max_new_tokens=6, ignore_eos=True)))
    for _, out in outputs:
        for c in out.outputs:
            per_index[c.index] += c.delta_token_ids
            if c.finish_reason and c.delta_token_ids:
                ends.append(c.index)
    assert [o.finished for _, o in outputs].count(True) == 1 and outputs[-1][1].finished
    final = outputs[-1][1]
    assert sorted(ends) == [0, 1, 2]
    assert [per_index[i] for i in range(3)] == [c.token_ids for c in final.outputs]


def test_abort_of_an_n_request_frees_every_sequence(make_llm):
    llm = make_llm()
    engine = llm.engine
    first = engine.add_request("multi", prompt_ids(12, 14), SamplingParams(n=3, temperature=1.0,
                                                                             max_new_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert all(s.block_table for s in first.group.seqs)
    assert engine.abort("multi")
    assert engine.block_manager.all_free() and not engine.has_unfinished()
    assert all(s.finish_reason.value == "abort" for s in first.group.seqs)


def test_abort_before_the_other_sequences_joined(make_llm):
    llm = make_llm()
    engine = llm.engine
    first = engine.add_request("multi", prompt_ids(12, 15), SamplingParams(n=2, temperature=1.0))
    assert first.group.pending
    assert engine.abort("multi")
    assert not engine.has_unfinished() and engine.block_manager.all_free()
    assert engine.step() == []


# --- seeds and validation -----------------------------------------------------------------------

def test_same_seed_same_output_next_to_any_processors(make_llm):
    llm = make_llm()
    prompt = prompt_ids(10, 16)
    target = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.02, typical_p=0.99,
                            repetition_penalty=1.1, presence_penalty=0.3, seed=77,
                            max_new_tokens=12, ignore_eos=True)
    alone = tokens(llm.generate([prompt], target)[0])
    others = [SamplingParams(temperature=0, repetition_penalty=1.4, max_new_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.1, top_k=5, frequency_penalty=1.0, max_new_tokens=4),
              SamplingParams(typical_p=0.5, logit_bias={5: 3.0}, logprobs=2, n=2, seed=1,
                             max_new_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.7, min_tokens=5, stop=["e"], max_new_tokens=15, prompt_logprobs=1)]
    mixed = llm.generate([prompt_ids(5, 1), prompt, prompt_ids(30, 2), prompt_ids(7, 3), prompt],
                         [others[0], target, others[1], others[2], others[3]])
    assert tokens(mixed[1]) == alone
    other = tokens(llm.generate([prompt], dataclasses.replace(target, seed=78))[0])
    assert other != alone


@pytest.mark.parametrize("params, match", [
    (SamplingParams(logprobs=VOCAB + 1), "`logprobs` must be <= the vocabulary size 512"),
    (SamplingParams(prompt_logprobs=VOCAB + 1), "`prompt_logprobs` must be <="),
    (SamplingParams(logit_bias={VOCAB: 1.0}), r"`logit_bias` token ids must be in \[0, 512\)"),
])
def test_params_beyond_the_vocabulary_are_request_errors(make_llm, params, match):
    llm = make_llm()
    with pytest.raises(RequestError, match=match):
        llm.generate([prompt_ids(4, 0)], params)


def test_finish_reasons_and_stop_reasons(make_llm):
    llm = make_llm()
    prompt = prompt_ids(6, 17)
    full = tokens(llm.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))[0])
    stop_token = next(t for i, t in enumerate(full) if i >= 2 and t not in full[:i])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12,
                                                stop_token_ids=[stop_token]))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop_sequence", stop_token)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_new_tokens=3))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    assert math.isfinite(llm.generate([prompt], SamplingParams(temperature=0, max_new_tokens=2, n=1,
                                                               logprobs=0))[0].outputs[0].cumulative_logprob)
