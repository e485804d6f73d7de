"""Speculative decoding with n-gram drafts: the proposer's lookups, and an engine whose
outputs are those of plain decoding (greedy: token for token, with penalties, min_tokens,
logit_bias, stop tokens and strings, length limits, preemption, prefix caching, small
token budgets, n / best_of, streaming; sampled: the same distribution), while it does
verify and accept drafts. Every engine ends with all KV blocks free."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.config import ConfigError, SchedulerConfig, SpeculativeConfig, speculative_config_from
from tessera.engine.block_manager import BlockManager
from tessera.engine.scheduler import Scheduler
from tessera.engine.ngram_proposer import NgramProposer, propose_ngram
from tessera.engine.sequence import Sequence, SequenceStatus
from tessera.runner.launched_step import num_accepted
from tessera.runner.model_runner import ModelRunner
from tessera.sampling.sampler import Sampler
from tests.engine.test_engine import TEXTS, tiny  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


def propose(tokens: list[int], k: int = 4, min_n: int = 2, max_n: int = 4) -> list[int]:
    return propose_ngram(np.array(tokens), len(tokens), k, min_n, max_n)


# --- the proposer -------------------------------------------------------------------------


def test_proposal_follows_the_most_recent_longest_match():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [1, 2, 3, 9, 8, 5, 2, 3, 7, 6, 4, 2, 3]
    # "2 3" occurs at 1-2 and 6-7; the most recent is followed by 7 6 4 2
    assert propose(tokens) == [7, 6, 4, 2]
    # a longer match wins over a more recent shorter one: "5 2 3" at 0-2, "2 3" at 5-6
    assert propose([5, 2, 3, 8, 1, 2, 3, 9, 5, 2, 3]) == [8, 1, 2, 3]
    assert propose(tokens, k=2) == [7, 6]


def test_no_proposal_without_a_long_enough_match():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1, 2, 3, 4, 3]) == []           # "3" alone is shorter than min_n = 2
    assert propose([1, 2, 3, 4, 3], min_n=1) == [4, 3, 4, 3]
    assert propose([7]) == []
    assert propose([1, 2, 1, 2], k=0) == []


def test_a_loop_is_proposed_past_the_end_of_the_history():
    # period 3: the match at 3-4 is followed by one real token, then by the proposal itself
    assert propose([5, 6, 7, 5, 6, 7, 5, 6], k=6) == [7, 5, 6, 7, 5, 6]
    assert propose([4, 4, 4], k=3) == [4, 4, 4]


def test_the_proposer_mirrors_growing_sequences_and_respects_length_limits():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=5))
    seq = Sequence("r", None, [1, 2, 3, 1, 2], SamplingParams(max_tokens=100), max_total_tokens=64)
    assert proposer.propose(seq) == [3, 1, 2, 3, 1]
    seq.token_ids += [9, 9, 1, 2]  # appended after the first lookup: mirrored incrementally
    assert proposer.propose(seq) == [9, 9, 1, 2, 9]
    # two output tokens left: at most one draft (the step's own token follows it)
    seq.params = SamplingParams(max_tokens=6)
    assert proposer.propose(seq) == [9]
    seq.params = SamplingParams(max_tokens=5)
    assert proposer.propose(seq) == []
    seq.params = SamplingParams(max_tokens=100)
    seq.max_total_tokens = seq.num_tokens + 3
    assert proposer.propose(seq) == [9, 9]


def test_num_accepted_stops_at_the_first_difference():
    assert num_accepted([1, 2, 3], [1, 2, 3, 4]) == 3
    assert num_accepted([1, 2, 3], [1, 5, 3, 4]) == 1
    assert num_accepted([1, 2, 3], [0, 2, 3, 4]) == 0


def test_speculative_config_parsing():
    assert speculative_config_from(None).enabled is False
    config = speculative_config_from({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1})
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (3, 1, 1)
    assert speculative_config_from({"num_speculative_tokens": 3, "disable_by_batch_size": None}).enabled
    # left out: the device's default (a CPU step is compute-bound beyond a few rows)
    assert speculative_config_from({"num_speculative_tokens": 3}).disable_by_batch_size == 2
    assert speculative_config_from({"num_speculative_tokens": 3}, "cuda:0").disable_by_batch_size is None
    assert speculative_config_from({"num_speculative_tokens": 3, "disable_by_batch_size": None}).disable_by_batch_size is None
    for bad in ({"num_speculative_tokens": 3, "model": "x", "method": "ngram"}, {"prompt_lookup_max": 3},
                {"num_speculative_tokens": 3, "disable_by_batch_size": 0},
                {"num_speculative_tokens": "3"}, {"num_speculative_tokens": 3, "method": "eagle"},
                {"num_speculative_tokens": -1}, {"num_speculative_tokens": 2, "prompt_lookup_min": 5},
                [3]):
        with pytest.raises(ConfigError):
            speculative_config_from(bad)


# --- scheduling drafts -------------------------------------------------------------------


def running_seq(manager: BlockManager, name: str, prompt: list[int], computed: int,
                drafts: list[int] = ()) -> Sequence:
    seq = Sequence(name, None, prompt, SamplingParams(max_tokens=100), max_total_tokens=512)
    seq.num_computed_tokens = computed
    manager.allocate(seq, computed + 1)
    seq.status = SequenceStatus.RUNNING
    seq.draft_token_ids = list(drafts)
    return seq


def test_drafts_only_take_the_budget_real_tokens_leave():
    manager = BlockManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8), manager)
    scheduler.running = [running_seq(manager, name, [1, 2, 3, 4, 5, 6], 5, [7, 8, 9, 10]) for name in "ABC"]
    out = scheduler.schedule()
    # every decode runs; the 5 tokens left go to drafts, in order
    assert [(i.seq.request_id, i.num_new_tokens, i.draft_token_ids) for i in out.scheduled] == [
        ("A", 5, [7, 8, 9, 10]), ("B", 2, [7]), ("C", 1, [])]
    assert all(not s.draft_token_ids for s in scheduler.running)  # used once


def test_drafts_never_preempt_and_take_only_free_blocks():
    manager = BlockManager(9, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16), manager)
    decoding = running_seq(manager, "A", list(range(10, 20)), 9, [1, 2, 3, 4])   # 3 blocks
    prefill = running_seq(manager, "B", list(range(100, 123)), 15)             # 4 blocks, 8 to go
    scheduler.running = [decoding, prefill]
    out = scheduler.schedule()
    assert not out.preempted
    # B's chunk takes the last 2 free blocks: A's drafts get only the rest of its own
    # third block (slots 10 and 11)
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("A", 3), ("B", 8)]
    assert manager.num_free_blocks == 0


def test_blocks_of_rejected_drafts_are_given_back():
    manager = BlockManager(16, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), manager)
    seq = running_seq(manager, "A", [1, 2, 3, 4, 5, 6, 7], 6, list(range(20, 28)))
    scheduler.running = [seq]
    out = scheduler.schedule()
    assert out.scheduled[0].num_new_tokens == 9 and len(seq.block_table) == 4  # slots 6..14
    scheduler.step_done(out, {seq: 7})  # one draft accepted: 8 tokens valid, slot 8 next
    assert seq.num_computed_tokens == 8
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 13


# --- the engine -----------------------------------------------------------------------------


@pytest.fixture
def make_pair(tiny):
    """make_pair(k=4, **kwargs) -> (plain LLM, speculating LLM) with the same settings."""
    built: list[LLM] = []

    def make(k: int = 4, folder=None, lookup_min: int = 1, **kwargs) -> tuple[LLM, LLM]:
        kwargs.setdefault("num_kv_blocks", 256)
        kwargs.setdefault("block_size", 4)
        kwargs.setdefault("dtype", "float32")
        spec = {"num_speculative_tokens": k, "prompt_lookup_min": lookup_min, "disable_by_batch_size": None}
        pair = (LLM(folder or tiny, show_progress=False, **kwargs),
                LLM(folder or tiny, show_progress=False, speculative_config=spec, **kwargs))
        built.extend(pair)
        return pair

    yield make
    assert_idle_and_free(built)


def assert_idle_and_free(llms: list[LLM]) -> None:
    for llm in llms:
        engine = llm.engine
        assert not engine.has_unfinished()
        assert engine.block_manager.all_free()
        assert engine.requests == {}


def tokens_and_text(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


def assert_speculated(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0, stats
    assert stats.spec_accepted_tokens <= stats.spec_draft_tokens


def greedy(max_new_tokens: int = 32, **kwargs) -> SamplingParams:
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kwargs)


def test_greedy_outputs_equal_plain_decoding(make_pair):
    plain, spec = make_pair()
    assert spec.engine.runner.graph_limits.max_rows == 64 * 5  # every sequence verifying 4 drafts
    expected = plain.generate(TEXTS, greedy())
    assert tokens_and_text(spec.generate(TEXTS, greedy())) == tokens_and_text(expected)
    assert_speculated(spec)
    stats = spec.engine.stats()
    assert stats.spec_mean_acceptance_length > 1.0


def test_history_dependent_sampling_sees_the_drafts_before_each_position(make_pair):
    """Penalties, min_tokens and logit_bias at the row verifying draft j apply to the
    history plus drafts 1..j-1: greedy outputs still equal plain decoding's."""
    plain, spec = make_pair()
    params = [greedy(repetition_penalty=1.3), greedy(frequency_penalty=0.4, presence_penalty=0.2),
              greedy(min_tokens=20, ignore_eos=False), greedy(logit_bias={5: 3.0, 17: -50.0}),
              greedy(repetition_penalty=0.7)] * 2
    prompts = (TEXTS * 2)[:len(params)]
    assert tokens_and_text(spec.generate(prompts, params)) == tokens_and_text(plain.generate(prompts, params))
    assert_speculated(spec)


