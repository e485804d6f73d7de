"""Beam search (SamplingParams(use_beam_search=True)) against transformers' own beam search
on a tiny llama: the same hypotheses, in the same order, with the same scores, for each
early_stopping rule and several length penalties; then what the engine adds: beams that
share and copy KV blocks (prefix caching, small blocks), beside other requests, under
preemption, and requests it refuses."""
from __future__ import annotations

import math

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.engine.engine import RequestError
from tessera.sampling.params import SamplingParamsError

from tests.engine.llms import idle_checked_llms

VOCAB = 512
EOS = 2
NEW_TOKENS = 10

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


@pytest.fixture(scope="module")
def checkpoint(make_tiny_llama):
    """A tiny llama whose EOS logit is boosted, so that beams end by EOS as well as by length."""
    folder, model = make_tiny_llama(seed=3, initializer_range=0.1)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 4
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture
def make_llm(checkpoint):
    with idle_checked_llms(checkpoint[0], num_kv_blocks=256) as make:
        yield make


def prompt_ids(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def hf_beams(model, prompt: list[int], width: int, n: int, **kwargs) -> list[tuple[list[int], float]]:
    """transformers' n best hypotheses: (generated tokens up to and with EOS, score)."""
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n, do_sample=False,
                         max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True, **kwargs)
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        generated = seq[len(prompt):]
        if EOS in generated:
            generated = generated[:generated.index(EOS) + 1]
        beams.append((generated, score))
    return beams


def beam_params(width: int, n: int, **kwargs) -> SamplingParams:
    return SamplingParams(use_beam_search=True, n=n, best_of=width, max_new_tokens=NEW_TOKENS, **kwargs)


def ours(out, length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    return [(list(c.token_ids), c.cumulative_logprob / len(c.token_ids) ** length_penalty) for c in out.outputs]


def assert_same_beams(got, expected) -> None:
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)


CASES = [  # (width, n, length_penalty, early_stopping)
    (2, 2, 1.0, False), (4, 3, 1.0, False), (4, 4, 0.0, "never"), (3, 2, 2.0, "never"),
    (4, 2, -1.0, True), (5, 5, 1.0, True),
]


@pytest.mark.parametrize("width,n,length_penalty,early_stopping", CASES)
def test_beams_match_transformers(make_llm, checkpoint, width, n, length_penalty, early_stopping):
    llm = make_llm()
    prompts = [prompt_ids(length, seed) for length, seed in ((5, 1), (9, 2), (14, 3), (3, 4))]
    params = beam_params(width, n, length_penalty=length_penalty, early_stopping=early_stopping)
    outs = llm.generate(prompts, params)
    ended_by_eos = 0
    for prompt, out in zip(prompts, outs):
        expected = hf_beams(checkpoint[1], prompt, width, n, length_penalty=length_penalty,
                            early_stopping=early_stopping)
        assert_same_beams(ours(out, length_penalty), expected)
        assert [c.index for c in out.outputs] == list(range(n))
        for c in out.outputs:
            assert c.finish_reason == ("eos_token" if c.token_ids[-1] == EOS else "length")
            ended_by_eos += c.finish_reason == "eos_token"
    if length_penalty <= 1.0:  # (a penalty of 2 favours the long ones)
        assert ended_by_eos, "test setup: some hypotheses should end by EOS"



