"""Multi-LoRA serving end to end: PEFT adapters on a tiny Llama give PEFT's greedy tokens and
logprobs (attention, MLP, all projections, one shard of a packed layer, rsLoRA, alpha and
rank patterns, one layer only); adapters and the base model share batches (chunked prefill,
async scheduling, preemption, more adapters than slots, tensor parallelism, speculative
decoding) without changing any output, and no adapter starves; the prefix cache never hands
KV across adapters. Every engine ends with all KV blocks free. (Adding, removing and
refusing adapters: test_lora_registry.py.)"""
from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tests.lora.engine_cases import (ATTENTION, FP32_ATOL, MLP, NEW_TOKENS, PROMPTS, base_reference,
                                     check_idle, hf_logprobs, mixed_requests, prompt_ids, run)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest

# --- parity with PEFT ----------------------------------------------------------------------

PARITY_CASES = {
    "attention": dict(target_modules=ATTENTION),
    "mlp": dict(target_modules=MLP),
    "all": dict(target_modules=ATTENTION + MLP),
    # one shard of the packed QKV layer: the q and v rows must get nothing
    "k_only": dict(target_modules=["k_proj"], std=0.3),
    "rslora": dict(target_modules=ATTENTION + MLP, use_rslora=True),
    "alpha_pattern": dict(target_modules=["q_proj", "v_proj", "down_proj"], alpha_pattern={"v_proj": 64}),
    # shards of one packed layer with different ranks (q 4, v 8), and a per-layer alpha
    "rank_pattern": dict(target_modules=["q_proj", "v_proj", "up_proj"], rank_pattern={"q_proj": 4},
                         alpha_pattern={"model.layers.1.mlp.up_proj": 2}),
    "one_layer": dict(target_modules=ATTENTION + MLP, layers_to_transform=[1]),
    "max_rank": dict(target_modules=["q_proj", "gate_proj", "o_proj"], r=16, lora_alpha=8),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_greedy_tokens_and_logprobs_equal_peft(case, base, make_adapter, make_llm):
    adapter = make_adapter(seed=11, **PARITY_CASES[case])
    llm = make_llm(max_loras=1, max_lora_rank=16)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    outs = llm.generate(PROMPTS, params, lora_request=adapter.request(case))
    changed = False
    for prompt, out in zip(PROMPTS, outs):
        got = out.outputs[0].token_ids
        assert got == adapter.reference(prompt), prompt
        full = prompt + got
        want = hf_logprobs(adapter.model, full)
        # row p - 1 predicts token p: the prompt's (prefill) then the generated ones (decode)
        targets = torch.tensor(full[1:])[:, None]
        want_chosen = want[:-1].gather(1, targets)[:, 0]
        got_prompt = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
        got_new = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, got)]
        torch.testing.assert_close(torch.tensor(got_prompt + got_new), want_chosen, atol=FP32_ATOL, rtol=0)
        base_lp = hf_logprobs(base[1], full)[:-1].gather(1, targets)[:, 0]
        changed |= bool((base_lp - want_chosen).abs().max() > 100 * FP32_ATOL)
    assert changed, "the adapter does not change the model: the test could not tell"


# --- adapters and the base model in one batch ----------------------------------------------

MIXED_SETTINGS = {
    "default": {},
    # a 16-token budget: prompts prefill in chunks while other rows decode
    "chunked": dict(max_num_batched_tokens=16, max_num_seqs=8),
    "async": dict(async_scheduling=True),
    "eager": dict(enforce_eager=True),
}


@pytest.mark.parametrize("setting", list(MIXED_SETTINGS))
def test_mixed_batch_equals_each_alone(setting, base, trio, make_llm):
    a, b, _ = trio
    llm = make_llm(max_loras=2, **MIXED_SETTINGS[setting])
    ra, rb = a.request("a", 1), b.request("b", 2)
    prompts = PROMPTS + PROMPTS[::-1]
    loras = [ra, None, rb, ra, rb, None]
    adapters = {id(ra): a, id(rb): b}
    expected = [adapters[id(lora)].reference(p) if lora is not None else base_reference(base, p)
                for p, lora in zip(prompts, loras)]
    assert run(llm, prompts, loras) == expected
    if setting == "default":  # and each alone, on the same engine
        assert [run(llm, [p], lora)[0] for p, lora in zip(prompts, loras)] == expected
    assert len({tuple(t) for t in expected}) == len(expected)  # every row is told apart


def spy_on_adapters_per_step(llm: LLM) -> list[list[str | None]]:
    """Record, per scheduled step, the adapter (None: the base model) of each sequence it runs."""
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    steps: list[list[str | None]] = []

    def spy():
        plan = schedule()
        steps.append([None if s.seq.lora is None else s.seq.lora.name for s in plan.scheduled])
        return plan

    scheduler.schedule = spy
    return steps


@pytest.mark.parametrize("num_kv_blocks", [64, 6])
def test_more_adapters_than_slots(num_kv_blocks, base, trio, make_llm):
    """One slot, three adapters and the base model interleaved: the scheduler passes over
    requests whose adapter cannot join the batch and the slot is reloaded as adapters take
    turns; with 6 blocks (of 16) sequences are also preempted and recomputed."""
    llm = make_llm(max_loras=1, num_kv_blocks=num_kv_blocks)
    steps = spy_on_adapters_per_step(llm)
    prompts, loras, expected = mixed_requests(base, trio, "abc", [0, 1, None, 2, 0, None, 1, 2])
    assert run(llm, prompts, loras) == expected
    assert all(len(set(step) - {None}) <= 1 for step in steps)
    assert {name for step in steps for name in step} == {"a", "b", "c", None}
    # the first step passes over b; behind it only the base model's requests go ahead (the
    # second request of a waits, or a stream of them could starve b): with 64 blocks a and
    # both base requests run, with 6 only a and the first base request fit
    assert steps[0].count("a") == 1 and steps[0].count(None) == (2 if num_kv_blocks == 64 else 1)
    if num_kv_blocks == 6:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.all_free()