def test_each_verifying_row_sees_the_drafts_before_it(make_pair, monkeypatch):
    """What penalties and min_tokens read: the row verifying draft j of a sequence has the
    sequence's tokens plus drafts 1..j-1 as its history (n-gram drafts repeat earlier
    tokens, so outputs alone rarely show a mistake here)."""
    _, spec = make_pair()
    expected, actual = [], []
    run_sample, sample = ModelRunner._sample, Sampler.sample

    def runner_spy(self, inputs, passes):
        for item in inputs.sampled_rows:
            for j in range(len(item.draft_token_ids) + 1):
                drafts = item.draft_token_ids[:j]
                expected.append((item.seq.token_ids + drafts, item.seq.output_token_ids + drafts))
        return run_sample(self, inputs, passes)

    def sampler_spy(self, logits, batch):
        assert logits.shape[0] == len(batch.params)
        actual.extend((list(batch.all_ids(i)), batch.output_ids(i)) for i in range(len(batch.params)))
        return sample(self, logits, batch)

    monkeypatch.setattr(ModelRunner, "_sample", runner_spy)
    monkeypatch.setattr(Sampler, "sample", sampler_spy)
    spec.generate(TEXTS, greedy(frequency_penalty=0.01))
    assert_speculated(spec)
    assert len(expected) > spec.engine.stats().spec_draft_tokens
    assert actual == expected


