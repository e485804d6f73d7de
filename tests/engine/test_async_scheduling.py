"""Async scheduling (step N+1 launched before step N's tokens reach the host) gives exactly
the outputs of the synchronous engine: greedy and seeded sampling, stop tokens and strings
found a step late, length limits, preemption, prefix caching, chunked prefill, n / best_of,
logprobs, penalties and min_tokens (which wait for the host), aborts while a step is in
flight, and streamed deltas. Every engine ends with all KV blocks free and no pending
tokens."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.config import ConfigError
from tessera.engine.outputs import Logprob
from tessera.runner.model_runner import ModelRunner
from tests.engine.test_engine import TEXTS, tiny  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


@pytest.fixture
def make_pair(tiny):
    """make_pair(**kwargs) -> (synchronous LLM, async LLM) with the same settings."""
    built: list[LLM] = []

    def make(folder=None, **kwargs) -> tuple[LLM, LLM]:
        kwargs.setdefault("num_kv_blocks", 256)
        kwargs.setdefault("block_size", 4)
        kwargs.setdefault("dtype", "float32")
        pair = tuple(LLM(folder or tiny, show_progress=False, async_scheduling=flag, **kwargs)
                     for flag in (False, True))
        built.extend(pair)
        return pair

    yield make
    for llm in built:
        engine = llm.engine
        assert not engine.has_unfinished() and engine._in_flight is None
        assert engine.block_manager.all_free()
        assert engine.requests == {}


def summary(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
             for c in o.outputs] + [o.prompt_logprobs] for o in outputs]


def close_to(outputs) -> list:
    """summary(outputs) with every logprob compared to 1e-5: tokens, text and ranks are
    exact, but the two engines' steps hold different rows, and on some CPUs (AVX512-FP16 /
    AMX hosts) a float32 GEMM rounds its last bit differently for another row count."""
    def near(value: float | None):
        return None if value is None else pytest.approx(value, rel=1e-5, abs=1e-5)

    def positions(logprobs):
        if logprobs is None:
            return None
        return [None if p is None else {t: Logprob(near(lp.logprob), lp.rank, lp.decoded_token)
                                        for t, lp in p.items()} for p in logprobs]

    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, near(c.cumulative_logprob),
              positions(c.logprobs)) for c in o.outputs] + [positions(o.prompt_logprobs)] for o in outputs]


def greedy_tokens(llm: LLM, prompts, max_new_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_and_seeded_outputs_with_early_stops_match_the_sync_engine(make_pair):
    sync, async_ = make_pair()
    full = greedy_tokens(sync, TEXTS)
    # stop tokens and stop strings taken from the greedy continuations end rows mid-batch,
    # one step before the engine reads them: async has then given those rows a wasted step
    params = []
    for i, tokens in enumerate(full):
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=[tokens[3 + i]]))
        elif i % 4 == 1:
            text = sync.tokenizer.decode(tokens[:12])
            params.append(SamplingParams(temperature=0.0, max_new_tokens=24, stop=[text[-3:]], ignore_eos=True))
        elif i % 4 == 2:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_new_tokens=5 + i,
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_new_tokens=1 + i, ignore_eos=True))
    expected = sync.generate(TEXTS, params)
    assert any(o.outputs[0].finish_reason == "stop_sequence" for o in expected)
    assert summary(async_.generate(TEXTS, params)) == close_to(expected)


def test_no_step_computes_past_a_length_limit(make_pair, monkeypatch):
    """A row whose pending token reaches max_tokens or max_model_len gets no further step
    (its position would be out of range), so with only length stops nothing is wasted."""
    sync, async_ = make_pair(max_model_len=20)
    rows: dict[bool, int] = {False: 0, True: 0}  # rows computed, by async
    launch = ModelRunner.launch

    def counting(self, scheduled, previous=None):
        for item in scheduled:
            seq = item.seq
            assert seq.num_computed_tokens + item.num_new_tokens <= seq.max_total_tokens
        rows[self is async_.engine.runner] += sum(i.num_new_tokens for i in scheduled)
        return launch(self, scheduled, previous)

    monkeypatch.setattr(ModelRunner, "launch", counting)
    prompts = [list(range(3, 3 + n)) for n in (10, 12, 14, 5)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=m, ignore_eos=True) for m in (100, 3, 100, 7)]
    expected = sync.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in expected] == [10, 3, 6, 7]
    assert summary(async_.generate(prompts, params)) == close_to(expected)
    assert rows[True] == rows[False]


def test_bf16_replayed_decode_graphs_read_the_deferred_tokens(make_pair):
    """In bfloat16 on CPU decode steps replay captured kernel graphs, whose input buffers
    must take the tokens filled in on the device side (length stops only: both engines run
    the same batches, so even batch-size-dependent kernels agree)."""
    sync, async_ = make_pair(dtype="bfloat16")
    params = [SamplingParams(temperature=0.0, max_new_tokens=3 + 3 * i, ignore_eos=True) for i in range(len(TEXTS))]
    expected = sync.generate(TEXTS, params)
    assert summary(async_.generate(TEXTS, params)) == close_to(expected)
    graphs = async_.engine.runner.graphs
    assert graphs is not None and graphs.captured_sizes  # decodes after the first replay


@pytest.mark.parametrize("settings", [
    dict(num_kv_blocks=12),                                            # preemption
    dict(block_size=8, num_kv_blocks=6, max_num_batched_tokens=16, max_num_seqs=4),
    dict(max_num_batched_tokens=8, max_num_seqs=8),                    # chunked prefill
    dict(enable_prefix_caching=False),
])
def test_preemption_chunking_and_cache_settings_match(make_pair, settings):
    sync, async_ = make_pair(**settings)
    prompts = TEXTS + [TEXTS[0] + " again", TEXTS[0] + " and once more"]  # shared prefixes
    params = SamplingParams(temperature=0.8, seed=3, max_new_tokens=20, ignore_eos=True)
    expected = sync.generate(prompts, params)
    assert summary(async_.generate(prompts, params)) == close_to(expected)
    if settings.get("num_kv_blocks") == 12:
        assert async_.engine.scheduler.num_preemptions > 0


def test_history_dependent_sampling_and_logprobs_match(make_pair):
    """Penalties and min_tokens make a step wait for the last one's tokens; logprobs,
    prompt logprobs and n / best_of ride along."""
    sync, async_ = make_pair()
    eos = sorted(sync.engine.router.eos_token_ids)[0]
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=16, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, seed=5, max_new_tokens=16, frequency_penalty=0.8,
                       presence_penalty=0.3, logprobs=3),
        SamplingParams(temperature=0.0, max_new_tokens=16, min_tokens=6, stop_token_ids=[eos]),
        SamplingParams(temperature=0.8, seed=9, n=2, best_of=3, max_new_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=6, prompt_logprobs=2, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True),
    ]
    prompts = TEXTS[:len(params)]
    expected = sync.generate(prompts, params)
    assert summary(async_.generate(prompts, params)) == close_to(expected)


def test_watermark_alone_waits_for_the_last_token(make_pair):
    """The watermark's list is seeded by the last token, so even without penalties in the
    batch, a step waits for the one before it."""
    sync, async_ = make_pair()
    params = [SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, watermark=True),
              SamplingParams(temperature=0.9, seed=4, max_new_tokens=12, ignore_eos=True, watermark=True)]
    expected = sync.generate(TEXTS[:2], params)
    assert summary(async_.generate(TEXTS[:2], params)) == close_to(expected)


def test_streamed_deltas_match_step_for_step(make_pair):
    sync, async_ = make_pair()
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop=["e"], include_stop_str_in_output=True)

    def stream(llm: LLM) -> dict[str, list[tuple[str, list[int], bool]]]:
        engine = llm.engine
        for i, text in enumerate(TEXTS):
            engine.add_request(str(i), text, params)
        got: dict[str, list] = {}
        while engine.has_unfinished():
            for out in engine.step():
                c = out.outputs[0]
                got.setdefault(out.request_id, []).append((c.delta_text, c.delta_token_ids, out.finished))
        return got

    expected = stream(sync)
    assert stream(async_) == expected
    assert all(deltas[-1][2] for deltas in expected.values())


def test_abort_while_a_step_is_in_flight(make_pair):
    sync, async_ = make_pair(num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    results = []
    for llm in (sync, async_):
        engine = llm.engine
        for i in range(3):
            engine.add_request(str(i), TEXTS[i], params)
        for _ in range(4):
            engine.step()
        assert engine.abort("1")
        finals = {}
        while engine.has_unfinished():
            for out in engine.step():
                assert out.request_id != "1"
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids
        results.append(finals)
    assert results[0] == results[1] and set(results[0]) == {"0", "2"}


def test_async_scheduling_refuses_tensor_parallelism(tiny):
    with pytest.raises(ConfigError, match="async scheduling"):
        LLM(tiny, dtype="float32", show_progress=False, async_scheduling=True, tensor_parallel_size=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_launch_never_waits_for_the_device(make_tiny_llama):
    """On CUDA a decode step (graph replay or eager, greedy or sampled, with logprobs or
    not) is queued without
    any host-device synchronisation, or nothing would overlap; and the tokens equal the
    synchronous engine's (length stops only, so both run the same batches)."""
    folder, _ = make_tiny_llama(seed=3)
    prompts = [[5 + i, 6, 7 + 2 * i] * (1 + i % 4) for i in range(11)]
    params = [SamplingParams(max_new_tokens=4 + 2 * i, ignore_eos=True, logprobs=2 if i % 3 == 0 else None,
                             **(dict(temperature=0.0) if i % 2 else dict(temperature=0.9, top_p=0.9, seed=i)))
              for i in range(11)]
    results = {}
    for eager in (True, False):
        for flag in (False, True):
            with LLM(folder, dtype="float32", device="cuda", num_kv_blocks=128, block_size=16,
                     max_num_seqs=16, enforce_eager=eager, async_scheduling=flag,
                     show_progress=False) as llm:
                runner = llm.engine.runner
                launch, checked = runner.launch, []

                def no_sync_launch(scheduled, previous=None):
                    if previous is None or any(item.num_new_tokens != 1 for item in scheduled):
                        return launch(scheduled, previous)
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        return launch(scheduled, previous)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                        checked.append(len(scheduled))

                runner.launch = no_sync_launch
                outs = llm.generate(prompts, params, use_tqdm=False)
                results[eager, flag] = [o.outputs[0].token_ids for o in outs]
                assert bool(checked) == flag
    assert results[True, True] == results[True, False]
    assert results[False, True] == results[False, False]


def test_outputs_processed_before_a_failed_launch_are_delivered_by_the_next_step(make_pair, monkeypatch):
    """A step that waits for the last one's tokens (a penalty row) processes them before
    launching; if that launch raises, those outputs (here a request's final one) must not
    be lost with the exception."""
    finals_by_mode = []
    for llm in make_pair():
        engine = llm.engine
        engine.add_request("short", TEXTS[0], SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
        engine.add_request("pen", TEXTS[1], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True,
                                                           presence_penalty=0.5))
        launch, calls, finals, failures = engine.runner.launch, [0], {}, 0

        def flaky(scheduled, previous=None):
            calls[0] += 1
            if calls[0] == 3:  # the step after "short" got its last token
                raise RuntimeError("transient launch failure")
            return launch(scheduled, previous)

        monkeypatch.setattr(engine.runner, "launch", flaky)
        while engine.has_unfinished():
            try:
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out.outputs[0].finish_reason
            except RuntimeError:
                failures += 1
        assert failures == 1
        finals_by_mode.append(finals)
    assert finals_by_mode[0] == finals_by_mode[1] == {"short": "length", "pen": "length"}