def test_a_stream_of_one_adapter_cannot_starve_another(trio, make_llm):
    """One slot: while b waits for it, new requests of a (which holds it) queue behind b
    instead of keeping a's slot taken forever; the base model's still go ahead."""
    llm = make_llm(max_loras=1)
    engine = llm.engine
    requests = [t.request(name, i + 1) for i, (name, t) in enumerate(zip("ab", trio))]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a-0", PROMPTS[0], params, requests[0])
    engine.add_request("b", PROMPTS[1], params, requests[1])
    finished: dict[str, int] = {}
    for step in range(200):
        if step % 3 == 0:  # a new request of a every third step, and one of the base model
            engine.add_request(f"a-{step + 1}", PROMPTS[0], params, requests[0])
            engine.add_request(f"base-{step + 1}", PROMPTS[2], params)
        finished.update((out.request_id, step) for out in engine.step() if out.finished)
        if "b" in finished:
            break
    assert "b" in finished and finished["b"] < 40
    assert any(r.startswith("base-") and s < finished["b"] for r, s in finished.items())
    for request_id in list(engine.requests):
        engine.abort(request_id)
    check_idle(llm)


# --- the prefix cache ----------------------------------------------------------------------

def test_prefix_cache_is_never_shared_across_adapters(base, trio, make_llm):
    a, b, _ = trio
    llm = make_llm(max_loras=2, block_size=16)
    prompt = prompt_ids(70, seed=99)  # 4 full blocks of 16, then 6 tokens
    ra, rb = a.request("a", 1), b.request("b", 2)
    cold = {None: base_reference(base, prompt), "a": a.reference(prompt), "b": b.reference(prompt)}
    assert len({tuple(v) for v in cold.values()}) == 3

    def hits() -> int:
        return llm.engine.stats().prefix_cache_hits

    for lora, key in ((None, None), (ra, "a"), (rb, "b")):
        assert run(llm, [prompt], lora) == [cold[key]]
    assert hits() == 0, "KV computed for one adapter (or the base) was reused for another"
    for lora, key in ((None, None), (ra, "a"), (rb, "b")):  # within one adapter it is reused
        before = hits()
        assert run(llm, [prompt], lora) == [cold[key]]
        assert hits() - before == 64
    # a name loaded again from another folder is another adapter: none of the old KV
    assert llm.engine.remove_lora("a")
    before = hits()
    assert run(llm, [prompt], b.request("a", 1)) == [cold["b"]]
    assert hits() == before


# --- with other features -------------------------------------------------------------------

def test_tensor_parallel_mixed_batch_equals_one_process(base, trio, make_adapter):
    k_only = make_adapter(seed=11, **PARITY_CASES["k_only"])
    adapters = [*trio, k_only]
    prompts, loras, expected = mixed_requests(base, adapters, "abck", [0, 1, None, 2, 3, None, 1, 0])
    # two slots for four adapters: ranks other than the driver reload slots too
    with LLM(base[0], dtype="float32", num_kv_blocks=64, show_progress=False, tensor_parallel_size=2,
             enable_lora=True, max_loras=2) as llm:
        assert llm.engine.tp_group.world_size == 2
        assert run(llm, prompts, loras) == expected
        check_idle(llm)


def test_speculative_decoding_with_adapters_equals_plain_decoding(base, trio, make_llm):
    a, b, _ = trio
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 7, PROMPTS[1]]
    loras = [a.request("a", 1), b.request("b", 2), None]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    plain = run(make_llm(max_loras=2), prompts, loras, params)
    spec = make_llm(max_loras=2, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                     "disable_by_batch_size": None})
    assert run(spec, prompts, loras, params) == plain
    assert plain == [a.reference(prompts[0], 24), b.reference(prompts[1], 24), base_reference(base, prompts[2], 24)]
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 0, "no draft was accepted: nothing was verified"


def sampled(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=seed, ignore_eos=True)


def test_seeded_sampling_with_an_adapter_is_reproducible(trio, make_llm):
    a, b, _ = trio
    prompts = PROMPTS[:2]
    first = run(make_llm(max_loras=2), prompts, a.request("a"), sampled(1234))
    mixed = run(make_llm(max_loras=2), prompts * 2, [a.request("a"), a.request("a"), None, None], sampled(1234))
    assert mixed[:2] == first
    assert mixed[2:] != first  # the base model samples other tokens from the same seeds
    assert run(make_llm(max_loras=2), prompts, b.request("b"), sampled(1234)) != first
    # n = 2: the second sequence (seed + 1) joins once the first has computed the prompt,
    # and runs with the adapter too
    llm = make_llm(max_loras=2)
    pair = llm.generate(prompts[:1], sampled(1234, n=2), lora_request=a.request("a"))[0]
    second = run(llm, prompts[:1], a.request("a"), sampled(1235))[0]
    assert [c.token_ids for c in pair.outputs] == [first[0], second]
    assert second != run(llm, prompts[:1], None, sampled(1235))[0]