def test_stops_inside_accepted_drafts_end_the_output_where_plain_decoding_does(make_pair):
    plain, spec = make_pair()
    full = [o.outputs[0].token_ids for o in plain.generate(TEXTS, greedy())]
    params = []
    for i, tokens in enumerate(full):
        if i % 3 == 0:
            params.append(greedy(stop_token_ids=[tokens[5 + i % 7]]))
        elif i % 3 == 1:
            text = plain.tokenizer.decode(tokens[:9 + i])
            params.append(greedy(stop=[text[-4:]], include_stop_str_in_output=i % 2 == 0))
        else:
            params.append(greedy(max_new_tokens=3 + i))  # length limits fall inside drafts
    expected = plain.generate(TEXTS, params)
    assert {o.outputs[0].finish_reason for o in expected} >= {"stop_sequence", "length"}
    assert tokens_and_text(spec.generate(TEXTS, params)) == tokens_and_text(expected)
    assert_speculated(spec)


def test_logprobs_of_accepted_tokens_match(make_pair):
    plain, spec = make_pair()
    params = greedy(logprobs=3)
    expected, got = plain.generate(TEXTS[:4], params), spec.generate(TEXTS[:4], params)
    assert tokens_and_text(got) == tokens_and_text(expected)
    for want, have in zip(expected, got):
        a, b = want.outputs[0], have.outputs[0]
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
        assert len(b.logprobs) == len(a.logprobs)
        for pa, pb in zip(a.logprobs, b.logprobs):
            assert list(pa) == list(pb)
            assert [x.logprob for x in pb.values()] == pytest.approx([x.logprob for x in pa.values()], abs=1e-4)


