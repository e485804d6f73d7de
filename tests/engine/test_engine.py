"""The engine end to end on a tiny random llama: preemption and chunked prefill do not change
outputs, request errors leave nothing behind, seeded sampling is reproducible in any batch,
and sequences finish for the right reason. Every LLM built here must end with all KV blocks
free."""
from __future__ import annotations

import pytest

from tessera import LLM, SamplingParams
from tessera.config import ConfigError
from tessera.engine.engine import RequestError
from tessera.engine.sequence import FinishReason, SequenceStatus

from tests.engine.llms import idle_checked_llms

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache",
    "Continuous batching lets requests join between steps.",
    "def fibonacci(n): return n",
    "Café, naïve",
    "fixed-size blocks",
    "The lazy dog sleeps while the quick brown fox jumps.",
    "emoji and other unicode text",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


@pytest.fixture(scope="module")
def tiny(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=0)
    return folder


@pytest.fixture
def make_llm(tiny):
    with idle_checked_llms(tiny, num_kv_blocks=256) as make:
        yield make


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("small", [
    dict(block_size=4, num_kv_blocks=12),
    dict(block_size=8, num_kv_blocks=6, max_num_batched_tokens=16, max_num_seqs=4),
    dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=8, max_num_seqs=8),
])
def test_tiny_kv_cache_preempts_and_gives_the_same_greedy_outputs(make_llm, small):
    reference = make_llm(num_kv_blocks=512)
    expected = reference.generate(TEXTS, GREEDY)
    assert reference.engine.scheduler.num_preemptions == 0
    llm = make_llm(**small)
    scheduler = llm.engine.scheduler
    plans = []
    schedule = scheduler.schedule

    def spy():
        plan = schedule()
        plans.append((plan.num_batched_tokens, len(scheduler.running), len(plan.preempted)))
        return plan

    scheduler.schedule = spy
    outputs = llm.generate(TEXTS, GREEDY)
    assert scheduler.num_preemptions > 0
    assert sum(p for _, _, p in plans) == scheduler.num_preemptions
    budget, max_seqs = scheduler.config.max_num_batched_tokens, scheduler.config.max_num_seqs
    assert all(tokens <= budget and running <= max_seqs for tokens, running, _ in plans)
    assert token_ids(outputs) == token_ids(expected)
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in expected]
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outputs)
    assert [o.prompt for o in outputs] == TEXTS
    # A second run on the same engine (blocks reused in a different order) agrees too.
    assert token_ids(llm.generate(TEXTS[::-1], GREEDY)) == token_ids(expected)[::-1]


def test_chunked_prefill_gives_the_same_outputs_as_one_big_prefill(make_llm):
    long_prompt = list(range(3, 3 + 90))
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    expected = token_ids(make_llm().generate([long_prompt, TEXTS[0]], params))
    llm = make_llm(max_num_batched_tokens=8, max_num_seqs=2)
    assert token_ids(llm.generate([long_prompt, TEXTS[0]], params)) == expected
    no_chunks = make_llm(enable_chunked_prefill=False, max_num_batched_tokens=1024)
    assert token_ids(no_chunks.generate([long_prompt, TEXTS[0]], params)) == expected


def test_seeded_sampling_survives_preemption(make_llm):
    params = SamplingParams(temperature=0.8, seed=7, max_new_tokens=20, ignore_eos=True)
    expected = token_ids(make_llm(num_kv_blocks=512).generate(TEXTS, params))
    llm = make_llm(num_kv_blocks=12)
    assert token_ids(llm.generate(TEXTS, params)) == expected
    assert llm.engine.scheduler.num_preemptions > 0


def test_same_seed_same_tokens_alone_and_in_a_mixed_batch(make_llm):
    llm = make_llm()
    seeded = SamplingParams(temperature=0.8, seed=1234, max_new_tokens=12, ignore_eos=True)
    prompt = TEXTS[1]
    alone = token_ids(llm.generate([prompt], seeded))[0]
    assert alone == token_ids(llm.generate([prompt], seeded))[0]
    greedy = token_ids(llm.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                             ignore_eos=True)))[0]
    assert alone != greedy, "test setup: the sampled output should differ from greedy"
    mixed = llm.generate(
        [TEXTS[0], prompt, TEXTS[2], prompt, TEXTS[6], prompt],
        [SamplingParams(temperature=0.0, max_new_tokens=5),
         seeded,
         SamplingParams(temperature=0.8, seed=99, max_new_tokens=30, ignore_eos=True),
         SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True),  # engine generator
         SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=5, max_new_tokens=3),
         seeded])
    ids = token_ids(mixed)
    assert ids[1] == alone
    assert ids[5] == alone
    assert ids[3] != alone  # unseeded: follows the engine's generator, not seed 1234
    other_seed = token_ids(llm.generate([prompt], SamplingParams(temperature=0.8, seed=1235,
                                                                 max_new_tokens=12, ignore_eos=True)))[0]
    assert other_seed != alone