PROCESSORS = [  # (ours, transformers'): applied to the log-probs, as transformers' beam search does
    (dict(min_tokens=4), dict(min_new_tokens=4)),
    (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
    (dict(logit_bias={EOS: 2.0, 7: 1.5}), dict(sequence_bias=[[[EOS], 2.0], [[7], 1.5]])),
]


@pytest.mark.parametrize("ours_kwargs,hf_kwargs", PROCESSORS, ids=["min_tokens", "repetition", "logit_bias"])
def test_beams_with_processors_match_transformers(make_llm, checkpoint, ours_kwargs, hf_kwargs):
    llm = make_llm()
    prompts = [prompt_ids(length, seed) for length, seed in ((5, 1), (9, 2), (6, 7), (3, 4))]
    outs = llm.generate(prompts, beam_params(3, 3, **ours_kwargs))
    for prompt, out in zip(prompts, outs):
        assert_same_beams(ours(out), hf_beams(checkpoint[1], prompt, 3, 3, **hf_kwargs))


def test_beams_share_blocks_and_copy_the_one_they_write(make_llm):
    """Prefix caching on or off, any block size: the same beams; forks share blocks (fewer
    taken than beams x blocks) and every block is given back."""
    prompt = prompt_ids(6, 5)
    params = beam_params(4, 4, ignore_eos=True)
    results = []
    for block_size, caching in ((4, True), (4, False), (16, True), (1, False)):
        llm = make_llm(block_size=block_size, enable_prefix_caching=caching)
        peak = [0]
        step = llm.engine.step

        def counting_step(*args, **kwargs):
            out = step(*args, **kwargs)
            manager = llm.engine.block_manager
            peak[0] = max(peak[0], manager.num_blocks - manager.num_free_blocks)
            return out

        llm.engine.step = counting_step
        results.append(ours(llm.generate([prompt], params)[0]))
        unshared = 4 * llm.engine.block_manager.num_blocks_for(len(prompt) + NEW_TOKENS)
        if block_size < len(prompt):  # (with one block a beam, each holds its own copy)
            assert peak[0] < unshared, (block_size, caching)
    for r in results[1:]:  # (scores to float32's noise: the attention sums in another order)
        assert_same_beams(r, results[0])


def test_beams_beside_other_requests_and_under_preemption(make_llm, checkpoint):
    """A beam search gives the same beams alone, in a batch with sampled, greedy and other
    beam requests, and with so few KV blocks that beams are preempted and recomputed."""
    prompts = [prompt_ids(7, 6), prompt_ids(12, 7)]
    params = beam_params(3, 2)
    alone = [ours(o) for o in make_llm().generate(prompts, params)]
    mixed_llm = make_llm(max_num_seqs=8)
    others = [SamplingParams(temperature=0.8, seed=1, max_new_tokens=12),
              SamplingParams(temperature=0, max_new_tokens=5)]
    mixed = mixed_llm.generate([prompts[0], prompt_ids(4, 8), prompts[1], prompt_ids(9, 9)],
                               [params, others[0], params, others[1]])
    assert_same_beams(ours(mixed[0]), alone[0])
    assert_same_beams(ours(mixed[2]), alone[1])
    crowd = prompts + [prompt_ids(10, 15)]
    long_params = beam_params(3, 2, ignore_eos=True)
    spacious = make_llm().generate(crowd, long_params)
    tight = make_llm(num_kv_blocks=18, block_size=4, max_num_seqs=9)
    for got, expected in zip(tight.generate(crowd, long_params), spacious):
        assert_same_beams(ours(got), ours(expected))
    assert tight.engine.scheduler.num_preemptions > 0, "test setup: the cache should be too small for both"


def test_beam_logprobs_and_text(make_llm):
    llm = make_llm()
    prompt = prompt_ids(8, 10)
    out = llm.generate([prompt], beam_params(3, 3, logprobs=2, ignore_eos=True))[0]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == NEW_TOKENS
        chosen = [pos[token].logprob for pos, token in zip(c.logprobs, c.token_ids)]
        assert math.isclose(sum(chosen), c.cumulative_logprob, rel_tol=1e-5)
        assert all(len(pos) <= 3 for pos in c.logprobs)  # the token and at most 2 alternatives
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
    scores = [c.cumulative_logprob / NEW_TOKENS for c in out.outputs]
    assert scores == sorted(scores, reverse=True)


def test_beam_logprobs_give_every_alternative_asked_for(make_llm):
    out = make_llm().generate([prompt_ids(6, 22)], beam_params(2, 2, logprobs=9, ignore_eos=True))[0]
    for c in out.outputs:  # (more than the 4 candidates a row keeps for a width of 2)
        assert all(len(pos) in (9, 10) for pos in c.logprobs)


def test_every_token_masked_ends_the_beams(make_llm):
    """Nothing may follow (only EOS allowed, and min_tokens forbids it): the request ends
    with its beams as they are (here its one, the prompt), as a sequence whose constraint
    allows nothing ends."""
    out = make_llm().generate([prompt_ids(5, 23)], beam_params(2, 2, allowed_token_ids=[EOS], min_tokens=2))[0]
    assert [c.finish_reason for c in out.outputs] == ["abort"]
    assert all(c.token_ids == [] for c in out.outputs)


def test_streamed_beams_come_whole_at_the_end(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("b", prompt_ids(6, 11), beam_params(2, 2))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert len(outputs) == 1 and outputs[0].finished
    for c in outputs[0].outputs:
        assert c.delta_token_ids == c.token_ids and c.delta_text == c.text


def test_async_scheduling_runs_beams_synchronously(make_llm):
    prompts = [prompt_ids(6, 12), prompt_ids(10, 13)]
    params = [beam_params(3, 2), SamplingParams(temperature=0, max_new_tokens=8)]
    plain = make_llm().generate(prompts, params)
    overlapped = make_llm(async_scheduling=True).generate(prompts, params)
    assert_same_beams(ours(overlapped[0]), ours(plain[0]))
    assert overlapped[1].outputs[0].token_ids == plain[1].outputs[0].token_ids


def test_abort_gives_back_every_beam_block(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("b", prompt_ids(9, 14), beam_params(4, 2, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine.requests["b"].group.seqs) == 4
    assert engine.abort("b")
    assert engine.block_manager.all_free() and not engine.has_unfinished()


def test_stop_strings_end_beams_as_transformers_stop_strings_do(make_llm, checkpoint):
    """A stop string ends a beam at the token whose text completes it, however tokens cut it
    (transformers' stop_strings criterion); the output text stops before it (or, with
    include_stop_str_in_output, after it) and stop_reason names it."""
    llm = make_llm()
    tokenizer = llm.get_tokenizer()
    prompts = [prompt_ids(5, 19), prompt_ids(8, 20), prompt_ids(6, 21)]
    plain = llm.generate(prompts, beam_params(3, 3))
    tested = 0  # returned beams that a stop string ended
    for prompt, free in zip(prompts, plain):
        text = free.outputs[0].text  # two letters the best beam writes, after its first character
        stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].isalpha()), None)
        if stop is None:
            continue
        for include in (False, True):
            out = llm.generate([prompt], beam_params(3, 3, stop=[stop], include_stop_str_in_output=include))[0]
            hf = checkpoint[1].generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                                        max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=0,
                                        stop_strings=[stop], tokenizer=tokenizer, output_scores=True,
                                        return_dict_in_generate=True)
            expected = []
            for seq, score in zip(hf.sequences.tolist(), hf.sequences_scores.tolist()):
                generated = seq[len(prompt):]
                ends = [i + 1 for i in range(len(generated)) if generated[i] == EOS
                        or stop in tokenizer.decode(generated[:i + 1])]
                expected.append((generated[:ends[0]] if ends else generated, score))
            assert_same_beams(ours(out), expected)
            stopped = [c for c in out.outputs if c.finish_reason == "stop_sequence"]
            tested += len(stopped)
            for c in stopped:
                full = tokenizer.decode(c.token_ids, skip_special_tokens=True)
                assert c.stop_reason == stop
                assert c.text == full[:full.index(stop) + (len(stop) if include else 0)]
    assert tested, "test setup: some returned beam should end at its stop string"


