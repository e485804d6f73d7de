"""Captured decode graphs (CPU) against the eager path: the same tokens and logprobs for
batches that shrink through the buckets (padded rows), mixed prefill/decode steps (which
run eagerly) between replays, seeded sampling; graphs turn themselves off for a model
without CPU kernels, and are dropped when the KV cache is replaced."""
from __future__ import annotations

import pytest

from tessera import LLM, SamplingParams
from tessera.ops.cpu.build import unavailable_reason

UNAVAILABLE = unavailable_reason("gemm_bf16.c")
pytestmark = [pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE)),
              pytest.mark.usefixtures("one_thread")]

PROMPTS = [[5, 6, 7], list(range(10, 41)), [40] * 9, list(range(100, 117)), [3, 9] * 12]
# lengths that retire sequences one by one: 5 rows (bucket 8), then 4, 3 (4), 2, 1
NEW_TOKENS = [6, 11, 17, 24, 30]


def run(llm: LLM, temperature: float = 0.0, count: int = len(PROMPTS)) -> list[tuple[list[int], list]]:
    params = [SamplingParams(max_new_tokens=n, temperature=temperature, seed=i, logprobs=3,
                             ignore_eos=True) for i, n in enumerate(NEW_TOKENS[-count:])]
    outs = llm.generate(PROMPTS[-count:], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_replayed_decode_equals_eager(make_tiny_llama, quantization, temperature):
    folder, _ = make_tiny_llama(seed=3)
    # int8 takes another kernel path from 8 rows (see gemm_int8.c), so a step padded
    # across 8 rows is not bit-equal to its eager twin: keep int8 batches under 8
    count = 4 if quantization else 5
    buckets = [1, 2, 4] if quantization else [1, 2, 4, 8]
    results = {}
    for eager in (True, False):
        with LLM(folder, dtype="bfloat16", quantization=quantization, num_kv_blocks=64,
                 block_size=8, enforce_eager=eager, show_progress=False) as llm:
            results[eager] = run(llm, temperature, count)
            graphs = llm.engine.runner.graphs
            if eager:
                assert graphs is None
            else:
                assert graphs.enabled and graphs.captured_sizes == buckets
    assert results[False] == results[True]


def test_chunked_prefill_steps_run_eagerly_between_replays(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=4)
    results = {}
    for eager in (True, False):
        # 16 tokens a step: prompts arrive in chunks while earlier ones decode
        with LLM(folder, dtype="bfloat16", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, max_num_seqs=8,
                 enforce_eager=eager, show_progress=False) as llm:
            results[eager] = run(llm)
            if not eager:
                assert llm.engine.runner.graphs.captured_sizes
    assert results[False] == results[True]


def test_graphs_turn_off_for_a_model_without_cpu_kernels(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=5)
    results = {}
    for eager in (True, False):
        with LLM(folder, dtype="float32", num_kv_blocks=64, block_size=8, enforce_eager=eager,
                 show_progress=False) as llm:
            results[eager] = run(llm)
            if not eager:
                graphs = llm.engine.runner.graphs
                assert not graphs.enabled and graphs.captured_sizes == []
    assert results[False] == results[True]


def test_replacing_the_kv_cache_drops_the_graphs(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=6)
    with LLM(folder, dtype="bfloat16", num_kv_blocks=64, block_size=8,
             enable_prefix_caching=False, show_progress=False) as llm:
        first = run(llm)
        runner = llm.engine.runner
        assert runner.graphs.captured_sizes
        runner.allocate_kv_cache(runner.num_blocks)  # new cache tensors
        assert runner.graphs.captured_sizes == []
        assert run(llm) == first
