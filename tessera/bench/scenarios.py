"""Scenario benchmarks that compare an engine feature on and off in the same run:
prefix caching (TTFT of a request sharing a long prefix with an earlier one) and chunked
prefill (inter-token latency of running decodes while a long prompt arrives)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from tessera.bench.workload import Workload, median
from tessera.engine.engine import Engine
from tessera.sampling.params import SamplingParams

ONE_TOKEN = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass
class PrefixResult:
    engine: str            # "tessera, prefix caching on|off"
    ttft_ms: float         # of the second request (shared prefix + own suffix)
    prefix_len: int
    suffix_len: int


@dataclass
class ChunkedResult:
    engine: str            # "tessera, chunked prefill on|off"
    max_itl_ms: float      # worst gap between tokens of the running decodes
    p50_itl_ms: float
    long_prompt_ttft_ms: float
    num_decodes: int


def _run_to_end(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def prefix_ttft(engine: Engine, prefix_len: int, suffix_len: int, repeats: int) -> list[PrefixResult]:
    vocab = engine.router.config.vocab_size
    results = []
    saved = engine.block_manager.enable_prefix_caching
    try:
        for caching in (True, False):
            engine.block_manager.enable_prefix_caching = caching
            times = []
            for r in range(repeats):
                # a fresh prefix per repeat and mode, so nothing is cached from before
                work = Workload(3, prefix_len + suffix_len, 1, seed=1000 * r + caching)
                first, second, _ = work.prompts(vocab, engine.router.eos_token_ids)
                second = first[:prefix_len] + second[prefix_len:]
                _run_to_end(engine, f"prefix-a-{caching}-{r}", first, ONE_TOKEN)
                times.append(_run_to_end(engine, f"prefix-b-{caching}-{r}", second, ONE_TOKEN))
            label = f"tessera, prefix caching {'on' if caching else 'off'}"
            results.append(PrefixResult(label, median(times) * 1e3, prefix_len, suffix_len))
    finally:
        engine.block_manager.enable_prefix_caching = saved
    return results


def chunked_itl(engine: Engine, num_decodes: int, long_len: int, chunk_tokens: int) -> list[ChunkedResult]:
    """`num_decodes` requests decode; once they run, a `long_len`-token prompt arrives.
    Chunked: a step budget of `chunk_tokens`. Unchunked: the whole prompt in one step."""
    vocab = engine.router.config.vocab_size
    saved = engine.scheduler.config
    saved_caching = engine.block_manager.enable_prefix_caching
    engine.block_manager.enable_prefix_caching = False  # measure prefill, not cache hits
    results = []
    try:
        for chunked in (True, False):
            budget = chunk_tokens if chunked else long_len + num_decodes
            engine.scheduler.config = dataclasses.replace(
                saved, enable_chunked_prefill=chunked, max_num_batched_tokens=budget,
                max_num_seqs=max(num_decodes + 1, min(saved.max_num_seqs, budget)))
            prompts = Workload(num_decodes + 1, long_len, 1, seed=7 + chunked).prompts(
                vocab, engine.router.eos_token_ids)
            decode = SamplingParams(max_new_tokens=10_000, temperature=0.0, ignore_eos=True)
            ids = [f"decode-{chunked}-{i}" for i in range(num_decodes)]
            for request_id, p in zip(ids, prompts):
                engine.add_request(request_id, p[:16], decode)
            for _ in range(4):  # all are decoding now
                engine.step()
            last = time.perf_counter()
            arrival = last
            engine.add_request(f"long-{chunked}", prompts[-1], ONE_TOKEN)
            gaps, ttft = [], None
            while ttft is None:
                outs = engine.step()
                now = time.perf_counter()
                if any(o.request_id in ids for o in outs):
                    gaps.append(now - last)
                    last = now
                if any(o.request_id == f"long-{chunked}" for o in outs):
                    ttft = now - arrival
            for request_id in ids:
                engine.abort(request_id)
            label = f"tessera, chunked prefill {'on' if chunked else 'off'}"
            results.append(ChunkedResult(label, max(gaps) * 1e3, median(gaps) * 1e3, ttft * 1e3, num_decodes))
    finally:
        engine.scheduler.config = saved
        engine.block_manager.enable_prefix_caching = saved_caching
    return results