def test_finish_reason_length_at_max_new_tokens(make_llm):
    llm = make_llm()
    out = llm.generate(TEXTS[:3], SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True))
    for o in out:
        assert len(o.outputs[0].token_ids) == 5
        assert o.outputs[0].finish_reason == "length"


def test_finish_reason_length_at_max_model_len(make_llm):
    llm = make_llm(max_model_len=16)
    prompt = list(range(3, 13))  # 10 tokens: room for 6 more
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].finish_reason == "length"


def _first_fresh_index(tokens: list[int], start: int, avoid: set[int]) -> int:
    """An index >= start whose token occurs nowhere before it (and is not in `avoid`)."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i] and tokens[i] not in avoid and not avoid & set(tokens[:i]):
            return i
    pytest.skip("no suitable token in the greedy continuation")


def test_stop_token_ids_finish_with_stop_sequence(make_llm):
    llm = make_llm()
    full = token_ids(llm.generate([TEXTS[0]], GREEDY))[0]
    i = _first_fresh_index(full, 3, {2})
    stop = full[i]
    out = llm.generate([TEXTS[0]], SamplingParams(temperature=0.0, max_new_tokens=20,
                                                  stop_token_ids=[stop, 100_000]))[0]
    assert out.outputs[0].token_ids == full[:i + 1]  # the stop token is included
    assert out.outputs[0].finish_reason == "stop_sequence"


def test_eos_from_the_model_config_finishes_with_eos_token_and_ignore_eos_continues(make_tiny_llama, make_llm):
    reference = make_llm()
    full = token_ids(reference.generate([TEXTS[3]], GREEDY))[0]
    i = _first_fresh_index(full, 2, {2})
    eos = full[i]
    folder, _ = make_tiny_llama(seed=0, eos_token_id=eos)  # same weights, another EOS id
    llm = make_llm(folder)
    assert eos in llm.engine.router.eos_token_ids
    out = llm.generate([TEXTS[3]], SamplingParams(temperature=0.0, max_new_tokens=20))[0]
    assert out.outputs[0].token_ids == full[:i + 1]
    assert out.outputs[0].finish_reason == "eos_token"
    kept_going = llm.generate([TEXTS[3]], GREEDY)[0]
    assert kept_going.outputs[0].token_ids == full
    assert kept_going.outputs[0].finish_reason == "length"


def test_abort_of_a_running_request_frees_its_blocks(make_llm):
    llm = make_llm(num_kv_blocks=64)
    engine = llm.engine
    long_params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    a = engine.add_request("a", TEXTS[0], long_params)
    b = engine.add_request("b", TEXTS[1], long_params)
    c = engine.add_request("c", TEXTS[2], long_params)
    for _ in range(3):
        engine.step()
    assert a.status is SequenceStatus.RUNNING and a.block_table
    used_by_others = len(b.block_table) + len(c.block_table)
    assert engine.abort("a") is True
    assert a.block_table == [] and a.status is SequenceStatus.FINISHED
    assert a.finish_reason is FinishReason.ABORT
    assert engine.block_manager.num_free_blocks == 64 - used_by_others
    assert a not in engine.scheduler.running and "a" not in engine.requests
    assert engine.abort("a") is False
    assert engine.abort("never-added") is False
    # Aborting a waiting request works too.
    d = engine.add_request("d", TEXTS[3], long_params)
    assert d in engine.scheduler.waiting
    assert engine.abort("d") is True
    assert d not in engine.scheduler.waiting
    # The others run to completion, unaffected.
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"b", "c"}
    expected = token_ids(llm.generate([TEXTS[1], TEXTS[2]], long_params))
    assert [finished["b"].outputs[0].token_ids, finished["c"].outputs[0].token_ids] == expected
    assert engine.step() == []


def test_streamed_deltas_add_up_to_the_final_output(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("s", TEXTS[4], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    deltas, delta_ids, last = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            delta_ids += out.outputs[0].delta_token_ids
            last = out
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert delta_ids == last.outputs[0].token_ids
    assert "".join(deltas) == last.outputs[0].text


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    ([], "empty"),
    ([5, 512], r"\[0, 512\)"),
    ([5, -1], r"\[0, 512\)"),
    ([5, 1.5], "integers"),
    ([5] * 32, "max_model_len"),
])
def test_invalid_requests_raise_and_leave_nothing_queued(make_llm, prompt, match):
    llm = make_llm(max_model_len=32)
    with pytest.raises(RequestError, match=match):
        llm.engine.add_request("bad", prompt, SamplingParams())
    assert llm.engine.requests == {}
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
    assert not llm.engine.has_unfinished()
    # One token fewer than max_model_len is accepted (and has room for one new token).
    out = llm.generate([[5] * 31], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 1


def test_duplicate_request_id_is_rejected_and_the_original_kept(make_llm):
    llm = make_llm()
    engine = llm.engine
    first = engine.add_request("x", TEXTS[0], SamplingParams(max_new_tokens=2))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("x", TEXTS[1], SamplingParams(max_new_tokens=2))
    assert list(engine.scheduler.waiting) == [first]
    assert engine.requests == {"x": first}
    while engine.has_unfinished():
        engine.step()
    # Once finished, the id may be used again.
    engine.add_request("x", TEXTS[1], SamplingParams(max_new_tokens=1))
    while engine.has_unfinished():
        engine.step()


def test_a_bad_prompt_in_a_batch_queues_none_of_the_batch(make_llm):
    llm = make_llm()
    with pytest.raises(RequestError):
        llm.generate([TEXTS[0], TEXTS[1], [7, 9999]], SamplingParams(max_new_tokens=3))
    assert llm.engine.requests == {}
    assert not llm.engine.has_unfinished()
    # The engine is still usable afterwards.
    assert len(llm.generate(TEXTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
               .outputs[0].token_ids) == 3


def test_sampling_params_count_must_match_prompts(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(TEXTS[:3], [SamplingParams(), SamplingParams()])
    assert not llm.engine.has_unfinished()


def test_without_chunked_prefill_the_budget_must_cover_max_model_len(tiny):
    with pytest.raises(ConfigError, match="chunked prefill"):
        LLM(tiny, dtype="float32", num_kv_blocks=64, max_model_len=64, enable_chunked_prefill=False,
            max_num_batched_tokens=32, max_num_seqs=4, show_progress=False)


def test_kv_cache_sized_by_warm_up_is_capped_at_what_the_sequences_can_use(make_llm):
    llm = make_llm(num_kv_blocks=None, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    # 0.2 of free memory is far more than 4 sequences of max_model_len 512 tokens can use.
    assert llm.engine.num_blocks == 4 * (512 // 16)
    assert llm.engine.block_manager.num_blocks == llm.engine.num_blocks
    assert llm.engine.max_model_len == 512
    out = llm.generate(TEXTS[:2], SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]


def test_no_memory_for_one_block_is_a_config_error(tiny):
    with pytest.raises(ConfigError, match="not enough memory"):
        LLM(tiny, dtype="float32", memory_fraction=1e-12, max_num_seqs=4,
            max_num_batched_tokens=64, show_progress=False)


def test_a_step_that_raises_leaves_nothing_queued(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=64, block_size=4, show_progress=False)
    engine = llm.engine
    execute = engine.runner.execute
    calls = []

    def fail_on_second_step(scheduled):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return execute(scheduled)

    engine.runner.execute = fail_on_second_step
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(TEXTS[:2], SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True))
    engine.runner.execute = execute
    assert not engine.has_unfinished()
    assert engine.block_manager.all_free()
    out = llm.generate(TEXTS[2], SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))
    assert len(out) == 1


def test_vllm_prompt_dicts_give_what_plain_prompts_give(make_llm):
    llm = make_llm()
    ids = llm.tokenizer(TEXTS[0]).input_ids
    plain = token_ids(llm.generate([TEXTS[0], ids], GREEDY))
    assert token_ids(llm.generate([{"prompt": TEXTS[0]}, {"prompt_token_ids": ids}], GREEDY)) == plain
    assert token_ids(llm.generate({"prompt_token_ids": ids}, GREEDY)) == plain[1:]  # one dict alone


@pytest.mark.parametrize("prompt, match", [
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of 'prompt', 'prompt_token_ids'"),
    ({"text": "a"}, "exactly one of"), ({}, "exactly one of"),
    ({"prompt": [1, 2]}, "'prompt' is text"), ({"prompt_token_ids": "a"}, "list of token ids"),
])
def test_bad_prompt_dicts_are_refused(make_llm, prompt, match):
    llm = make_llm()
    with pytest.raises(ValueError, match=match):
        llm.generate([TEXTS[0], prompt], GREEDY)
    assert not llm.engine.has_unfinished()
