"""Prefix caching and chunked prefill: outputs never change, blocks are shared and given
back, collisions cannot mix sequences, and decodes keep going while a long prompt is
prefilled in chunks."""
from __future__ import annotations

import pytest

import tessera.engine.block_manager as block_manager_module
from tessera import LLM, SamplingParams
from tessera.engine.block_manager import BlockManager
from tessera.engine.sequence import Sequence

GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
SYSTEM = list(range(10, 47))  # a 37-token shared "system prompt"


def shared_prefix_prompts() -> list[list[int]]:
    return [SYSTEM + [60 + i, 61 + i, 62 + 2 * i][: 1 + i % 3] for i in range(6)] + [SYSTEM[:20] + [99]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


@pytest.fixture(scope="module")
def tiny(make_tiny_llama):
    return make_tiny_llama(seed=1)[0]


@pytest.fixture
def make_llm(tiny):
    built: list[LLM] = []

    def make(**kwargs) -> LLM:
        kwargs.setdefault("num_kv_blocks", 256)
        kwargs.setdefault("block_size", 4)
        llm = LLM(tiny, dtype="float32", show_progress=False, **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        bm = llm.engine.block_manager
        assert not llm.engine.has_unfinished()
        assert bm.all_free(), "idle engine holds blocks"
        assert min(bm.ref_counts) == 0


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def reference(make_llm) -> list[list[int]]:
    return tokens(make_llm(enable_prefix_caching=False).generate(shared_prefix_prompts(), GREEDY))


def test_cached_outputs_equal_uncached_and_hits_are_counted(make_llm):
    expected = reference(make_llm)
    llm = make_llm()
    first = tokens(llm.generate(shared_prefix_prompts()[:1], GREEDY))
    assert first == expected[:1]
    before = llm.engine.stats()
    again = tokens(llm.generate(shared_prefix_prompts(), GREEDY))
    assert again == expected
    stats = llm.engine.stats()
    # every prompt after the first reuses at least the 9 full blocks of SYSTEM it shares
    assert stats.prefix_cache_hits - before.prefix_cache_hits >= 6 * 9 * 4
    assert 0 < stats.prefix_cache_hit_rate < 1


def test_last_prompt_token_is_always_recomputed(make_llm):
    llm = make_llm()
    prompt = list(range(100, 116))  # exactly 4 full blocks of 4
    first = tokens(llm.generate([prompt], GREEDY))
    hits_before = llm.engine.stats().prefix_cache_hits
    second = tokens(llm.generate([prompt], GREEDY))
    assert first == second
    # 3 blocks reused; the 4th holds the last prompt token, whose logits are needed
    assert llm.engine.stats().prefix_cache_hits - hits_before == 12


def test_evictions_and_preemptions_do_not_change_outputs(make_llm):
    expected = reference(make_llm)
    # 24 blocks of 4: the 7 prompts (~40 tokens + 10 new each) cannot all stay resident, so
    # cached blocks are evicted and running sequences preempted along the way.
    llm = make_llm(num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=8)
    for _ in range(2):
        assert tokens(llm.generate(shared_prefix_prompts(), GREEDY)) == expected
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().prefix_cache_hits > 0


def test_hash_collisions_cannot_mix_sequences(make_llm, monkeypatch):
    expected = reference(make_llm)
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, toks: 7)  # all collide
    llm = make_llm()
    assert tokens(llm.generate(shared_prefix_prompts(), GREEDY)) == expected
    assert tokens(llm.generate(shared_prefix_prompts(), GREEDY)) == expected


def test_seeded_sampling_is_unchanged_by_cache_hits(make_llm):
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=11)
    cold = tokens(make_llm(enable_prefix_caching=False).generate(shared_prefix_prompts(), params))
    llm = make_llm()
    llm.generate(shared_prefix_prompts(), GREEDY)  # fill the cache
    assert tokens(llm.generate(shared_prefix_prompts(), params)) == cold


def test_decodes_keep_producing_while_a_long_prompt_is_chunked(make_llm):
    short_params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    alone = tokens(make_llm().generate([[5, 6, 7]], short_params))
    llm = make_llm(max_num_batched_tokens=16, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("short", [5, 6, 7], short_params)
    engine.step()  # prefill of the short request
    engine.add_request("long", list(range(20, 220)), SamplingParams(max_new_tokens=1, temperature=0))
    steps, short_tokens, finals = 0, 0, {}
    while engine.has_unfinished():
        outs = engine.step()
        if "long" not in finals:
            steps += 1
            short_tokens += any(o.request_id == "short" for o in outs)
        finals.update({o.request_id: o for o in outs if o.finished})
    assert steps >= 200 // 16  # the 200-token prompt really was split into chunks
    assert short_tokens == steps  # the decode got a token in every one of those steps
    assert finals["short"].outputs[0].token_ids == alone[0]


def _seq(token_ids: list[int]) -> Sequence:
    return Sequence("r", None, token_ids, SamplingParams(), max_total_tokens=1000)


def test_block_sharing_reference_counts_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = _seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    assert len(a.block_hashes) == 2
    b = _seq([1, 2, 3, 4, 9])
    match = bm.match_prefix(b)
    assert match.blocks == a.block_table[:2] and match.num_free == 0
    assert bm.take_prefix(b, match) == 4
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table] == [1, 1]  # still b's
    bm.free(b)
    assert bm.all_free()
    # freed but cached: a new sequence with the same prefix finds them in the free queue
    c = _seq([1, 2, 3, 4, 7])
    match = bm.match_prefix(c)
    assert len(match.blocks) == 2 and match.num_free == 2
    # allocate everything: the cached blocks are evicted last-freed-last, then forgotten
    d = _seq(list(range(50, 62)))
    bm.allocate(d, 12)
    assert bm.cached == {}
    assert bm.match_prefix(c).blocks == []
    bm.free(d)
    assert bm.all_free()


def test_reset_prefix_cache_forgets_free_blocks_only(make_llm):
    llm = make_llm()
    prompts = shared_prefix_prompts()
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.reset_prefix_cache() > 0
    hits = llm.engine.stats().prefix_cache_hits
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], GREEDY, use_tqdm=False)]
    assert again == first[:1]
    assert llm.engine.stats().prefix_cache_hits == hits  # nothing left to hit
    # blocks a running sequence holds stay cached: a twin admitted while it runs shares them
    engine = llm.engine
    llm.reset_prefix_cache()
    engine.add_request("a", prompts[0], GREEDY)
    engine.step()
    assert llm.reset_prefix_cache() == 0
    engine.add_request("b", prompts[0], GREEDY)
    engine.step()
    assert engine.stats().prefix_cache_hits > hits
    while engine.has_unfinished():
        engine.step()
