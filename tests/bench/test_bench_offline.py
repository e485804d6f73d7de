"""The offline benchmarks measure full prefills on every repeat: repeating the same
prompts must not let the prefix cache answer them (the transformers baseline has none)."""
from __future__ import annotations

import pytest

from tessera import LLM
from tessera.bench.offline import tessera_latency, tessera_throughput
from tessera.bench.workload import Workload

pytestmark = pytest.mark.usefixtures("one_thread")


def test_repeats_never_hit_the_prefix_cache(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=2)
    with LLM(folder, dtype="float32", num_kv_blocks=128, block_size=4, show_progress=False) as llm:
        work = Workload(3, 24, 4)
        prompts = work.prompts(512)
        for run in (lambda: tessera_latency(llm, work, prompts, repeats=3),
                    lambda: tessera_throughput(llm, prompts, [4] * 3, repeats=3)):
            llm.reset_prefix_cache()  # the other run's blocks (its warm-up may hit them)
            before = llm.engine.stats()
            run()
            after = llm.engine.stats()
            assert after.prefix_cache_queries > before.prefix_cache_queries
            assert after.prefix_cache_hits == before.prefix_cache_hits