@pytest.mark.parametrize("kwargs,message", [
    (dict(structured_outputs={"regex": "a+"}), "structured outputs .* cannot be used with beam search"),
    (dict(do_sample=True), "`do_sample` cannot be used with beam search"),
    (dict(early_stopping="sometimes"), "`early_stopping` must be true, false or \"never\""),
    (dict(early_stopping=1), "`early_stopping` must be true, false or \"never\""),
    (dict(length_penalty=float("nan")), "`length_penalty` must be a finite number"),
])
def test_beam_parameters_refused(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(use_beam_search=True, n=2, **kwargs)


def test_beam_requests_the_engine_cannot_run(make_llm):
    llm = make_llm(max_num_seqs=4, num_kv_blocks=16)
    with pytest.raises(RequestError, match="its 5 beams exceed --max-num-seqs 4"):
        llm.engine.add_request("wide", prompt_ids(5, 1), beam_params(5, 1))
    with pytest.raises(RequestError, match="need 20 KV blocks, the cache holds 16"):
        llm.engine.add_request("long", prompt_ids(5, 1), SamplingParams(use_beam_search=True, best_of=4, max_tokens=12))
    assert llm.engine.requests == {}


def test_vllm_beam_search_call(make_llm, checkpoint):
    from tessera import BeamSearchParams

    llm = make_llm()
    prompt = prompt_ids(7, 16)
    got = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=NEW_TOKENS))
    expected = hf_beams(checkpoint[1], prompt, 3, 3)
    assert [s.tokens for s in got[0].sequences] == [prompt + tokens for tokens, _ in expected]
    for seq in got[0].sequences:  # (vLLM's text: every token decoded, special ones kept)
        assert seq.text == llm.get_tokenizer().decode(seq.tokens)


def test_beams_across_two_ranks(make_llm, checkpoint):
    """Under tensor parallelism every rank forks the same blocks: the beams of one rank."""
    prompts = [prompt_ids(6, 17), prompt_ids(11, 18)]
    params = beam_params(3, 3)
    alone = make_llm().generate(prompts, params)
    with LLM(checkpoint[0], dtype="float32", show_progress=False, num_kv_blocks=256, block_size=4,
             tensor_parallel_size=2) as llm:
        for got, expected in zip(llm.generate(prompts, params), alone):
            assert_same_beams(ours(got), ours(expected))
        assert llm.engine.block_manager.all_free()