def test_no_step_writes_past_max_model_len(make_pair, monkeypatch):
    plain, spec = make_pair(max_model_len=24)
    highest = []
    launch = ModelRunner.launch

    def spy(self, scheduled, previous=None):
        step = launch(self, scheduled, previous)
        highest.append(int(step.inputs.positions.max()))
        return step

    monkeypatch.setattr(ModelRunner, "launch", spy)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    expected = plain.generate(TEXTS[:6], params)
    highest.clear()
    assert tokens_and_text(spec.generate(TEXTS[:6], params)) == tokens_and_text(expected)
    assert max(highest) < 24
    assert all(o.outputs[0].finish_reason == "length" for o in expected)
    assert_speculated(spec)


def test_preemption_prefix_caching_and_small_budgets_keep_outputs(make_pair):
    # few blocks: sequences get preempted and recomputed; drafts never cause a preemption
    plain, spec = make_pair(num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=16)
    expected = plain.generate(TEXTS, greedy(40))
    got = spec.generate(TEXTS, greedy(40))
    assert tokens_and_text(got) == tokens_and_text(expected)
    assert spec.engine.scheduler.num_preemptions > 0
    assert_speculated(spec)
    # the same prompts again reuse cached blocks, among them blocks filled by accepted drafts
    hits = spec.engine.block_manager.prefix_hits
    again = [p + "".join(o.outputs[0].text) for p, o in zip(TEXTS, got)]
    assert tokens_and_text(spec.generate(again, greedy(8))) == tokens_and_text(plain.generate(again, greedy(8)))
    assert spec.engine.block_manager.prefix_hits > hits


def test_n_and_best_of_and_streamed_deltas(make_pair):
    plain, spec = make_pair()
    params = SamplingParams(temperature=0.3, max_new_tokens=24, n=2, best_of=3, seed=7, ignore_eos=True)
    outs = spec.generate(TEXTS[:3], params)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [24] * 6
    assert_streamed_deltas_add_up(plain, spec)


def assert_streamed_deltas_add_up(plain: LLM, spec: LLM) -> None:
    """One request stepped by hand: some step hands out several tokens at once, and the
    deltas add up to the final output, which is plain decoding's."""
    spec.engine.add_request("s", TEXTS[0], greedy(30))
    texts, ids, multi = [], [], False
    while spec.engine.has_unfinished():
        for out in spec.engine.step():
            c = out.outputs[0]
            texts.append(c.delta_text)
            ids += c.delta_token_ids
            multi |= len(c.delta_token_ids) > 1
            final = c
    assert multi  # a step handed out several tokens at once
    assert ids == final.token_ids and "".join(texts) == final.text
    assert final.text == plain.generate([TEXTS[0]], greedy(30))[0].outputs[0].text


def test_unseeded_sampling_follows_the_model_distribution(make_pair):
    """Unseeded rows draw from the engine's generator, several per verifying sequence: the
    tokens still have plain sampling's distribution. The prompt is the tiny model's own
    greedy loop, so the proposer drafts it and, at a low temperature, a good share of
    drafts is accepted and the rest rejected. Token frequencies per position over many
    requests: speculative vs plain may differ no more than two plain runs do (the engines'
    generators are seeded, so this is deterministic)."""
    plain, spec = make_pair(k=3, num_kv_blocks=512, max_num_seqs=64)
    loop = plain.generate([TEXTS[1]], greedy(48))[0].outputs[0].token_ids
    prompt = list(plain.engine.encode(TEXTS[1])) + list(loop)
    num = 4000
    params = SamplingParams(temperature=0.03, max_new_tokens=4, ignore_eos=True)

    def frequencies(llm: LLM) -> list[collections.Counter]:
        outs = llm.generate([prompt] * num, params, use_tqdm=False)
        return [collections.Counter(o.outputs[0].token_ids[i] for o in outs) for i in range(4)]

    def distance(a: collections.Counter, b: collections.Counter) -> float:
        return sum(abs(a[t] - b[t]) for t in set(a) | set(b)) / (2 * num)

    reference, other, speculative = frequencies(plain), frequencies(plain), frequencies(spec)
    stats = spec.engine.stats()
    assert 0.1 < stats.spec_acceptance_rate < 0.9, stats  # both outcomes are exercised
    for position in range(4):
        noise = distance(reference[position], other[position])
        assert distance(reference[position], speculative[position]) < max(0.04, 1.5 * noise), position


