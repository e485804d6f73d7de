"""`tessera bench kv-cache`: an 8-bit KV cache beside the model-dtype one, in one run.

The cache's dtype is fixed when an engine is built, so the run builds one engine per cache
(the model dtype first) with the same settings and measures each the same way:
- capacity: bytes per cached token, and the tokens the sized cache holds;
- speed: per --batch-sizes, greedy requests of --input-len random tokens; prefill tokens/s
  until every request has its first token, then decode tokens/s for the rest (decode
  attention reads the whole context per step, so long inputs show what halving its bytes
  gives);
- accuracy: teacher-forced negative log-likelihood of text the package always has (its own
  source files) and how far each token's logprob moves from the model-dtype cache's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tessera.bench.workload import Workload, median
from tessera.engine.engine import Engine
from tessera.llm import LLM
from tessera.sampling.params import SamplingParams

# tessera's own source: natural-enough text that ships with every install
TEXT_FILES = ("engine/scheduler.py", "engine/block_manager.py", "runner/model_runner.py", "sampling/sampler.py")
TEXT_TOKENS = 1024  # per file


@dataclass
class KVSpeedResult:
    engine: str                 # "tessera, kv auto" / "tessera, kv fp8"
    batch_size: int
    decode_tokens_per_s: float  # output tokens after each request's first, over the time they took
    prefill_tokens_per_s: float


@dataclass
class KVCacheSummary:
    engine: str
    kv_dtype: str
    kv_bytes_per_token: int
    cache_tokens: int           # what the sized cache holds
    nll: float                  # mean over the text's tokens, nats
    mean_abs_logprob_change: float  # against the first (model-dtype) cache, per token


def text_prompts(engine: Engine) -> list[list[int]]:
    root = Path(__file__).resolve().parents[1]
    limit = min(TEXT_TOKENS, engine.max_model_len - 1)
    return [engine.encode((root / name).read_text())[:limit] for name in TEXT_FILES]


def teacher_forced_logprobs(engine: Engine, prompts: list[list[int]]) -> list[float]:
    """Each prompt token's logprob given the tokens before it, all prompts in order."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=0)
    ids = [f"kv-text-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    outputs = {o.request_id: o for o in engine.iter_outputs(ids, stream=False)}
    return [lp[t].logprob for i, p in zip(ids, prompts)
            for t, lp in zip(p[1:], outputs[i].prompt_logprobs[1:])]


def timed_batch(engine: Engine, prefix: str, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(seconds until every request has its first token, seconds after that to the end)."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}-{i}", prompt, params)
    waiting = {f"{prefix}-{i}" for i in range(len(prompts))}
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            waiting.discard(out.request_id)
        if first is None and not waiting:
            first = time.perf_counter()
    return first - started, time.perf_counter() - first


def kv_cache_bench(make_llm: Callable[[str], LLM], kv_dtypes: list[str], batch_sizes: list[int],
                   input_len: int, output_len: int, repeats: int) -> tuple[list[KVSpeedResult], list[KVCacheSummary]]:
    """`make_llm(kv_dtype)` builds the engine for one cache; the first of `kv_dtypes` is the
    baseline the logprob changes are measured against."""
    speed, summary, reference = [], [], None
    for kv in kv_dtypes:
        label = f"tessera, kv {kv}"
        with make_llm(kv) as llm:
            engine = llm.engine
            logprobs = teacher_forced_logprobs(engine, text_prompts(engine))
            reference = reference or logprobs
            change = sum(abs(a - b) for a, b in zip(logprobs, reference)) / len(logprobs)
            per_token = engine.runner.kv_bytes_per_block() // engine.config.cache.block_size
            summary.append(KVCacheSummary(label, str(engine.runner.kv_cache_dtype).removeprefix("torch."),
                                          per_token, engine.num_blocks * engine.config.cache.block_size,
                                          -sum(logprobs) / len(logprobs), change))
            for size in batch_sizes:
                prompts = Workload(size, input_len, output_len).prompts(engine.router.config.vocab_size,
                                                                        engine.router.eos_token_ids)
                runs = [timed_batch(engine, f"kv-{size}-{r}", prompts, output_len) for r in range(repeats + 1)][1:]
                prefill, decode = median([r[0] for r in runs]), median([r[1] for r in runs])
                speed.append(KVSpeedResult(label, size, size * (output_len - 1) / decode, size * input_len / prefill))
    return speed, summary