def test_seeded_sampling_gives_plain_decodings_tokens(make_pair):
    """A seeded sequence's generator is rewound to the tokens a step kept, so its output
    does not depend on what was drafted: equal to plain decoding, token for token."""
    plain, spec = make_pair(k=3, max_num_seqs=16)
    loop = plain.generate([TEXTS[1]], greedy(48))[0].outputs[0].token_ids
    prompt = list(plain.engine.encode(TEXTS[1])) + list(loop)
    params = [SamplingParams(temperature=t, top_p=0.95, max_new_tokens=12, seed=s, ignore_eos=True)
              for s in range(32) for t in (0.03, 0.3)]
    prompts = [prompt] * len(params)
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert tokens_and_text(spec.generate(prompts, params, use_tqdm=False)) == tokens_and_text(expected)
    stats = spec.engine.stats()
    assert 0.1 < stats.spec_acceptance_rate < 0.9, stats


def test_structured_outputs_get_no_drafts(make_pair):
    plain, spec = make_pair()
    params = SamplingParams(temperature=0.0, max_new_tokens=16, structured_outputs={"regex": "[ab ]{1,16}"})
    assert tokens_and_text(spec.generate(TEXTS[:2], params)) == tokens_and_text(plain.generate(TEXTS[:2], params))
    assert spec.engine.stats().spec_draft_tokens == 0


def test_no_drafts_above_disable_by_batch_size(tiny):
    params = greedy(24)
    llm = LLM(tiny, show_progress=False, num_kv_blocks=256, block_size=4, dtype="float32",
              speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                  "disable_by_batch_size": 2})
    # decode graphs cover the rows a step can have: 64 sequences, or 2 verifying 1 + 4 rows
    assert llm.engine.runner.graph_limits.max_rows == 64
    llm.generate(TEXTS[:3], params)
    assert llm.engine.stats().spec_draft_tokens == 0  # three sequences: never speculated
    llm.generate(TEXTS[:2], params)
    assert_speculated(llm)


def test_async_scheduling_and_speculation_are_refused(tiny):
    with pytest.raises(ConfigError, match="speculative"):
        LLM(tiny, show_progress=False, num_kv_blocks=64, async_scheduling=True,
            speculative_config={"num_speculative_tokens": 2})


def test_tensor_parallel_speculation_equals_plain_decoding(make_pair):
    """The other ranks run the same verifying rows (their inputs carry them) and join the
    LM head's one pass over every row's logits."""
    plain, _ = make_pair()
    expected = plain.generate(TEXTS[:4], greedy(24))
    with LLM(plain.engine.config.model.model, show_progress=False, num_kv_blocks=256, block_size=4,
             dtype="float32", tensor_parallel_size=2,
             speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                 "disable_by_batch_size": None}) as llm:
        assert tokens_and_text(llm.generate(TEXTS[:4], greedy(24))) == tokens_and_text(expected)
        assert_speculated(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_speculation_replays_cuda_graphs_and_equals_plain_decoding(tiny):
    """On the GPU the verifying rows run through the Triton decode kernel inside captured
    CUDA graphs (max_num_seqs x (1 + k) rows are captured); float32 greedy outputs equal
    plain decoding's."""
    kwargs = dict(dtype="float32", device="cuda", num_kv_blocks=256, block_size=16, max_num_seqs=4,
                  show_progress=False)
    with LLM(tiny, **kwargs) as plain:
        expected = plain.generate(TEXTS, greedy(40), use_tqdm=False)
    spec = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": None}
    with LLM(tiny, speculative_config=spec, **kwargs) as llm:
        assert llm.engine.runner.graphs.inputs.buckets[-1] == 16  # 4 sequences x (1 + 3)
        assert tokens_and_text(llm.generate(TEXTS, greedy(40), use_tqdm=False)) == tokens_and_text(expected)
        assert_speculated(llm)
